"""Coverage-guided fuzzing of the frame decoder and the request-argument checks (atheris).

Usage: ``python -m benchmarks.fuzz_frames [--seconds N]`` (default 60; needs the ``bench``
extra, which installs atheris). Not part of the test run.

Each input goes through what a hostile client reaches on the supervisor's socket:
``LineBuffer.feed`` (in chunks, with a small frame limit), ``decode`` of every line, the
supervisor's refusal path (``_guess_id``) and, for a decoded request, the argument checks of
its ops (``_str_arg``, ``_opt_str``, ``check_session_id``, ``validate_agent_spec``). The input
is also tried as the ``args`` object of a request, to reach the argument checks more often.
Any exception other than ``AgentdError`` is a crash: it is counted, its input saved under
``.bench/fuzz-crashes/``, and fuzzing goes on.

libFuzzer ends the process when the time is up without returning to Python, so the fuzzing
runs in a child process; this parent reads the child's final libFuzzer statistics and crash
log and prints runs, coverage and crashes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CRASH_DIR = Path(".bench/fuzz-crashes")
LIMIT = 4096  # frame limit of the fuzzed LineBuffer: oversized lines are reached quickly


def _child(seconds: int, crash_log: str) -> None:
    import atheris

    with atheris.instrument_imports(include=["trio_agentd"]):
        from trio_agentd._errors import AgentdError
        from trio_agentd._protocol import LineBuffer, Request, decode
        from trio_agentd._session import check_session_id
        from trio_agentd._supervisorops import _guess_id, _opt_str, _str_arg
        from trio_agentd.agents._base import validate_agent_spec

    def check_args(args: dict[str, Any]) -> None:
        for name in ("session", "agent", "cwd", "text"):
            for check in (_str_arg, _opt_str):
                try:
                    value = check(args, name)
                except AgentdError:
                    continue
                if value is None:
                    continue
                for text_check in (check_session_id, validate_agent_spec):
                    with contextlib.suppress(AgentdError):
                        text_check(value)

    def one_frame(line: bytes) -> None:
        try:
            msg = decode(line)
        except AgentdError:
            _guess_id(line)
            return
        if isinstance(msg, Request):
            check_args(msg.args)

    def target(data: bytes) -> None:
        try:
            buf = LineBuffer(LIMIT)
            step = 1 + (data[0] % 64) if data else 1
            for i in range(0, len(data), step):
                try:
                    lines = buf.feed(data[i : i + step])
                except AgentdError:
                    buf = LineBuffer(LIMIT)
                    continue
                for line in lines:
                    one_frame(line)
            one_frame(data)
            one_frame(b'{"type":"request","id":1,"op":"create_session","args":' + data + b"}")
        except AgentdError:
            pass
        except Exception as exc:
            digest = hashlib.sha1(data).hexdigest()
            CRASH_DIR.mkdir(parents=True, exist_ok=True)
            (CRASH_DIR / f"crash-{digest}").write_bytes(data)
            with open(crash_log, "a") as f:
                f.write(json.dumps({"input": digest, "error": repr(exc)[:300]}) + "\n")

    atheris.Setup(
        [sys.argv[0], f"-max_total_time={seconds}", "-print_final_stats=1", "-rss_limit_mb=1024"],
        target,
    )
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--child", metavar="CRASH_LOG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.seconds, args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        crash_log = os.path.join(tmp, "crashes.jsonl")
        Path(crash_log).touch()
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.fuzz_frames", "--seconds", str(args.seconds),
             "--child", crash_log],
            capture_output=True, text=True, check=False,
        )
        crashes = [json.loads(line) for line in Path(crash_log).read_text().splitlines()]
    err = done.stderr
    runs = re.findall(r"^stat::number_of_executed_units:\s*(\d+)", err, re.M)
    covs = re.findall(r"cov: (\d+) ft: (\d+)", err)
    corpus = re.findall(r"corp: (\d+)/", err)
    if not runs and not covs:
        print(err[-3000:], file=sys.stderr)
        print(f"fuzzer did not run (exit {done.returncode})", file=sys.stderr)
        return 2
    print(f"seconds: {args.seconds}")
    print(f"runs: {runs[-1] if runs else '?'}")
    if covs:
        print(f"coverage: {covs[-1][0]} edges, {covs[-1][1]} features")
    print(f"corpus: {corpus[-1] if corpus else '?'} inputs")
    print(f"crashes (non-AgentdError exceptions): {len(crashes)}")
    for crash in crashes[:10]:
        print(f"  {CRASH_DIR}/crash-{crash['input']}: {crash['error']}")
    print(f"libFuzzer exit status: {done.returncode}")
    return 1 if crashes or done.returncode != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
