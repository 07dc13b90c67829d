"""Flat against hierarchical expert all-to-all on 4 gloo ranks simulating 2 nodes x 2 ranks: bytes and messages each
rank sends per exchange and the time of one exchange, next to the planner's cost model (planner/moe_costs.py).

    .venv/bin/python bench/moe_all_to_all.py                       # three sizes of the [E, C, h] token tensor
    .venv/bin/python bench/moe_all_to_all.py --sizes 8x16x64 --repeats 50

Every rank exchanges an fp32 [E, C, h] tensor (E = 8 experts, 2 per rank) with each kind, a few warm-up rounds,
then ``--repeats`` timed rounds between barriers (the slowest rank's median). Bytes and messages come from the
exchange's own counter (parallel/experts/all_to_all.py). The model's time uses the loopback link of a CPU host
(planner/device.py's rates: all four ranks share one host, so both "nodes" talk over loopback); on real nodes the
second step would cross the fabric. The exit code is 1 if a measured byte or message count differs from the model's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as a script, this directory would come first on the import path, where bench/tokenize.py hides the standard
# library's tokenize: put the repository root there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from appliance.parallel.experts.all_to_all import (  # noqa: E402
    AllToAllCounter,
    HierarchicalGroups,
    flat_all_to_all,
    hierarchical_all_to_all,
    hierarchical_groups,
)
from appliance.parallel.testing import run_distributed  # noqa: E402
from appliance.parallel.topology import ParallelTopology  # noqa: E402
from appliance.planner import calibration as cal  # noqa: E402
from appliance.planner.moe_costs import MoeLinks, MoeShape, flat_cost, hierarchical_cost  # noqa: E402

RANKS, RANKS_PER_NODE, EXPERTS = 4, 2, 8
WARMUP = 3
LOOPBACK = 40 / 8 * 1e9 * cal.LINK_EFFICIENCY  # hardware/specs.py LOOPBACK_GBPS, as planner/device.py rates it
CPU_LINKS = MoeLinks(
    intra_bandwidth=LOOPBACK,
    intra_latency=cal.RING_STEP_LATENCY_S["loopback"],
    inter_bandwidth=LOOPBACK,
    inter_latency=cal.RING_STEP_LATENCY_S["loopback"],
    host_bandwidth=LOOPBACK,
    disk_bandwidth=LOOPBACK,
)


def _exchange(kind: str, x: torch.Tensor, groups: HierarchicalGroups, counter: AllToAllCounter) -> torch.Tensor:
    if kind == "flat":
        return flat_all_to_all(x, dist.group.WORLD, counter)
    return hierarchical_all_to_all(x, groups, counter)


def _measure(topology: ParallelTopology, sizes: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    ep_groups = ParallelTopology(tp=1, pp=1, dp=RANKS, ep=RANKS, world_size=RANKS).groups("ep")
    groups = hierarchical_groups(ep_groups, ranks_per_node=RANKS_PER_NODE)
    found: dict[str, Any] = {}
    for slots, hidden in sizes:
        x = torch.randn(EXPERTS, slots, hidden)
        for kind in ("flat", "hierarchical"):
            counter = AllToAllCounter()
            for _ in range(WARMUP):
                _exchange(kind, x, groups, counter)
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                _exchange(kind, x, groups, counter)
                times.append(time.perf_counter() - start)
            calls = WARMUP + repeats
            found[f"{slots}x{hidden} {kind}"] = (
                counter.messages / calls,
                counter.bytes_sent / calls,
                statistics.median(times),
            )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8x16x64", "8x128x256", "8x512x1024"], help="E x C x h")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sizes = []
    for text in args.sizes:
        experts, slots, hidden = map(int, text.split("x"))
        if experts != EXPERTS:
            raise SystemExit(f"--sizes {text}: E must be {EXPERTS} (2 experts on each of 4 ranks)")
        sizes.append((slots, hidden))
    results = run_distributed(_measure, RANKS, sizes, args.repeats, dp=RANKS, timeout_s=600)

    print(f"4 gloo ranks as 2 nodes x 2, fp32 [E, C, h], median of {args.repeats}; model: loopback links")
    columns = ("E x C x h", 12), ("kind", 12), ("KiB sent", 9), ("msgs", 5), ("ms", 8), ("model ms", 9)
    ratios = ("bytes", 6), ("msgs", 5), ("time", 5)
    print(" ".join(f"{name:>{width}}" for name, width in (*columns, *ratios)) + "  (last three: measured / model)")
    mismatch = False
    for slots, hidden in sizes:
        shape = MoeShape(
            num_experts=EXPERTS,
            top_k=1,
            capacity_factor=1.0,
            moe_layers=1,
            hidden=hidden,
            tokens=EXPERTS * slots,  # C = ceil(1 x 1 x 8 C / 8) = C
            ep=RANKS,
            ranks_per_node=RANKS_PER_NODE,
            act_bytes=4,
        )
        for kind, cost in (
            ("flat", flat_cost(shape, CPU_LINKS)),
            ("hierarchical", hierarchical_cost(shape, CPU_LINKS)),
        ):
            key = f"{slots}x{hidden} {kind}"
            messages = results[0][key][0]
            sent = results[0][key][1]
            seconds = max(rank[key][2] for rank in results)  # the exchange ends when the slowest rank has its data
            bytes_ratio = sent / cost.bytes_sent_per_call
            message_ratio = messages / cost.messages_per_call
            mismatch |= abs(bytes_ratio - 1) > 1e-9 or abs(message_ratio - 1) > 1e-9
            size = f"{EXPERTS}x{slots}x{hidden}"
            time_ratio = seconds / cost.seconds_per_call
            print(
                f"{size:>12} {kind:>12} {sent / 1024:9.1f} {messages:5.0f} {seconds * 1e3:8.3f} "
                f"{cost.seconds_per_call * 1e3:9.3f} {bytes_ratio:6.2f} {message_ratio:5.2f} {time_ratio:5.1f}"
            )
    return 1 if mismatch else 0


if __name__ == "__main__":
    raise SystemExit(main())
