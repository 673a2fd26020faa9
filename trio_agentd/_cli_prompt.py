"""``trio-agentd -p``: a prompt sent, its answer streamed as bytes, and the exit status it
gives (the agent's own, or 125 and up for trio-agentd's failures). The warm path: no trio, no
argparse.
"""

from __future__ import annotations

import os

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._cli_exit import EXIT_INTERRUPTED, EXIT_OK, EXIT_OWN, EXIT_USAGE
from ._cli_io import Answer, Diagnostics, error, new_client, read_prompt_from_stdin
from ._errors import ErrorCode

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from typing import Any

    from ._cli_args import PromptArgs
    from ._errors import AgentdError
    from ._paths import Layout


def prompt_exit_code(result: Any) -> int:
    """The CLI's exit status for a prompt that was answered: the agent's own, as a shell
    reports a command's (128 + N for death by signal N); 0 for an agent that reports none."""
    status = result.get("exit_status") if isinstance(result, dict) else None
    if not isinstance(status, int) or isinstance(status, bool):
        return EXIT_OK
    if status < 0:
        return min(128 - status, 255)
    return status & 0xFF


def prompt_error_code(exc: AgentdError) -> int:
    """The CLI's exit status for a prompt that failed: 130 once its cancel was confirmed
    (Ctrl-C), the status the error names (126/127: an exec program cannot be run / is not
    found), else 125 — trio-agentd's own, never confused with an agent's usual 1."""
    if exc.code == ErrorCode.COMMAND_CANCELLED:
        return EXIT_INTERRUPTED
    status = exc.details.get("exit_status")
    if isinstance(status, int) and not isinstance(status, bool) and 0 < status < 256:
        return status
    return EXIT_OWN


def _json_text(data: bytes, field: str) -> dict[str, str]:
    """A stream for --json: text if it is UTF-8, else base64 under ``FIELD_base64``."""
    try:
        return {field: data.decode()}
    except UnicodeDecodeError:
        import base64

        return {f"{field}_base64": base64.b64encode(data).decode("ascii")}


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def cmd_prompt(layout: Layout, args: PromptArgs) -> int:
    import sys

    if sys.stdout is None:
        # descriptor 1 was closed when we started: the answer would have nowhere to go, so
        # the prompt is not sent (nothing runs)
        error("stdout is closed (descriptor 1): the answer would have nowhere to go; nothing"
              " was sent — run it with stdout open (>/dev/null to discard the answer)")
        return EXIT_OWN
    text = args.text
    if text is None:
        text = read_prompt_from_stdin()
        if text is None:
            error("prompt needs TEXT: none given and stdin was empty — e.g. trio-agentd -p hello")
            return EXIT_USAGE
    cwd = _session_cwd(args.cwd)
    if isinstance(cwd, int):
        return cwd
    from ._syncclient import Output

    out = Answer()
    err = Diagnostics()
    kept: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    # the agent's bytes, exactly, as they come, each stream to its own; nothing added (a
    # resend's repeat is skipped). --json gathers them for the one object it prints
    output = (
        Output(kept["stdout"].append, kept["stderr"].append) if args.json
        else Output(out.write_bytes, err.write_bytes)
    )
    client = new_client(layout, connect=False)
    client.connect_for_prompt(args.session, args.agent, cwd_given=bool(cwd))
    result = client.request(
        "prompt",
        {"session": args.session, "text": text, "agent": args.agent, **cwd},
        on_event=output.on_event,
    )
    client.close()
    output.finish(result)
    code = prompt_exit_code(result)
    if args.json:
        status = result.get("exit_status") if isinstance(result, dict) else None
        out.write(json.dumps({
            **result, "exit_status": status if isinstance(status, int) else None,
            **_json_text(b"".join(kept["stdout"]), "stdout"),
            **_json_text(b"".join(kept["stderr"]), "stderr"),
        }) + "\n")
        return code
    status = result.get("exit_status") if isinstance(result, dict) else None
    if isinstance(status, int) and status < 0 and -status not in (2, 13):
        # as a shell says it for a foreground job (not for SIGINT or SIGPIPE)
        error(f"the agent was killed by {_signal_name(-status)}")
    return code


def _session_cwd(given: str | None) -> dict[str, Any] | int:
    """The prompt's ``cwd`` arguments: ``--cwd DIR`` made absolute and checked (a usage error,
    before anything is sent, if it is missing or not a directory), else none (the client's own
    cwd is sent)."""
    if given is None:
        return {}
    path = os.path.abspath(given)
    if not os.path.isdir(path):
        why = "is not a directory" if os.path.exists(path) else "does not exist"
        error(f"--cwd {given!r} {why} — create it, or give an existing directory")
        return EXIT_USAGE
    return {"cwd": path, "cwd_given": True}
