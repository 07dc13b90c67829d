"""The dashboard in a real terminal: tmux runs run_tui on a finished run; keys go in with send-keys and the
screen comes back with capture-pane."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux) for the real-terminal test"
)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[list[str]]:
    """tmux on a private socket in the test's temp dir: it neither sees nor touches anyone else's sessions."""
    command = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    yield command
    subprocess.run([*command, "kill-server"], capture_output=True, check=False)


def screen(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True).stdout


def wait_for(tmux: list[str], present: tuple[str, ...] = (), absent: str | None = None, timeout: float = 30) -> str:
    """The screen once it shows everything in `present` (and not `absent`): a capture can catch a frame that is
    still being written, so every check waits rather than reading one capture."""
    deadline = time.monotonic() + timeout
    while True:
        text = screen(tmux)
        missing = [p for p in present if p not in text]
        if not missing and (absent is None or absent not in text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; missing {missing}, absent {absent!r}; screen:\n{text}")
        time.sleep(0.2)


def test_tui_on_a_finished_run_in_tmux(tmux: list[str], finished_run: RunDir) -> None:
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    root = str(finished_run.root)
    code = (
        "import sys; from pathlib import Path; "
        f"from appliance.tui.app import run_tui; sys.exit(run_tui(Path({root!r})))"
    )
    # COLUMNS/LINES from the test process would pin the app to their size instead of the pane's.
    run = f"unset COLUMNS LINES && TZ=UTC {shlex.quote(str(python))} -c {shlex.quote(code)}"
    shell = f"cd {shlex.quote(str(REPO))} && {run}; echo TUI_EXIT=$?; sleep 60"
    subprocess.run([*tmux, "new-session", "-d", "-s", "tui", "-x", "160", "-y", "50", shell], check=True)

    text = wait_for(
        tmux,
        (
            "GPUs: 384 on 48 nodes",
            "bloom-176b-synthetic",
            "done",
            "step 1000/1000",
            "39.9k",
            "loss 2.152",
            "node09",
            "failures 1 · restarts 1",
            "rank 137",
            "validation by language",
            "0.612 ±0.007",
            "Paris, a city on the Seine",
        ),
    )
    assert any("\u2801" <= ch <= "\u28ff" for ch in text)  # the braille plot made it to the terminal

    subprocess.run([*tmux, "send-keys", "-t", "tui", "?"], check=True)
    wait_for(tmux, ("Panels", "request a checkpoint now"))
    subprocess.run([*tmux, "send-keys", "-t", "tui", "Escape"], check=True)
    wait_for(tmux, ("GPUs: 384 on 48 nodes",), absent="request a checkpoint now")

    subprocess.run([*tmux, "send-keys", "-t", "tui", "q"], check=True)
    # The closing summary stays in the terminal once the dashboard has gone: the run's state and what to run next.
    wait_for(tmux, ("TUI_EXIT=0", f"Run done: {root}", f"./bloom_appliance.py tui --run-dir {root}"))
    assert not finished_run.request_checkpoint.exists() and not finished_run.request_stop.exists()
