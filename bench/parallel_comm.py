"""Bytes each rank sends per training step, measured on gloo ranks, next to the planner's analytic count; and the
step time on this CPU. One launch per layout, all in one run.

    .venv/bin/python bench/parallel_comm.py                       # the eight layouts of tp, pp, dp in {1, 2}
    .venv/bin/python bench/parallel_comm.py --layouts 2,2,2 1,1,2 --zero 0 --dtype bf16

Every rank builds the micro test model (presets/models/bloom-micro-test.toml: 2 layers, hidden 64, 4 heads,
32-token sequences) under the layout, trains one warm-up step, then trains one measured step with every
torch.distributed call wrapped: each call adds the bytes this rank sends under ring conventions (the planner's,
appliance/planner/comm.py): an all-reduce of S bytes over n ranks sends 2 (n-1)/n S, a reduce-scatter or an
all-gather (n-1)/n S, a send S. Calls are attributed to the axis of their group (tp, dp, pp, the tied-embedding
pair, or other: loss and norm scalars). The planner's count is for the same stage; the table prints each layout's
busiest rank, and the exit code is 1 if a layout's measured total differs from the planner's by more than 10%.
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
# The ranks are gloo processes on this CPU whatever the machine has; naming the accelerator also keeps
# DeepSpeed from warning about it in every rank.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import io  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402

from appliance.model.config import BloomConfig  # noqa: E402
from appliance.parallel.tensor import mappings  # noqa: E402
from appliance.parallel.testing import build_test_engine, run_distributed  # noqa: E402
from appliance.parallel.topology import ParallelTopology  # noqa: E402
from appliance.planner import load_model_shape  # noqa: E402
from appliance.planner.comm import communication_bytes_per_rank  # noqa: E402
from appliance.planner.layout import Layout  # noqa: E402

MODEL = "bloom-micro-test"
MICRO_BATCH, GLOBAL_BATCH = 2, 8
TOLERANCE = 0.10
ALL_LAYOUTS = [(t, p, d) for t in (1, 2) for p in (1, 2) for d in (1, 2)]
AXES = ("tp", "pp", "dp", "tied", "other")
PLANNER_KEYS = {"tp": "tp_allreduce", "pp": "pp_p2p", "dp": "dp_reduce", "tied": "tied_embedding"}


class ByteCounter:
    """Wraps torch.distributed's communication calls; counts the bytes this rank sends, per axis."""

    def __init__(self, topology: ParallelTopology) -> None:
        self.rank = dist.get_rank()
        me = topology.coords(self.rank)
        last = topology.global_rank(pp=topology.pp - 1, dp=me.dp, tp=me.tp)
        first = topology.global_rank(pp=0, dp=me.dp, tp=me.tp)
        self.axes = {
            frozenset(topology.group_ranks("tp", self.rank)): "tp",
            frozenset(topology.group_ranks("dp", self.rank)): "dp",
            frozenset({first, last}): "tied" if topology.pp > 1 else "other",
        }
        self.sent: dict[str, float] = defaultdict(float)
        self.active = False
        self._originals: list[tuple[Any, str, Any]] = []

    def _axis(self, group: Any) -> str:
        if isinstance(group, str):
            return group  # point-to-point: pipeline traffic
        if group is None:
            return "other"
        return self.axes.get(frozenset(dist.get_process_group_ranks(group)), "other")

    def _wrap(self, owner: Any, name: str, sent: Callable[[dict[str, Any]], tuple[float, Any]]) -> None:
        original = getattr(owner, name)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                size, group = sent(bound.arguments)
                self.sent[self._axis(group)] += size
            return original(*args, **kwargs)

        self._originals.append((owner, name, original))
        setattr(owner, name, counted)

    def install(self) -> None:
        """Wrap every function the traffic goes through, once per route (no call is counted twice):
        torch.distributed's own entry points; the two tensor collectives in the module that implements them (the
        deprecated all_gather_into_tensor / reduce_scatter_tensor, which DeepSpeed captured at start, call these);
        and the copies our tensor-parallel mappings bound at import."""

        def n(group: Any) -> int:
            return dist.get_world_size(group)

        def nbytes(t: torch.Tensor) -> float:
            return float(t.numel() * t.element_size())

        def all_reduce(a: dict[str, Any]) -> tuple[float, Any]:
            return 2 * (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["tensor"]), a["group"]

        def gather(a: dict[str, Any]) -> tuple[float, Any]:
            return (n(a["group"]) - 1) * nbytes(a["input_tensor"]), a["group"]  # my piece to every other rank

        def scatter(a: dict[str, Any]) -> tuple[float, Any]:
            return (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["input"]), a["group"]

        def gather_list(a: dict[str, Any]) -> tuple[float, Any]:
            return (n(a["group"]) - 1) * nbytes(a["tensor"]), a["group"]

        def broadcast(a: dict[str, Any]) -> tuple[float, Any]:
            return (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["tensor"]), a["group"]

        def send(a: dict[str, Any]) -> tuple[float, Any]:
            return nbytes(a["tensor"]), "pp"

        def receive(a: dict[str, Any]) -> tuple[float, Any]:
            return 0.0, "pp"

        for name, rule in (
            ("all_reduce", all_reduce),
            ("all_gather", gather_list),
            ("broadcast", broadcast),
            ("send", send),
            ("isend", send),
            ("recv", receive),
            ("irecv", receive),
        ):
            self._wrap(dist, name, rule)
        self._wrap(distributed_c10d, "all_gather_single", gather)
        self._wrap(distributed_c10d, "reduce_scatter_single", scatter)
        self._wrap(mappings, "_all_gather_single", gather)
        self._wrap(mappings, "_reduce_scatter_single", scatter)

    def __del__(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)


