"""Command line: parses, validates, dispatches. No logic of its own (docs/ARCHITECTURE.md, "Commands")."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from appliance.cli_data import cmd_prep, cmd_tokenize, cmd_tokenizer
from appliance.cli_parser import build_parser
from appliance.cli_plan import cmd_bench, cmd_detect, cmd_plan
from appliance.cli_preflight import cmd_preflight
from appliance.cli_presets import cmd_presets
from appliance.cli_run import cmd_run, cmd_tui
from appliance.cli_train import cmd_eval, cmd_export, cmd_import, cmd_sbatch, cmd_train
from appliance.errors import EXIT_BAD_INPUT, EXIT_FAILED, BadInput
from appliance.output_dirs import start_command

# Flags of the program itself, accepted before the command (`--debug run ...`) and, for --debug, after it too.
GLOBAL_FLAGS = ("--debug",)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "detect": cmd_detect,
    "plan": cmd_plan,
    "preflight": cmd_preflight,
    "prep": cmd_prep,
    "tokenizer": cmd_tokenizer,
    "tokenize": cmd_tokenize,
    "train": cmd_train,
    "eval": cmd_eval,
    "export": cmd_export,
    "tui": cmd_tui,
    "sbatch": cmd_sbatch,
    "import": cmd_import,
    "bench": cmd_bench,
    "presets": cmd_presets,
}


def with_default_command(argv: list[str]) -> list[str]:
    """No command, or only options (`./bloom_appliance.py --debug --max-steps 40`): the command is `run`, placed
    after the global flags."""
    n = 0
    while n < len(argv) and argv[n] in GLOBAL_FLAGS:
        n += 1
    rest = argv[n:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help", "--version")):
        return [*argv[:n], "run", *rest]
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = with_default_command(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    # Files 0640 and folders 0750 at most, in this process and every process it starts (agents, ranks), whatever
    # the user's umask: a group-writable run directory would let group members replace plan.json. The output
    # folders' markers record this command line.
    start_command(argv)
    try:
        return COMMANDS[args.command](args)
    except BadInput as e:
        _report(f"error: {e}", debug=args.debug)
        return EXIT_BAD_INPUT
    except Exception as e:  # an unrecoverable failure: the message, metrics.jsonl and logs/ say why
        _report(f"failed: {e}", debug=args.debug)
        return EXIT_FAILED


def _report(message: str, *, debug: bool) -> None:
    """One line on stderr; with --debug the traceback first, so that the line stays last."""
    if debug:
        traceback.print_exc()
    print(message, file=sys.stderr)
