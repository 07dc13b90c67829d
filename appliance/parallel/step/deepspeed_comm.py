"""Starting DeepSpeed's communication layer: on the process group the ranks already share, or, for the ranks of a
launch, on a new one whose store listens where the launcher said (parallel/store.py `ranks_init_method`)."""

from __future__ import annotations

from datetime import timedelta

from appliance.parallel.store import ranks_init_method

# DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (C++, about a minute on 2 cores) the first time its
# communication layer starts, behind a file lock that a killed build leaves in place: every later start then waits
# forever. That op only serves DeepSpeed's inference all-reduce; training all-reduces through gloo, so on gloo we
# mark it unavailable and nothing is compiled.
SHM_COMM_OP = "deepspeed_shm_comm"


def init_deepspeed_comm(backend: str, timeout: timedelta | None = None) -> None:
    """`timeout`: how long the world's collectives wait (None: DeepSpeed's default)."""
    import deepspeed
    import deepspeed.ops

    if backend == "gloo":
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    given = {} if timeout is None else {"timeout": timeout}
    deepspeed.init_distributed(dist_backend=backend, init_method=ranks_init_method(), **given)
