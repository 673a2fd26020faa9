"""What follows ``trio-agentd -p``: options anywhere, ``--``, ``-`` and stdin, session ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._cli_args import (
    PromptArgs,
    UsageError,
    command_index,
    parse_globals,
    parse_prompt_args,
    rewrite,
)
from trio_agentd._errors import AgentdError
from trio_agentd._session import check_session_id
from trio_agentd._sessionid import SESSION_ID_RULE, is_session_id


def parse(*words: str, tty: bool = True) -> PromptArgs:
    return parse_prompt_args(list(words), stdin_is_tty=tty)


def test_words_join_with_spaces_into_the_default_session() -> None:
    got = parse("hello", "there")
    assert (got.session, got.agent, got.json, got.text) == ("default", None, False, "hello there")


@pytest.mark.parametrize(
    "words",
    [
        ("-s", "other", "hello"),
        ("hello", "-s", "other"),
        ("hello", "--session", "other"),
        ("hello", "--session=other"),
        ("-sother", "hello"),
    ],
)
def test_options_before_or_after_text(words: tuple[str, ...]) -> None:
    got = parse(*words)
    assert (got.session, got.text) == ("other", "hello")


def test_options_between_words_and_every_prompt_option() -> None:
    got = parse("a", "--agent", "shell", "b", "--json", "-s", "x", "c")
    assert (got.session, got.agent, got.json, got.text) == ("x", "shell", True, "a b c")
    got = parse("--agent=exec:my-agent --flag", "hi")
    assert (got.agent, got.text) == ("exec:my-agent --flag", "hi")


def test_double_dash_ends_options_and_everything_after_is_text() -> None:
    got = parse("-s", "sh", "--agent", "shell", "--", "ls", "-l")
    assert (got.session, got.agent, got.text) == ("sh", "shell", "ls -l")
    got = parse("hello", "--", "-s", "other", "--", "-")
    assert (got.session, got.text) == ("default", "hello -s other -- -")
    assert parse("--", "--").text == "--"


def test_global_options_after_dash_p() -> None:
    got = parse("hi", "--socket", "/s/d.sock", "--home=/h", "-v")
    assert (got.socket, got.home, got.verbose, got.text) == ("/s/d.sock", "/h", True, "hi")
    assert parse("hi", "--daemon-socket", "/x").socket == "/x"
    plain = parse("hi")
    assert (plain.socket, plain.home, plain.verbose) == (None, None, False)


@pytest.mark.parametrize("tty", [True, False])
def test_dash_alone_means_stdin(tty: bool) -> None:
    assert parse("-", tty=tty).text is None
    assert parse("-s", "x", "-", tty=tty).text is None
    assert parse("--", "-", tty=tty).text is None


def test_dash_among_words_is_literal() -> None:
    assert parse("a", "-", "b").text == "a - b"


def test_no_text_reads_stdin_unless_it_is_a_terminal() -> None:
    assert parse(tty=False).text is None
    assert parse("-s", "x", "--json", tty=False).text is None
    with pytest.raises(UsageError, match="prompt needs TEXT"):
        parse()
    with pytest.raises(UsageError, match="prompt needs TEXT"):
        parse("-s", "x", "--")


def test_empty_word_is_text() -> None:
    assert parse("").text == ""


def test_negative_number_is_text() -> None:
    assert parse("-5", "degrees").text == "-5 degrees"


@pytest.mark.parametrize("bad", ["", "a b", "abc\n", "-x", ".hidden", "_x", "é", "a/b", "x" * 65])
def test_invalid_session_id_is_a_usage_error_naming_the_rule(bad: str) -> None:
    with pytest.raises(UsageError) as info:
        parse("-s", bad, "hello")
    assert f"invalid session id {bad!r}" in str(info.value)
    assert SESSION_ID_RULE in str(info.value)
    with pytest.raises(UsageError):
        parse("hello", f"--session={bad}")


@pytest.mark.parametrize("words", [("-x", "hi"), ("hi", "--bogus"), ("--json=1", "hi")])
def test_unknown_option_is_a_usage_error_pointing_at_double_dash(words: tuple[str, ...]) -> None:
    with pytest.raises(UsageError, match=r"unknown option .* put it after --"):
        parse(*words)


@pytest.mark.parametrize("opt", ["-s", "--session", "--agent", "--socket", "--home"])
def test_option_without_value_is_a_usage_error(opt: str) -> None:
    with pytest.raises(UsageError, match=f"{opt} needs a value"):
        parse("hi", opt)


def test_help_anywhere_before_double_dash() -> None:
    assert parse("hi", "--help").help
    assert parse("-h").help
    got = parse("--", "-h")
    assert (got.help, got.text) == (False, "-h")


def test_rewrite_and_command_index_find_the_prompt_words() -> None:
    argv = rewrite(["--socket", "/s", "-p", "hello", "-s", "other"])
    at = command_index(argv)
    assert argv[at] == "prompt"
    assert argv[at + 1 :] == ["hello", "-s", "other"]
    argv = rewrite(["-v", "--home", "/h", "prompt", "x"])
    assert argv[command_index(argv)] == "prompt"


@pytest.mark.parametrize("good", ["a", "default", "A.b_c-d", "0", "x" * 64, "s1"])
def test_valid_session_ids(good: str) -> None:
    assert is_session_id(good)
    assert check_session_id(good) == good
    assert parse("-s", good, "hi").session == good


@pytest.mark.parametrize("bad", ["", "a b", "abc\n", "-x", "x" * 65, "a\nb"])
def test_supervisor_check_uses_the_same_rule(bad: str) -> None:
    assert not is_session_id(bad)
    with pytest.raises(AgentdError, match="starting with a letter or digit"):
        check_session_id(bad)


def test_non_strings_are_not_session_ids() -> None:
    assert not is_session_id(None)
    assert not is_session_id(7)


@given(st.text(max_size=70))
def test_session_id_rule_matches_its_description(value: str) -> None:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
    expected = (
        1 <= len(value) <= 64 and set(value) <= allowed and value[0] not in "._-"
    )
    assert is_session_id(value) == expected


def test_globals_before_dash_p_fill_only_what_after_did_not_set() -> None:
    got = parse("hi", "--socket", "/late")
    assert parse_globals(["--socket", "/early", "--home=/h", "-v"], got)
    assert (got.socket, got.home, got.verbose) == ("/late", "/h", True)
    got = parse("hi")
    assert parse_globals(["--daemon-socket=/d"], got)
    assert got.socket == "/d"


@pytest.mark.parametrize("words", [["-h"], ["--socket"], ["--bogus"], ["-v", "--home"]])
def test_anything_else_before_dash_p_is_left_to_argparse(words: list[str]) -> None:
    assert not parse_globals(words, parse("hi"))
