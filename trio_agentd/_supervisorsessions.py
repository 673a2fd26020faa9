"""The supervisor's session table: one handle per session, and the claims on sessions.

Theory of operation
-------------------
A session is looked up and created with no await between the two (no lock: a lock's
checkpoint would make a burst of new sessions queue one scheduling round each), so two
commands for a new session make one handle. A session lives in one supervisor at a time:
:meth:`SessionTable.claim_session` refuses one whose worker runs under another socket and
adopts an abandoned one. Killed sessions are remembered (a resent command of theirs is
answered ``session_killed``, not run in a session made anew); a session being removed makes
its commands wait, then start it anew. Every handle's supervise task runs in the service
nursery, each in its own cancel scope.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import trio

from . import _fs
from ._errors import AgentdError, ErrorCode
from ._handle import WorkerHandle
from ._identity import is_alive
from ._paths import Layout
from ._procops import ProcessWorkerOps
from ._recovery import Mode, StopReason
from ._session import check_session_id, read_meta, write_meta
from ._trust import agent_environment
from ._wirestr import shown as shown_path
from ._workerlink import WorkerDropped
from .agents._base import validate_agent_spec
from .timing import Timing, kill_answer_bound

log = logging.getLogger("trio_agentd.supervisor")


@dataclass(slots=True, kw_only=True)
class SessionTable:
    """Every session this supervisor keeps, by id (stopped ones too), and how they come and go.

    Attributes:
        default_agent: the agent of a new session prompted without one.
        max_sessions: beyond it a new session gets ``resource_exhausted``.
    """

    layout: Layout
    timing: Timing
    ops: ProcessWorkerOps
    default_agent: str
    max_sessions: int
    sessions: dict[str, WorkerHandle] = field(default_factory=dict, init=False)
    # sessions killed in this supervisor's life and not made anew since: a resent command
    # of theirs is answered session_killed, not run in a new session
    killed: set[str] = field(default_factory=set, init=False)
    # read at startup, adopted once the service nursery runs
    loaded: list[tuple[WorkerHandle, bool, Mode]] = field(default_factory=list, init=False)
    # sessions being removed (`trio-agentd rm`): a command for one waits until it is gone,
    # then makes it anew
    _removing: dict[str, trio.Event] = field(default_factory=dict, init=False)
    _nursery: trio.Nursery | None = field(default=None, init=False)

    @property
    def nursery(self) -> trio.Nursery:
        """The service nursery, where every session's supervise task runs."""
        assert self._nursery is not None
        return self._nursery

    def bind_nursery(self, service: trio.Nursery) -> None:
        self._nursery = service

    async def adopt_loaded(self) -> None:
        """Adoption: every descriptor's session at once, in the service nursery (commands for
        a session wait until it is ready)."""
        for h, alive, lifecycle in self.loaded:
            await self.supervise(h, alive=alive, lifecycle=lifecycle)
        self.loaded.clear()

    def load_descriptors(self) -> None:
        for path in sorted(self.layout.workers_dir.glob("*.json")):
            try:
                h, alive, lifecycle = self.ops.load(path)
            except ValueError as exc:
                log.error("skipping worker descriptor %s: %s — move it away to silence this",
                          path, exc)
                continue
            self.sessions[h.session_id] = h
            self.loaded.append((h, alive, lifecycle))

    async def supervise(self, h: WorkerHandle, *, alive: bool, lifecycle: Mode) -> None:
        """Start the session's supervise task in the service nursery (its own cancel scope)."""
        await self.nursery.start(
            functools.partial(
                h.supervise,
                alive=alive,
                wanted=lifecycle not in (Mode.STOPPED, Mode.FAILED),
                failed=lifecycle is Mode.FAILED and not alive,
            )
        )
        if h.loaded_stop_reason is StopReason.KILL:
            # a predecessor died while killing it: finish the kill (stop, then forget)
            self.nursery.start_soon(self.complete_kill, h)

    async def complete_kill(self, h: WorkerHandle) -> None:
        """Once a kill's stop is done, forget the session: its descriptor and token go, and
        commands waiting on it look it up again (a prompt creates the session anew). A worker
        that survived SIGKILL leaves the session failed, for the operator."""
        await h.wait_stop_handled()
        if (
            h.mode.value is Mode.STOPPED
            and h.state.stop_reason is StopReason.KILL
            and self.sessions.get(h.session_id) is h
        ):
            del self.sessions[h.session_id]
            self.killed.add(h.session_id)
            h.cancel_scope.cancel()
            h.retire()
            await self.ops.forget(h.session_id)
            log.info("session %s killed", h.session_id)

    async def get_session(
        self,
        session_id: str,
        agent: str | None,
        cwd: str | None,
        *,
        create: bool,
        env: dict[str, str] | None = None,
        cwd_given: bool = False,
    ) -> WorkerHandle:
        """The session's handle; a new one is created (``create``) with the creating client's
        ``cwd`` and environment ``env`` (minus the daemon's own variables).

        ``cwd_given``: the user chose ``cwd`` (``--cwd``); an existing session with another
        working directory is then refused, naming it (a new one starts there)."""
        check_session_id(session_id)
        while (removing := self._removing.get(session_id)) is not None:
            await removing.wait()  # a command during `rm` comes after it: a new session
        known = self.sessions.get(session_id)
        if known is not None and (agent is None or agent == known.agent):
            if cwd_given and cwd is not None:
                _check_cwd(session_id, known.cwd, cwd)
            return known  # the per-command fast path: no lock, no checkpoint
        # no await from here to the return: a session is looked up and created atomically,
        # with no lock (a lock's checkpoint would make 100 new sessions queue one scheduling
        # round each)
        h = self.sessions.get(session_id)
        if h is None:
            meta = read_meta(self.layout.session_dir(session_id))
            if meta is None and not create:
                raise AgentdError(
                    ErrorCode.UNKNOWN_SESSION,
                    f"no session {session_id!r} — create it with"
                    f" `trio-agentd prompt -s {session_id} TEXT`",
                )
            known_agent = str(meta["agent"]) if meta and "agent" in meta else None
            use_agent = agent or known_agent or self.default_agent
            if known_agent is not None and agent is not None and agent != known_agent:
                raise _agent_mismatch(session_id, known_agent, agent)
            known_cwd = (meta or {}).get("cwd")
            if cwd_given and cwd is not None and isinstance(known_cwd, str):
                _check_cwd(session_id, known_cwd, cwd)
            validate_agent_spec(use_agent)
            # every session kept counts, stopped ones too: a stopped session keeps its
            # handle, supervise task and files, and any prompt starts it again unchecked
            if len(self.sessions) >= self.max_sessions:
                raise AgentdError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"this supervisor already keeps the most sessions it may"
                    f" ({self.max_sessions}, stopped ones included) — `trio-agentd"
                    " kill` sessions you no longer need",
                    {"limit": "max_sessions", "value": self.max_sessions},
                )
            self.claim_session(session_id, meta)
            h = self.ops.new_handle(
                session_id, use_agent,
                (meta or {}).get("cwd") or cwd or str(self.layout.session_dir(session_id)),
                None if env is None else agent_environment(env),
            )
            self.sessions[session_id] = h
            self.killed.discard(session_id)  # made anew by a new command
            # started, not awaited (its commands wait for readiness, and their demand starts
            # its worker whenever the task runs)
            self.nursery.start_soon(functools.partial(
                h.supervise, alive=False, wanted=False, failed=False))
        elif agent is not None and agent != h.agent:
            raise _agent_mismatch(session_id, h.agent, agent)
        elif cwd_given and cwd is not None:
            _check_cwd(session_id, h.cwd, cwd)
        return h

    def claim_session(self, session_id: str, meta: dict[str, Any] | None) -> None:
        """A session lives in one supervisor at a time (sessions are per home, workers per
        socket). Refuse one whose worker runs under another socket; adopt an abandoned one."""
        other = (meta or {}).get("socket")
        if not isinstance(other, str) or other == self.layout.socket:
            return
        theirs = Layout(home=self.layout.home, socket=other, registry=self.layout.registry)
        desc: Any = None
        try:
            raw = _fs.read_bytes(theirs.descriptor_path(session_id))
            desc = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError) as exc:
            log.error("session %s: ignoring the descriptor under socket %s: %s",
                      session_id, other, exc)
        if isinstance(desc, dict) and isinstance(desc.get("pid"), int) and is_alive(
            int(desc["pid"]), desc.get("start_id")
        ) and desc.get("start_id"):
            raise AgentdError(
                ErrorCode.BAD_REQUEST,
                f"session {session_id!r} runs under the supervisor on {other} (worker pid"
                f" {desc['pid']}) — use --socket {other}, or another session name",
            )
        log.info("session %s: taking it over from socket %s (no live worker there)",
                 session_id, other)
        assert meta is not None
        write_meta(self.layout.session_dir(session_id), {**meta, "socket": self.layout.socket})

    # clients --------------------------------------------------------------------------------

    async def remove_session(self, sid: str, *, force: bool) -> dict[str, Any]:
        """``trio-agentd rm``: stop the session (refused while a turn runs, unless ``force``,
        which kills the turn), forget it, and delete its data: the session dir (metadata,
        transcript, logs, outputs), its journal, descriptor and token. A command for the
        session that arrives meanwhile waits, then finds no session and makes a new one.
        """
        check_session_id(sid)
        if sid in self._removing:
            raise AgentdError(ErrorCode.SESSION_BUSY, f"session {sid} is being removed already")
        L = self.layout
        done = self._removing[sid] = trio.Event()
        try:
            h = self.sessions.get(sid)
            session_dir = L.session_dir(sid)
            if h is None and not session_dir.is_dir() and not L.journal_path(sid).exists():
                raise AgentdError(ErrorCode.UNKNOWN_SESSION,
                                  f"no session {sid!r} — `trio-agentd sessions` lists them")
            if h is None:
                self.claim_session(sid, read_meta(session_dir))  # not one another runs
            else:
                await self._stop_for_removal(h, force=force)
            log.info("session %s removed%s", sid, " (--force)" if force else "")
            self.killed.add(sid)  # a resent command of it is not run in a new session
            await self.ops.forget(sid)
            with contextlib.suppress(FileNotFoundError):
                L.journal_path(sid).unlink()
            if session_dir.is_dir() and not session_dir.is_symlink():
                import shutil

                shutil.rmtree(session_dir)
            return {"session": sid, "removed": True}
        finally:
            del self._removing[sid]
            done.set()

    async def _stop_for_removal(self, h: WorkerHandle, *, force: bool) -> None:
        """Stop ``h``'s worker for good and forget the session. Without ``force`` the worker
        itself declines while a turn runs or waits (as an eviction: no turn is ever cut)."""
        sid = h.session_id
        bound = kill_answer_bound(self.timing)
        if not force and h.mode.value not in (Mode.STOPPED, Mode.FAILED):
            h.request_stop(graceful=True, reason=StopReason.EVICT)
            with trio.move_on_after(bound):
                await h.wait_stop_handled()
            if h.mode.value is Mode.READY:  # the worker declined: a turn runs or waits
                raise AgentdError(
                    ErrorCode.SESSION_BUSY,
                    f"session {sid} is running a turn — wait for it, `trio-agentd cancel"
                    f" {sid}`, or `trio-agentd rm --force {sid}`", {"session": sid})
            if h.mode.value not in (Mode.STOPPED, Mode.FAILED):
                raise AgentdError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"session {sid} did not stop within {bound:g}s (it is"
                    f" {h.mode.value}); nothing was deleted — try again, or `trio-agentd rm"
                    f" --force {sid}`", {"session": sid})
        h.request_stop(graceful=True, reason=StopReason.KILL)  # ends a running turn at once
        with trio.move_on_after(bound):
            await h.wait_stop_handled()
        if h.mode.value is not Mode.STOPPED and h.pid is not None and is_alive(
            h.pid, h.start_id
        ):
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"session {sid}: its worker pid {h.pid} did not stop; nothing was deleted —"
                " see `trio-agentd ps` and `trio-agentd doctor`", {"session": sid})
        if self.sessions.get(sid) is h:
            del self.sessions[sid]
        h.cancel_scope.cancel()
        h.retire()


    async def refresh_from_workers(self) -> None:
        """Turns and activity as each worker says now (clients prompt workers directly; the
        notices a worker sends may still be on their way)."""

        async def ask(h: WorkerHandle) -> None:
            link = h.link
            if link is None or link.closed.is_set():
                return
            with contextlib.suppress(WorkerDropped, AgentdError):
                response = await link.call("status", {}, client_id="")
                status = response.result if response.ok else None
                if isinstance(status, dict) and isinstance(status.get("turns"), int):
                    h.turns = max(h.turns, status["turns"])
                    h.busy = bool(status.get("busy"))

        with trio.move_on_after(self.timing.status_timeout):
            async with trio.open_nursery() as nursery:
                for h in list(self.sessions.values()):
                    nursery.start_soon(ask, h)

    def rearm_if_exhausted(self, h: WorkerHandle) -> None:
        """A session that failed only because its worker could not be started for want of
        resources (descriptors, processes, memory, room on disk) is started again by the
        next command: that failure was the command's, not the session's."""
        if h.mode.value is Mode.FAILED and self.ops.exhausted.get(h.session_id) is not None:
            log.info("session %s: trying to start it again (its last start ran out of"
                     " resources)", h.session_id)
            h.retry()

    def exhausted_instead(self, h: WorkerHandle, exc: AgentdError) -> AgentdError:
        """``resource_exhausted`` (naming the limit) or ``storage_error`` (naming the file)
        for a session whose worker could not be started for want of resources or room;
        ``exc`` otherwise."""
        if exc.code == ErrorCode.WORKER_UNAVAILABLE:
            why = self.ops.exhausted.get(h.session_id)
            if why is not None:
                return AgentdError(
                    why.code,  # resource_exhausted, or storage_error (no room for its files)
                    f"{why.message} (the next command tries again)",
                    why.details,
                )
        return exc

    async def wait_ready(self, h: WorkerHandle) -> None:
        self.rearm_if_exhausted(h)
        try:
            await h.wait_ready()
        except AgentdError as exc:
            raise self.exhausted_instead(h, exc) from None

    def known(self, session_id: str) -> WorkerHandle:
        h = self.sessions.get(session_id)
        if h is None:
            raise AgentdError(
                ErrorCode.UNKNOWN_SESSION,
                f"no session {session_id!r} — `trio-agentd sessions` lists them",
            )
        return h


def _agent_mismatch(session_id: str, have: str, asked: str) -> AgentdError:
    return AgentdError(
        ErrorCode.BAD_REQUEST,
        f"session {session_id!r} runs agent {have!r}, not {asked!r} — drop --agent or use"
        " another session",
    )


def _check_cwd(session_id: str, have: str, asked: str) -> None:
    """``--cwd`` for an existing session must name its working directory (the same path, or
    the same directory by another path); anything else is refused, naming the session's."""
    if os.path.normpath(have) == os.path.normpath(asked):
        return
    with contextlib.suppress(OSError):
        if os.path.samefile(have, asked):
            return
    raise AgentdError(
        ErrorCode.BAD_REQUEST,
        f"session {session_id!r} works in {shown_path(have)}, not {shown_path(asked)} — drop"
        " --cwd, or use another session (-s NEW --cwd DIR)",
        {"session": session_id, "cwd": have},
    )


