"""Fixtures for the dashboard tests: the synthetic runs of tui_support.py (finished, live, fp16, and one with
three failures and recoveries), the recorded runs under fixtures/ (a CPU run, a finished 8-GPU run), and a
pinned time zone."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tui_support import synthetic_events, troubled_events, write_run

from appliance.rundir import RunDir


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Clock times on screen are local time: pin the zone so the snapshots match on every machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def finished_run(tmp_path: Path) -> RunDir:
    return write_run(tmp_path / "finished", synthetic_events())


@pytest.fixture
def live_run(tmp_path: Path) -> RunDir:
    return write_run(tmp_path / "live", synthetic_events(last_step=600, finished=False))


@pytest.fixture
def fp16_run(tmp_path: Path) -> RunDir:
    return write_run(tmp_path / "fp16", synthetic_events(fp16=True))


@pytest.fixture
def troubled_run(tmp_path: Path) -> RunDir:
    return write_run(tmp_path / "troubled", troubled_events())


FIXTURES = Path(__file__).parent / "fixtures"


def fixture_run(name: str, tmp_path: Path) -> RunDir:
    """A recorded run directory under fixtures/, copied so the test may write control files into it."""
    shutil.copytree(FIXTURES / name, tmp_path / name)
    return RunDir(tmp_path / name)


@pytest.fixture
def cpu_run(tmp_path: Path) -> RunDir:
    return fixture_run("cpu-2core", tmp_path)


@pytest.fixture
def gpu_run(tmp_path: Path) -> RunDir:
    return fixture_run("gpu-8xa100", tmp_path)


@pytest.fixture
def moe_run(tmp_path: Path) -> RunDir:
    return fixture_run("moe-cpu", tmp_path)
