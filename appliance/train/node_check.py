"""`python -m appliance.train.node_check RUN_DIR RANKS`: whether this node's torch and accelerator can train the
run's plan with RANKS ranks (train/launch.py check_plan_runs_here), in a process of its own. A spare's launcher asks
it before it stands by (train/standby.py): the check imports torch, which the standby itself never holds. Exit 0, or
2 with the reason on stderr."""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.errors import BadInput
from appliance.planner.runspec import load_spec
from appliance.rundir import RunDir
from appliance.train.launch import check_plan_runs_here


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        raise SystemExit("usage: python -m appliance.train.node_check RUN_DIR RANKS")
    run_dir = RunDir(Path(args[0]))
    try:
        check_plan_runs_here(load_spec(run_dir.plan), str(run_dir.plan), ranks_here=int(args[1]))
    except BadInput as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