def measure(topology: ParallelTopology, zero: int, dtype: str, seq_len: int) -> dict[str, Any]:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed's PipelineModule
    shape = load_model_shape(MODEL)
    config = BloomConfig(
        vocab_size=shape.padded_vocab(topology.tp), hidden_size=shape.hidden, n_layer=shape.layers, n_head=shape.heads
    )
    quiet = contextlib.redirect_stdout(io.StringIO())  # DeepSpeed's start-up prints
    quiet.__enter__()
    engine = build_test_engine(
        config,
        topology,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=GLOBAL_BATCH,
        zero_stage=zero,
        dtype=dtype,
        weight_decay=0.1,
    )
    tokens = torch.randint(
        0, config.vocab_size, (GLOBAL_BATCH, seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    count = GLOBAL_BATCH // (MICRO_BATCH * topology.dp)
    micro = [(tokens[:MICRO_BATCH, :-1], tokens[:MICRO_BATCH, 1:]) for _ in range(count)]
    engine.train_batch(micro)  # warm-up: DeepSpeed's first step also exchanges shapes and builds buffers
    quiet.__exit__(None, None, None)
    counter = ByteCounter(topology)
    counter.install()
    dist.barrier()
    counter.active = True
    started = time.perf_counter()
    engine.train_batch(micro)
    seconds = time.perf_counter() - started
    counter.active = False
    sent = dict(counter.sent)
    del counter
    return {"stage": engine.pp_rank, "seconds": seconds, "sent": sent}


def planned(layout: tuple[int, int, int], zero: int, dtype: str, stage: int, seq_len: int) -> dict[str, float]:
    tp, pp, dp = layout
    plan_layout = Layout(
        tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, zero_stage=zero,
        recompute="none",
    )  # fmt: skip
    # fp32 on CPU: activations and weights of 4 bytes; bf16: 2. Gradients are reduced in fp32 either way.
    width = 4 if dtype == "fp32" else 2
    return communication_bytes_per_rank(
        plan_layout, load_model_shape(MODEL), seq_len=seq_len, stage=stage, act_bytes=width, param_bytes=width
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=[",".join(map(str, t)) for t in ALL_LAYOUTS])
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1, 2), help="2: pipeline layouts are skipped")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args(argv)
    layouts = [tuple(int(x) for x in text.split(",")) for text in args.layouts]
    print(
        f"{MODEL}, mbs {MICRO_BATCH}, global batch {GLOBAL_BATCH}, seq {args.seq_len}, {args.dtype}, ZeRO {args.zero}"
    )
    header = f"{'tp,pp,dp':>8} {'rank':>4} {'step s':>7} " + " ".join(f"{a:>9}" for a in AXES)
    print(header + f" {'measured':>10} {'planner':>10} {'ratio':>6}")
    worst = 0.0
    for layout in layouts:
        tp, pp, dp = layout
        if args.zero == 2 and pp > 1:
            print(f"{','.join(map(str, layout)):>8}  skipped: DeepSpeed's pipeline engine takes ZeRO 0 or 1")
            continue
        results = run_distributed(measure, tp * pp * dp, args.zero, args.dtype, args.seq_len, tp=tp, pp=pp, dp=dp,
                                  timeout_s=600)  # fmt: skip
        totals = [sum(r["sent"].values()) for r in results]
        busiest = max(range(len(results)), key=lambda r: totals[r])
        result = results[busiest]
        plan = planned(layout, args.zero, args.dtype, result["stage"], args.seq_len)
        ratio = totals[busiest] / plan["total"] if plan["total"] else float("nan") if totals[busiest] else 1.0
        if plan["total"]:
            worst = max(worst, abs(ratio - 1.0))
        seconds = max(r["seconds"] for r in results)
        cells = " ".join(f"{result['sent'].get(a, 0.0):>9.0f}" for a in AXES)
        planned_cells = " ".join(f"{plan.get(PLANNER_KEYS.get(a, ''), 0.0):>9.0f}" for a in AXES)
        print(f"{','.join(map(str, layout)):>8} {busiest:>4} {seconds:>7.3f} {cells} "
              f"{totals[busiest]:>10.0f} {plan['total']:>10.0f} {ratio:>6.3f}")  # fmt: skip
        print(f"{'planner':>8} {result['stage']:>4} {'stage':>7} {planned_cells}")
    print(f"largest difference from the planner: {worst:.1%} (tolerance {TOLERANCE:.0%})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
