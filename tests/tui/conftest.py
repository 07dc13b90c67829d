"""Fixtures for the dashboard tests: the synthetic run of tui_support.py, finished or live, and a pinned
time zone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tui_support import synthetic_events, write_run

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
