"""The README says what the command line does: its command table names every command and every flag `--help` shows
(and no flag the parser lacks), the `--layout` keys are the planner's, the `--set` table is the settings `--set`
accepts with whether each may change mid-run, and the outputs table names every file and folder of a run
directory."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from appliance.cli_parser import build_parser
from appliance.monitor.snapshot import SNAPSHOT_NAME
from appliance.overrides import known_keys
from appliance.planner.train_settings import CHANGEABLE_MID_RUN
from appliance.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# Flags every command has, documented once beside the table: --help, and the global --debug.
EVERY_COMMAND = {"-h", "--help", "--debug"}
NOT_A_COMMAND = "./bloom_appliance.py"  # the row of the default run
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def cells(row: str) -> list[str]:
    """A markdown table row's cells; `\\|` inside a cell is a literal bar."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def table(text: str, header: str) -> list[list[str]]:
    """The rows of the table whose header row starts with `header` (e.g. "| command |"), below its rule."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return rows


def readme_flags(text: str) -> dict[str, set[str]]:
    """Command -> the flags its rows' synopses name (`run|train ...` rows count for both); a row for a command
    the parser lacks is kept under its own name, so that the comparison reports it."""
    flags: dict[str, set[str]] = {}
    for row in table(text, "| command |"):
        synopsis = row[0].strip("`")
        first = synopsis.split()[0]
        if first == NOT_A_COMMAND:
            continue
        for command in first.split("|"):
            flags.setdefault(command, set()).update(FLAG.findall(synopsis))
    return flags


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def parser_flags() -> dict[str, set[str]]:
    """Command -> the flags its --help lists (one hidden with help=SUPPRESS is not listed)."""
    return {
        name: {o for a in p._actions if a.help != argparse.SUPPRESS for o in a.option_strings} - EVERY_COMMAND
        for name, p in subcommands(build_parser()).items()
    }


def differences(readme: dict[str, set[str]], parser: dict[str, set[str]]) -> list[str]:
    found = [f"`{c}`: a command --help lists, not in the README's table" for c in sorted(parser.keys() - readme.keys())]
    found += [f"`{c}`: in the README's table, not a command" for c in sorted(readme.keys() - parser.keys())]
    for command in sorted(parser.keys() & readme.keys()):
        found += [f"`{command} {f}`: in --help, not in the README" for f in sorted(parser[command] - readme[command])]
        found += [f"`{command} {f}`: in the README, not in --help" for f in sorted(readme[command] - parser[command])]
    return found


def test_the_command_table_names_every_command_and_flag_of_the_parser_and_no_other():
    assert not differences(readme_flags(README), parser_flags()), "\n".join(
        differences(readme_flags(README), parser_flags())
    )


def test_the_comparison_finds_a_missing_command_a_missing_flag_and_a_flag_the_parser_lacks():
    """Control: each kind of disagreement, put into the real README, is reported."""
    parser = parser_flags()
    no_presets = "\n".join(line for line in README.splitlines() if not line.startswith("| `presets [--json]` |"))
    assert differences(readme_flags(no_presets), parser) == [
        "`presets`: a command --help lists, not in the README's table"
    ]
    typo = README.replace("| `presets [--json]` |", "| `preset [--json]` |")
    assert differences(readme_flags(typo), parser) == [
        "`presets`: a command --help lists, not in the README's table",
        "`preset`: in the README's table, not a command",
    ]
    no_wait = README.replace("`tui --run-dir D [--wait]`", "`tui --run-dir D`")
    assert differences(readme_flags(no_wait), parser) == ["`tui --wait`: in --help, not in the README"]
    extra = README.replace("`train --run-dir D [--resume]", "`train --run-dir D [--resume-from STEP] [--resume]")
    assert differences(readme_flags(extra), parser) == ["`train --resume-from`: in the README, not in --help"]


def test_layout_takes_the_planners_keys_in_the_help_and_the_readme():
    from appliance.cli_parser import LAYOUT_METAVAR, layout_keys

    keys = layout_keys()
    assert keys == ["tp", "pp", "dp", "mbs", "gbs", "zero", "recompute", "sp", "cp", "cp_mode", "tp2d", "ep"]
    commands = subcommands(build_parser())
    for name in ("run", "train", "plan"):
        layout = next(a for a in commands[name]._actions if "--layout" in a.option_strings)
        assert layout.metavar == LAYOUT_METAVAR and str(layout.help).endswith("keys: " + ", ".join(keys)), name
    written = {m for row in table(README, "| command |") for m in re.findall(r"--layout (\S+?)\]", row[0])}
    assert written == {LAYOUT_METAVAR}
    assert "takes the planner's keys: " + ", ".join(f"`{k}`" for k in keys) in " ".join(README.split())


def set_table(text: str) -> dict[str, str]:
    """Key -> its "mid-run" cell, from the README's --set table."""
    return {key: row[2] for row in table(text, "| key | what | mid-run |") for key in re.findall(r"`(\w+)`", row[0])}


def test_the_set_table_lists_every_key_and_whether_it_may_change_mid_run():
    rows = set_table(README)
    assert sorted(rows) == sorted(known_keys())
    wrong = {key: mid_run for key, mid_run in rows.items() if mid_run != ("yes" if key in CHANGEABLE_MID_RUN else "no")}
    assert not wrong, f"mid-run column disagrees with appliance/planner/train_settings.py: {wrong}"


def test_the_set_table_check_sees_a_missing_key_and_a_wrong_column():
    """Control: the README with a key dropped, or a fixed key marked mid-run, no longer matches."""
    assert "seed" not in set_table(README.replace("| `seed` |", "| seed |"))
    seed_row = "| the data order, the initial weights and dropout |"
    assert set_table(README.replace(f"{seed_row} no |", f"{seed_row} yes |"))["seed"] == "yes"


def run_dir_entries() -> set[str]:
    """The top-level names of a run directory: RunDir's paths, the head's log and the dashboard's snapshot."""
    from appliance.monitor.closing import HEAD_LOG

    run = RunDir(Path("D"))
    paths = [getattr(run, name) for name, value in vars(RunDir).items() if isinstance(value, property)]
    parts = [p.relative_to(run.root).parts for p in paths]
    # A folder when a path lies inside it (tokenizer/tokenizer.json) or its name has no suffix (logs, compile-cache).
    return {top + ("/" if len(rest) or "." not in top else "") for top, *rest in parts} | {HEAD_LOG, SNAPSHOT_NAME}


def test_the_outputs_table_names_every_entry_of_a_run_directory():
    named = {re.sub(r"`([^`]+)`.*", r"\1", row[0]) for row in table(README, "| path | what |")}
    entries = run_dir_entries()
    assert {"head.log", "plan.json", "checkpoints/", "control/", "stages.json"} <= entries  # control for the scan
    assert not entries - named, f"in a run directory, not in the README's outputs table: {sorted(entries - named)}"
