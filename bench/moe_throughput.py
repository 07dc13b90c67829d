"""Training tokens/s of a BLOOM-MoE model at ep = 1, 2 and 4 on 4 gloo ranks (dp = 4), in one launch.

    .venv/bin/python bench/moe_throughput.py                                  # bloom-moe-tiny-cpu, 10 timed steps
    .venv/bin/python bench/moe_throughput.py --steps 20 --ranks-per-node 2    # 2 simulated nodes: hierarchical at ep 4

Each ep builds the engine (parallel/testing.py ``build_test_engine``, fp32, ZeRO 0: the CPU layout) on the same 4
ranks, runs ``--warmup`` steps, then ``--steps`` timed steps between barriers, one micro-batch of ``--micro-batch-size``
random sequences per rank and step. Tokens/s = 4 ranks x micro-batch x seq_len / the median step (every rank waits
for the slowest at the gradient all-reduce, so rank 0's clock is the step's). ep > 1 splits every MoE block's
experts over ep ranks (each holds E/ep) and adds two all-to-alls per MoE block and pass; the exchange is the one
the engine picks (parallel/experts/exchange.py ``select_all_to_all``), printed beside each row. Ratios are against ep =
1.
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

from appliance.model.config import BloomConfig, config_for_shape  # noqa: E402
from appliance.parallel.testing import build_test_engine, run_distributed  # noqa: E402
from appliance.parallel.topology import ParallelTopology  # noqa: E402
from appliance.planner.model_shape import load_model_shape  # noqa: E402

RANKS = 4
EPS = (1, 2, 4)


def _steps_at(
    world: ParallelTopology, config: BloomConfig, ep: int, mbs: int, seq: int, warmup: int, steps: int
) -> dict[str, Any]:
    topology = ParallelTopology(tp=1, pp=1, dp=RANKS, ep=ep, world_size=RANKS)
    engine = build_test_engine(
        config, topology, micro_batch_size=mbs, global_batch_size=mbs * RANKS, seed=42, seq_len=seq
    )  # fp32, ZeRO 0, AdamW at lr 1e-3, clipping at 1.0 (appliance/parallel/testing.py)
    selected = engine.all_to_all
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, config.vocab_size, (mbs, seq + 1), generator=g)
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        dist.barrier()
        start = time.perf_counter()
        engine.train_batch([batch])
        if step >= warmup:
            times.append(time.perf_counter() - start)
    engine.close()
    return {"median_s": statistics.median(times), "kind": selected.kind if selected else "flat"}


def _measure(
    world: ParallelTopology, model: str, mbs: int, warmup: int, steps: int, ranks_per_node: int | None
) -> dict[int, Any]:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed
    if ranks_per_node is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)  # as torchrun sets it on each node
    shape = load_model_shape(model)
    config = config_for_shape(shape, shape.padded_vocab())
    return {ep: _steps_at(world, config, ep, mbs, shape.seq_len, warmup, steps) for ep in EPS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bloom-moe-tiny-cpu", help="an MoE preset whose experts divide by 4")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks-per-node", type=int, default=None, help="simulate nodes (LOCAL_WORLD_SIZE)")
    args = parser.parse_args()
    shape = load_model_shape(args.model)
    if shape.moe_num_experts % max(EPS):
        raise SystemExit(f"--model {args.model}: moe_num_experts({shape.moe_num_experts}) must divide by {max(EPS)}")
    results = run_distributed(
        _measure,
        RANKS,
        args.model,
        args.micro_batch_size,
        args.warmup,
        args.steps,
        args.ranks_per_node,
        dp=RANKS,
        timeout_s=900,
    )[0]
    tokens = RANKS * args.micro_batch_size * shape.seq_len
    nodes = f"{args.ranks_per_node} ranks per node" if args.ranks_per_node else "one node"
    print(
        f"{args.model}: {shape.moe_num_experts} experts in {shape.moe_layers} MoE blocks, {RANKS} gloo ranks (dp=4, "
        f"{nodes}), {tokens} tokens per step, median of {args.steps} steps"
    )
    print(f"{'ep':>3} {'experts/rank':>12} {'exchange':>12} {'step ms':>9} {'tokens/s':>9} {'vs ep=1':>8}")
    base = tokens / results[1]["median_s"]
    for ep in EPS:
        got = results[ep]
        rate = tokens / got["median_s"]
        print(
            f"{ep:>3} {shape.moe_num_experts // ep:>12} {got['kind']:>12} {got['median_s'] * 1e3:9.1f} "
            f"{rate:9.0f} {rate / base:8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
