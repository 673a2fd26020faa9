"""The command lines the warm paths take, parsed without argparse (building its parser costs
more than a warm prompt or a ``ps``): the seed CLI's spellings, the words after ``-p``, the
global options, and ``ps``/``status``/``doctor`` with their flags. Pure: words in, values out;
anything unusual is left to the argparse parser (:mod:`._cli_parser`).
"""

from __future__ import annotations

from ._sessionid import SESSION_ID_RULE, is_session_id

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from typing import Any


_GLOBAL_WITH_VALUE = {"--socket", "--daemon-socket", "--home", "--registry"}


def rewrite(argv: list[str]) -> list[str]:
    """Map the seed CLI's spellings onto subcommands: ``-p`` → prompt, ``--mode daemon``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in _GLOBAL_WITH_VALUE and i + 1 < len(argv):
            out += [tok, argv[i + 1]]
            i += 2
            continue
        if tok == "-p":
            return [*out, "prompt", *argv[i + 1 :]]
        if tok == "--mode" and i + 1 < len(argv):
            if argv[i + 1] != "daemon":
                raise SystemExit(f"trio-agentd: error: unknown --mode {argv[i + 1]!r}")
            return [*out, "daemon", *argv[i + 2 :]]
        if tok.startswith("--mode="):
            return [*out, "daemon", *argv[i + 1 :]]
        if not tok.startswith("-"):
            return argv
        out.append(tok)
        i += 1
    return out


class UsageError(Exception):
    """A bad command line: the CLI prints the message and exits 2, before contacting a daemon."""


class PromptArgs:
    """What follows ``-p`` / ``prompt``. ``text`` is None when the prompt is to be read from stdin.

    Global options (``--socket``, ``--home``, ``-v``) are accepted here too; ``None`` / False when
    not given after ``-p``.
    """

    __slots__ = (
        "agent", "cwd", "help", "home", "json", "registry", "session", "socket", "text",
        "verbose",
    )
    command = "prompt"

    def __init__(self) -> None:
        self.session = "default"
        self.agent: str | None = None
        self.cwd: str | None = None
        self.json = False
        self.text: str | None = None
        self.socket: str | None = None
        self.home: str | None = None
        self.registry: str | None = None
        self.verbose = False
        self.help = False


_PROMPT_VALUE_OPTS = {
    "-s": "session", "--session": "session", "--agent": "agent", "--cwd": "cwd",
    "--socket": "socket", "--daemon-socket": "socket", "--home": "home",
}


_PROMPT_FLAG_OPTS = {"--json": "json", "-v": "verbose", "--verbose": "verbose"}


def parse_prompt_args(words: list[str], *, stdin_is_tty: bool) -> PromptArgs:
    """Parse the words after ``-p``: options anywhere, ``--`` ends them, TEXT words join with " ".

    The prompt comes from stdin (``text`` None) when TEXT is exactly ``-``, or when there is no
    TEXT and stdin is not a terminal. Pure: ``stdin_is_tty`` is the caller's ``isatty()``.

    Raises:
        UsageError: unknown option, option without its value, invalid session id, no TEXT on
            a terminal.
    """
    got = PromptArgs()
    text: list[str] = []
    i = 0
    while i < len(words):
        tok = words[i]
        i += 1
        if tok == "--":
            text += words[i:]
            break
        if tok == "-" or not tok.startswith("-") or tok[1:2].isdigit():  # "-", a word, "-5"
            text.append(tok)
            continue
        if tok in ("-h", "--help"):
            got.help = True
            return got
        if tok in _PROMPT_FLAG_OPTS:
            setattr(got, _PROMPT_FLAG_OPTS[tok], True)
            continue
        name, eq, value = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if not eq and name not in _PROMPT_VALUE_OPTS and tok[:2] == "-s":
            name, eq, value = "-s", "=", tok[2:]  # -sNAME, as argparse allows
        if name not in _PROMPT_VALUE_OPTS:
            raise UsageError(
                f"unknown option {tok!r} — to send it as text, put it after --"
                f" (trio-agentd -p -- {tok})"
            )
        if not eq:
            if i >= len(words):
                raise UsageError(f"{name} needs a value")
            value = words[i]
            i += 1
        setattr(got, _PROMPT_VALUE_OPTS[name], value)
    if not is_session_id(got.session):
        raise UsageError(f"invalid session id {got.session!r}: use {SESSION_ID_RULE}")
    if text == ["-"] or (not text and not stdin_is_tty):
        got.text = None
    elif not text:
        raise UsageError("prompt needs TEXT — e.g. trio-agentd -p hello, or a prompt on stdin")
    else:
        got.text = " ".join(text)
    return got


def command_index(argv: list[str]) -> int:
    """Index of the subcommand in (rewritten) ``argv``: the first word that is no global option."""
    i = 0
    while i < len(argv):
        if argv[i] in _GLOBAL_WITH_VALUE:
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return i
    return len(argv)


# ps/status/doctor and the only flags they take: parsed without argparse (anything else, such
# as -h, an abbreviation or a repeated global option, goes to argparse as before)
_LOOK_FLAGS = {
    "ps": ("--json",), "status": ("--json",), "doctor": ("--fix", "--dry-run", "--json"),
    # not a look, but as short: building the parser (its `service` part imports dataclasses,
    # tempfile, shutil, random) cost more than shutdown's own work before its request
    "shutdown": ("--all", "--force", "--json"),
}


_DEST = {"--daemon-socket": "--socket", "--verbose": "-v"}


def look_args(argv: list[str], at: int) -> Any:
    """The namespace argparse would make of ``[globals] ps|status|doctor|shutdown [flags]``,
    or ``None`` for any other command line."""
    flags = _LOOK_FLAGS.get(argv[at]) if at < len(argv) else None
    if flags is None or not set(argv[at + 1 :]) <= set(flags):
        return None
    into = PromptArgs()
    named = [_DEST.get(w.partition("=")[0], w.partition("=")[0])
             for w in argv[:at] if w.startswith("--")]
    if len(named) != len(set(named)) or not parse_globals(argv[:at], into):
        return None  # a repeated option (argparse: the last wins) or anything unknown
    import types

    return types.SimpleNamespace(
        command=argv[at], socket=into.socket, home=into.home, registry=into.registry,
        verbose=into.verbose, version=False,
        **{f[2:].replace("-", "_"): f in argv[at + 1 :] for f in flags},
    )


def parse_globals(words: list[str], into: PromptArgs) -> bool:
    """Read the global options before ``-p`` into ``into`` (those after ``-p`` win).

    False if there is anything else (``-h``, a typo, a missing value): argparse then answers.
    """
    i = 0
    while i < len(words):
        tok = words[i]
        i += 1
        if tok in ("-v", "--verbose"):
            into.verbose = True
            continue
        name, eq, value = tok.partition("=")
        if name not in _GLOBAL_WITH_VALUE:
            return False
        if not eq:
            if i >= len(words):
                return False
            value = words[i]
            i += 1
        field = {"--home": "home", "--registry": "registry"}.get(name, "socket")
        if getattr(into, field) is None:
            setattr(into, field, value)
    return True
