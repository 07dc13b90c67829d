"""What a training step costs beyond its tokens: the single-replica engine against DeepSpeed's, on one device.

    .venv/bin/python bench/step_overhead.py                        # bloom-micro-test on CPU, or bloom-560m on a GPU
    .venv/bin/python bench/step_overhead.py --model bloom-560m --tokens 128 --steps 20 --out bench/results/x.json

Both engines train the same model (the preset's shape, bf16 on a GPU, fp32 on CPU) on a tiny step (one micro-batch of
`--tokens` tokens), so the step time is what does not scale with tokens: the optimizer's work per parameter, Python
around the kernels, and the host waiting for the device. Per engine it prints the median step time, the ops the
dispatcher ran per step, and the host reads per step (parallel/step/host_reads.py: scalar reads, nonzero, equal, copies
to the host, tolist), with the ratio between the two engines, measured in one run. The step is issued and its figures
read before the next, as `bench` does; the trainer reads them one step late, which only helps the single-replica one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/tokenize.py shadows the stdlib's
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from appliance.model.config import config_for_shape  # noqa: E402
from appliance.parallel.step.host_reads import counting_host_reads  # noqa: E402
from appliance.parallel.testing import build_test_engine  # noqa: E402
from appliance.parallel.topology import ParallelTopology  # noqa: E402
from appliance.planner import load_model_shape  # noqa: E402

ENGINES = ("auto", "deepspeed")  # auto: the single-replica engine at one replica


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(model: str, tokens: int, steps: int, cuda: bool) -> dict[str, Any]:
    from appliance.benchmark.trainer_speed import one_rank_group

    shape = load_model_shape(model)
    config = config_for_shape(shape, shape.padded_vocab())
    seq = min(tokens, shape.seq_len)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (1, seq + 1), generator=generator)
    micro = [(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())]
    out: dict[str, Any] = {}
    os.environ.setdefault("LOCAL_RANK", "0")
    with one_rank_group("nccl" if cuda else "gloo"):
        for name in ENGINES:
            engine = build_test_engine(
                config, ParallelTopology(tp=1, pp=1, dp=1, world_size=1), micro_batch_size=1, global_batch_size=1,
                dtype="bf16" if cuda else "fp32", step_engine=name,
            )  # fmt: skip
            for _ in range(3):  # warm-up: allocations, first launches
                engine.train_batch(micro)
            seconds = []
            for _ in range(steps):
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                engine.train_batch(micro)
                if cuda:
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - started)
            with _OpCount() as counted, counting_host_reads() as reads:
                engine.train_batch(micro)
            out[name] = {
                "engine": type(engine.engine).__name__,
                "median_step_ms": 1e3 * statistics.median(seconds),
                "ops_per_step": counted.ops,
                "host_reads_per_step": reads.total,
                "host_reads": dict(reads.counts),
            }
            del engine
            if cuda:
                torch.cuda.empty_cache()
    return out


def main() -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bloom-560m" if cuda else "bloom-micro-test")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per step (one micro-batch)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per engine")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    figures = measure(args.model, args.tokens, args.steps, cuda)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"step overhead, {args.model}, {args.tokens} tokens per step, {device}:")
    print(f"  {'engine':<22}{'ms/step':>10}{'ops/step':>10}{'host reads/step':>17}")
    for row in figures.values():
        print(f"  {row['engine']:<22}{row['median_step_ms']:>10.2f}{row['ops_per_step']:>10}"
              f"{row['host_reads_per_step']:>17}")  # fmt: skip
    single, deep = figures["auto"], figures["deepspeed"]
    print(f"  DeepSpeed's engine / single replica: {deep['median_step_ms'] / single['median_step_ms']:.2f}x time, "
          f"{deep['ops_per_step'] / max(single['ops_per_step'], 1):.2f}x ops")  # fmt: skip
    if args.out is not None:
        record = {"model": args.model, "tokens": args.tokens, "device": device, "date": time.strftime("%Y-%m-%d"),
                  "engines": figures}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
