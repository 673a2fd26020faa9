"""Hostile frames and hostile text against a real supervisor (one raw connection)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

from ..hostile_frames import HOSTILE_FRAMES
from .harness import DaemonEnv


class _Line:
    """A raw connection read line by line (each read bounded by the socket timeout)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(path)
        self.buf = b""

    def send(self, frame: bytes) -> None:
        self.sock.sendall(frame + b"\n")

    def read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "the supervisor closed the connection"
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return dict(json.loads(line))

    def close(self) -> None:
        self.sock.close()


def test_each_hostile_frame_gets_one_bad_request_on_the_same_connection(
    denv: DaemonEnv,
) -> None:
    denv.prompt("first")  # a running supervisor
    conn = _Line(denv.socket)
    try:
        assert conn.read()["type"] == "hello"
        for name, frame in HOSTILE_FRAMES.items():
            conn.send(frame)
            reply = conn.read()
            assert reply["type"] == "response", (name, reply)
            assert reply["ok"] is False, (name, reply)
            assert reply["error"]["code"] == "bad_request", (name, reply)
            # the next frame's reply is the ping's: exactly one reply per hostile frame
            conn.send(json.dumps({"type": "request", "id": name, "op": "ping"}).encode())
            pong = conn.read()
            assert pong["id"] == name, (name, pong)
            assert pong["ok"] is True, (name, pong)
        # a session id with a trailing newline is refused, and creates no directory
        conn.send(json.dumps({"type": "request", "id": "nl", "op": "create_session",
                              "args": {"session": "abc\n"}}).encode())
        reply = conn.read()
        assert (reply["id"], reply["error"]["code"]) == ("nl", "bad_request")
        conn.send(b'{"type":"request","id":"end","op":"ping"}')
        assert conn.read()["ok"] is True
    finally:
        conn.close()
    assert not (denv.home / "sessions" / "abc\n").exists()
    log = denv.log_text()
    assert "Traceback" not in log
    assert "client connection failed" not in log


def test_sessions_table_escapes_an_agent_spec_with_terminal_escapes(denv: DaemonEnv) -> None:
    agent = 'exec:printf "\x1b]0;pwned\x07\u202e"'
    denv.prompt("start")
    conn = _Line(denv.socket)
    try:
        conn.read()
        conn.send(json.dumps({"type": "request", "id": 1, "op": "create_session",
                              "args": {"session": "evil", "agent": agent}}).encode())
        reply = conn.read()
        assert reply["ok"] is True, reply
    finally:
        conn.close()
    cp = denv.run("sessions")
    assert cp.returncode == 0, cp.stderr
    assert "\x1b" not in cp.stdout
    assert "\x07" not in cp.stdout
    assert "\u202e" not in cp.stdout
    assert 'exec:printf "\\x1b]0;pwned\\x07\\u202e"' in cp.stdout
    cp = denv.run("sessions", "--json")
    assert cp.returncode == 0, cp.stderr
    assert agent in [row["agent"] for row in json.loads(cp.stdout)]  # JSON stays raw


def test_error_messages_escape_terminal_sequences(denv: DaemonEnv) -> None:
    # an agent spec quoted back in an error is shown escaped, not run by the terminal
    cp = subprocess.run(
        [sys.executable, "-m", "trio_agentd", "-p", "-s", "x", "--agent",
         "exec:no-such-\x1b]0;pwned\x07-program", "hi"],
        env=denv.env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert cp.returncode != 0
    assert "\x1b" not in cp.stderr
    assert "\x07" not in cp.stderr
    assert "\\x1b]0;pwned\\x07" in cp.stderr
