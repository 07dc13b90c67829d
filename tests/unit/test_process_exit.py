"""A finished rank or agent leaves without the interpreter's teardown (appliance/process_exit.py),
but with everything it wrote complete: the exit handlers (TensorBoard's and W&B's writers register theirs) and the
buffered output still run and reach their files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from appliance.train.launch import AGENT_MODULE, agent_command

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from pathlib import Path
    from appliance.process_exit import exit_without_teardown

    out = Path(sys.argv[1])

    class Finalised:
        def __init__(self, path):
            self.path = path

        def __del__(self, open=open):  # runs when the interpreter tears its modules down (builtins bound early)
            with open(self.path, "w") as f:
                f.write("yes")

    keep = Finalised(str(out / "finalised"))
    atexit.register(lambda: (out / "exit_handler").write_text("ran"))
    print("the rank's last line")  # stdout is a file here: block-buffered, so only a flush writes it
    exit_without_teardown(3)
    """
)


def test_a_finished_rank_runs_its_exit_handlers_flushes_and_skips_the_teardown(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    with log.open("w") as stdout:
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=stdout, timeout=120)
    assert done.returncode == 3  # the rank's code reaches the agent
    assert (tmp_path / "exit_handler").read_text() == "ran"
    assert log.read_text().endswith("the rank's last line\n")
    assert not (tmp_path / "finalised").exists()  # no module teardown: the time it takes is what is saved


def test_the_same_script_without_it_is_finalised(tmp_path: Path) -> None:
    """The control: a normal exit does tear the modules down (so the test above shows the teardown skipped)."""
    script = SCRIPT.replace("exit_without_teardown(3)", "sys.exit(3)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=120)
    assert done.returncode == 3 and (tmp_path / "finalised").read_text() == "yes"


def test_the_agent_is_torchs_and_passes_its_ranks_outcome_on(tmp_path: Path) -> None:
    """appliance.train.agent is torch.distributed.run with the same arguments: a launch whose rank succeeds exits 0,
    one whose rank fails exits non-zero with torch's own report (it names the failed script)."""
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("import os; open(os.environ['OUT'], 'w').write(os.environ['RANK'])\n")
    bad.write_text("raise SystemExit(7)\n")
    agent = [sys.executable, "-m", AGENT_MODULE, "--standalone", "--nproc-per-node=1", "--monitor-interval=0.1"]
    env = {**os.environ, "OUT": str(tmp_path / "ran")}
    done = subprocess.run([*agent, str(good)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ran").read_text() == "0"
    failed = subprocess.run([*agent, str(bad)], env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0 and "bad.py" in failed.stderr


def test_the_launcher_starts_that_agent(tmp_path: Path) -> None:
    cmd = agent_command(tmp_path, nproc_per_node=2, max_restarts=0)
    assert cmd[1:3] == ["-m", AGENT_MODULE] and cmd[cmd.index(AGENT_MODULE) + 1 :].count("-m") == 1
