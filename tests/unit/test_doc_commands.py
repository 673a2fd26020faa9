"""Every ``trio-agentd ...`` command shown in README.md and docs/*.md (code blocks and inline
code), and every example in the CLI's own help, parses with the real command line parser: a
command or flag that does not exist fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from trio_agentd import _cli_args, _cli_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_INVOCATION = re.compile(r"(?:^|(?<=[\s|;&(]))trio-agentd(?=\s)")


def _subcommands() -> set[str]:
    import argparse

    for action in _cli_parser.build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("the parser has no subcommands")


SUBCOMMANDS = _subcommands()


def _placeholder(word: str) -> str:
    """A synopsis' placeholder made a value the parser takes (``N`` must be a number)."""
    if re.fullmatch(r"[A-Z][A-Z_]*", word):
        return "1" if word == "N" else "x1"
    return word


def commands_in(line: str) -> list[list[str]]:
    """The ``trio-agentd`` command lines in one line of shell or synopsis, each as its words
    after ``trio-agentd``. ``[-n N]`` counts as given; ``A | B`` where B starts with a
    subcommand is an alternative, a pipe into anything else ends the command."""
    line = re.sub(r"^\$ ", "", line.strip())
    line = re.sub(r"\s#\s.*$", "", line)  # a trailing comment
    # synopsis brackets: the first alternative of each group, "..." dropped
    line = re.sub(r"\[([^\[\]|]*)(\|[^\[\]]*)?\]", r"\1", line).replace("...", " ")
    out: list[list[str]] = []
    m = _INVOCATION.search(line)
    if m is None:
        return out
    segments = re.split(r"\s*(?:\|\|?|&&|;)\s*", line[m.end():])
    words_of = [shlex.split(seg) for seg in segments]
    out.append(words_of[0])
    for words in words_of[1:]:
        if words and words[0] in SUBCOMMANDS:
            out.append(words)  # "kill SESSION | retry SESSION": two commands
        elif words and words[0] == "trio-agentd":
            out.append(words[1:])
        else:
            break
    for words in out:
        cut = next((i for i, w in enumerate(words) if w in (">", ">>", "2>", "<")), len(words))
        words[cut:] = []
    return [[_placeholder(w) for w in words] for words in out]


def parses(words: list[str]) -> str | None:
    """``None`` if the real CLI parses ``trio-agentd WORDS``; else why not."""
    try:
        argv = _cli_args.rewrite(list(words))
    except SystemExit as exc:
        return str(exc)
    at = _cli_args.command_index(argv)
    if argv[at : at + 1] == ["prompt"]:
        try:
            got = _cli_args.parse_prompt_args(argv[at + 1 :], stdin_is_tty=False)
        except _cli_args.UsageError as exc:
            return str(exc)
        if got.help:
            return None
        argv = argv[: at + 1]  # the globals before -p go to argparse
    try:
        _cli_parser.build_parser().parse_args(argv)
    except SystemExit as exc:
        return None if exc.code in (0, None) else f"argparse refused {argv}"
    return None


def _doc_commands() -> list[tuple[str, list[str], bool]]:
    """``(where, words, whole)``: ``whole`` for a code block's command line; inline code in
    prose may name a command without its arguments (`trio-agentd rm` deletes them)."""
    found: list[tuple[str, list[str], bool]] = []
    for path in DOCS:
        in_block = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            spans = [line] if in_block else re.findall(r"`([^`]+)`", line)
            for span in spans:
                if span.lstrip().startswith("trio-agentd:"):
                    continue  # what it prints, not a command
                found += [(where, words, in_block) for words in commands_in(span)]
    return found


DOC_COMMANDS = _doc_commands()


def test_the_docs_show_commands() -> None:
    assert len(DOC_COMMANDS) > 40  # the extraction finds what is there
    shown = {w for _, words, _ in DOC_COMMANDS for w in words}
    assert {"-p", "sessions", "logs", "doctor", "--fix", "config"} <= shown


@pytest.mark.parametrize(("where", "words", "whole"), DOC_COMMANDS,
                         ids=[f"{w}:{' '.join(c)}" for w, c, _ in DOC_COMMANDS])
def test_every_documented_command_parses(where: str, words: list[str], whole: bool) -> None:
    why = parses(words)
    if why is not None and not whole and parses([*words, "x1"]) is None:
        why = None  # prose naming a command whose argument it leaves out
    assert why is None, f"{where}: trio-agentd {' '.join(words)}: {why}"


@pytest.mark.parametrize("words", [
    ["sesions"], ["ps", "--jsn"], ["logs", "s1", "--tail"], ["-p", "--model", "x", "hi"],
    ["doctor", "--repair"], ["--mode", "server"], ["completion", "tcsh"],
])
def test_a_command_or_flag_that_does_not_exist_fails(words: list[str]) -> None:
    assert parses(words) is not None


@pytest.mark.parametrize(("line", "expected"), [
    ("trio-agentd kill SESSION | retry SESSION", [["kill", "x1"], ["retry", "x1"]]),
    ("trio-agentd logs --daemon [-n N] [-f]   # the log", [["logs", "--daemon", "-n", "1", "-f"]]),
    ("trio-agentd -p ... | head -1", [["-p"]]),
    ("$ trio-agentd -p -s wc again", [["-p", "-s", "wc", "again"]]),
    ("echo hello | trio-agentd -p -s chat", [["-p", "-s", "chat"]]),
    ("trio-agentd completion bash > ~/.bash", [["completion", "bash"]]),
    ("no command here", []),
])
def test_commands_are_read_from_shell_and_synopsis_lines(
    line: str, expected: list[list[str]]
) -> None:
    assert commands_in(line) == expected


def _help_examples() -> list[tuple[str, list[str]]]:
    import argparse

    parser = _cli_parser.build_parser()
    parsers = [("trio-agentd", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += sorted(action.choices.items())
    for name, sub in list(parsers[1:]):  # a command's own actions: ``service install``
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += [(f"{name} {a}", p) for a, p in sorted(action.choices.items())]
    found: list[tuple[str, list[str]]] = []
    for name, sub in parsers:
        epilog = sub.epilog or ""
        block = epilog.split("examples:\n", 1)[1].split("\n\n", 1)[0]
        for line in block.splitlines():
            found += [(name, words) for words in commands_in(line)]
    return found


HELP_EXAMPLES = _help_examples()


@pytest.mark.parametrize(("name", "words"), HELP_EXAMPLES,
                         ids=[f"{n}:{' '.join(c)}" for n, c in HELP_EXAMPLES])
def test_every_example_in_the_help_parses(name: str, words: list[str]) -> None:
    assert parses(words) is None, f"{name} --help: trio-agentd {' '.join(words)}"
