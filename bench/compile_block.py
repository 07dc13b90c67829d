"""One transformer block's forward + backward, eager against torch.compile (inductor, fullgraph), on this machine's
CPU: what `compile=auto` weighs when it leaves CPU ranks eager.

    .venv/bin/python -m bench.compile_block [--model NAME] [--micro-batch N] [--steps K] [--threads T]

The block is the model preset's (default bloom-tiny-cpu, the CPU smoke run's) at its sequence length, fp32, built
and compiled as parallelize.compile_blocks does (the block's forward, in place); both copies start from the same
weights. Prints the first compiled call (the compile itself), the median step of each after two warm-up steps,
and how many training steps the compile takes to pay back (one graph serves all of the model's blocks, so the
saving per step is the model's layers times a block's). Inductor keeps compiled kernels in its cache between runs, so
the first call is slower on a cold cache than on a warm one; both are worth knowing.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

from appliance.model.bloom import BloomBlock
from appliance.model.config import config_for_shape
from appliance.planner.model_shape import load_model_shape


def _step(block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    start = time.perf_counter()
    block(x).square().mean().backward()
    return time.perf_counter() - start


def measure(model: str, micro_batch: int, steps: int) -> dict[str, float]:
    shape = load_model_shape(model)
    config = config_for_shape(shape, shape.vocab_size)
    torch.manual_seed(0)
    eager = BloomBlock(config, 0)
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=config.initializer_range)
    compiled = copy.deepcopy(eager)
    compiled.forward = torch.compile(compiled.forward, fullgraph=True)  # type: ignore[method-assign]
    x = torch.randn(micro_batch, shape.seq_len, shape.hidden, requires_grad=True)
    first = _step(compiled, x)
    for _ in range(2):
        _step(eager, x), _step(compiled, x)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(steps):  # alternating, so a neighbour's load slows both alike
        times["eager"].append(_step(eager, x))
        times["compiled"].append(_step(compiled, x))
    out = {name: statistics.median(values) for name, values in times.items()}
    out["first_compiled_call"] = first
    saved = (out["eager"] - out["compiled"]) * shape.layers
    out["steps_to_pay_back"] = first / saved if saved > 0 else float("inf")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bloom-tiny-cpu")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a CPU training rank's: 1 here)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = measure(args.model, args.micro_batch, args.steps)
    print(f"{args.model} block, micro-batch {args.micro_batch}, fp32, {args.threads} thread(s), CPU")
    print(f"  eager forward+backward     {r['eager'] * 1e3:8.2f} ms (median of {args.steps})")
    print(f"  compiled forward+backward  {r['compiled'] * 1e3:8.2f} ms  ({r['eager'] / r['compiled']:.2f} x)")
    print(f"  first compiled call        {r['first_compiled_call']:8.2f} s  (the compile)")
    print(f"  training steps to pay the compile back: {r['steps_to_pay_back']:.0f}")


if __name__ == "__main__":
    main()
