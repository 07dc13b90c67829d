"""The spawn helper reports the rank that failed first, and gives up on ranks that hang."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from appliance.errors import BadInput
from appliance.parallel.testing import DistributedRunError, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed


def _fails_on_rank_one(topology: ParallelTopology) -> int:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on one rank")
    dist.barrier()  # rank 0 fails here once rank 1 is gone; the report must still name rank 1
    return 0


def test_helper_raises_the_traceback_of_the_rank_that_failed_first() -> None:
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1 of 2 failed:.*ValueError: deliberate failure"):
        run_distributed(_fails_on_rank_one, 2, dp=2, timeout_s=60)


def _hangs_on_rank_one(topology: ParallelTopology) -> int:
    if dist.get_rank() == 1:
        time.sleep(120)
    return dist.get_rank()


def test_helper_stops_ranks_that_do_not_finish() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"rank\(s\) \[1\] did not finish within 10 s"):
        run_distributed(_hangs_on_rank_one, 2, dp=2, timeout_s=10)
    # The hung rank would otherwise hold the test until pytest's own timeout (900 s). The bound leaves room for two
    # spawned ranks' imports on 2 busy cores (a 30 s bound failed while another run shared the machine).
    assert time.monotonic() - started < 90


def test_helper_rejects_a_bad_layout_before_spawning() -> None:
    with pytest.raises(BadInput, match=r"tp\(2\) \* pp\(1\) \* dp\(1\) = 2 != world size 4"):
        run_distributed(_hangs_on_rank_one, 4, tp=2)
