"""The command line explains itself: every option has help, --help shows defaults, and the global flags
(--version, --debug) work before the command and, for --debug, after it."""

from __future__ import annotations

import argparse

import pytest

from appliance import __version__, cli
from appliance.cli_parser import build_parser


def parsers() -> dict[str, argparse.ArgumentParser]:
    """The top-level parser and every command's parser, by command name."""
    top = build_parser()
    (sub,) = (a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"(top)": top, **sub.choices}


def test_every_option_of_every_command_has_help():
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, parser in parsers().items()
        for action in parser._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, f"options without help: {missing}"


def test_every_command_has_help_in_the_command_list():
    top = build_parser()
    (sub,) = (a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    described = {choice.dest: choice.help for choice in sub._choices_actions}
    assert set(described) == set(cli.COMMANDS) and all(described.values()), described


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("tokenizer", "(default: sized to the corpus as `run` sizes it, at most BLOOM's 250,680)"),
        ("run", "(default: text)"),
        ("import", "(default: 2048)"),
        ("sbatch", "(default: 20:00:00)"),
        ("prep", "(default: 04:00:00)"),
    ],
)
def test_help_shows_defaults(command, shown):
    text = " ".join(parsers()[command].format_help().split())  # argparse wraps lines; compare words
    assert shown in text


def test_help_shows_no_empty_or_doubled_default():
    for name, parser in parsers().items():
        text = " ".join(parser.format_help().split())
        for empty in ("(default: None)", "(default: False)", "(default: [])", "(default: ==SUPPRESS==)"):
            assert empty not in text, (name, empty)
        assert ") (default:" not in text, name  # an explicit "(default: ...)" is not followed by argparse's


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["run"]),
        (["--max-steps", "4"], ["run", "--max-steps", "4"]),
        (["--debug"], ["--debug", "run"]),
        (["--debug", "--max-steps", "4"], ["--debug", "run", "--max-steps", "4"]),
        (["--debug", "plan", "--json"], ["--debug", "plan", "--json"]),
        (["--version"], ["--version"]),
        (["--debug", "--version"], ["--debug", "--version"]),
        (["--help"], ["--help"]),
        (["detect"], ["detect"]),
    ],
)
def test_run_is_the_command_when_none_is_given(argv, expected):
    assert cli.with_default_command(argv) == expected


@pytest.mark.parametrize(
    ("argv", "debug"),
    [
        (["plan"], False),
        (["--debug", "plan"], True),
        (["plan", "--debug"], True),
        (["--debug", "plan", "--debug"], True),
    ],
)
def test_debug_is_accepted_before_and_after_the_command(argv, debug):
    assert build_parser().parse_args(argv).debug is debug


def test_version_prints_the_project_torch_and_deepspeed_versions(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"bloom-appliance {__version__} (torch ") and "deepspeed " in out


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (cli.BadInput("--layout x: bad"), cli.EXIT_BAD_INPUT, "error: --layout x: bad"),
        (RuntimeError("boom"), 1, "failed: boom"),
    ],
)
def test_debug_shows_the_traceback_and_keeps_the_exit_code(monkeypatch, capsys, error, code, line):
    def failing(args: argparse.Namespace) -> int:
        raise error

    monkeypatch.setitem(cli.COMMANDS, "detect", failing)
    assert cli.main(["detect"]) == code
    assert capsys.readouterr().err.splitlines() == [line]  # one line, no traceback

    assert cli.main(["--debug", "detect"]) == code
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and "in failing" in "\n".join(err)
    assert err[-1] == line  # the summary stays the last line
