"""The single-replica optimizer region alone, on one device: a step of FlatAdamW (parallel/step/flat_optimizer.py) at a
preset's parameter shapes, bf16 weights and one micro-batch a step, against the same region as it ran before the
one-pass kernels (`step_before_one_pass`), torch's fused AdamW alone over the flat fp32 state, and a device copy.

    python bench/optimizer_step.py                              # bloom-560m on a GPU, bloom-micro-test on CPU
    python bench/optimizer_step.py --model bloom-1b7 --steps 20 --configs 1024x4,2048x8,4096x16

Each contender's gradients are random bf16 tensors, one per parameter, as autograd leaves them. On a GPU every figure
is the median of `--steps` CUDA-event timings of one step, after two warm-up steps; `--configs` times the Triton
kernels at other (elements per program x warps) than kernels/flat_adamw.py's `launch_config` picks. Bytes per
parameter are counted by tests/unit/test_optimizer_bytes.py, not here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/tokenize.py shadows the stdlib's
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

from appliance.parallel.step.flat_optimizer import FlatAdamW  # noqa: E402

BETAS, EPS, LR, WEIGHT_DECAY, MAX_NORM = (0.9, 0.95), 1e-8, 1e-4, 0.1, 1.0


def step_before_one_pass(optimizer: FlatAdamW, flat_grads: torch.Tensor, fp32_grads: torch.Tensor) -> None:
    """The optimizer region of one bf16 step as FlatAdamW ran it before the one-pass kernels, op for op: the
    gradients copied into a flat bf16 buffer (one multi-tensor copy) and from there into an fp32 one, the norm through
    `pow(2).sum()` per group, the verdicts, torch's fused AdamW with `grad_scale` (which writes the divided gradients
    back) and `found_inf`, and the masters cast back to the bf16 weights. `flat_grads`, `fp32_grads`: the buffers it
    kept, bf16 and fp32, the size of the flat weights."""
    params = list(optimizer.parameters())
    views = [flat_grads[o : o + n].view_as(p) for p, (o, n) in ((p, optimizer._offsets[p]) for p in params)]
    grads = [p.grad for p in params]
    torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
    for p in params:
        p.grad = None
    fp32_grads.copy_(flat_grads)
    exp_avg, exp_avg_sq = optimizer._moments()
    squares = torch.stack([fp32_grads[g.start : g.counted_end].pow(2).sum() for g in optimizer._groups]).sum()
    norm = squares.sqrt()
    skipped = (~torch.isfinite(norm)).float()
    scale = torch.clamp((norm + 1e-6) / MAX_NORM, min=1.0)
    optimizer.step_count.add_(1.0 - skipped)
    for g in optimizer._groups:
        torch._fused_adamw_(
            [optimizer.master[g.start : g.end]], [fp32_grads[g.start : g.end]], [exp_avg[g.start : g.end]],
            [exp_avg_sq[g.start : g.end]], [], [optimizer.step_count], lr=LR, beta1=BETAS[0], beta2=BETAS[1],
            weight_decay=g.weight_decay, eps=EPS, amsgrad=False, maximize=False, grad_scale=scale, found_inf=skipped,
        )  # fmt: skip
    optimizer.weights.copy_(optimizer.master)


def parameters(model: str, device: torch.device) -> list[tuple[str, torch.nn.Parameter]]:
    """The preset's parameters (their shapes as BloomForCausalLM has them, the LM head tied), bf16, random."""
    from appliance.model.bloom import BloomForCausalLM
    from appliance.model.config import config_for_shape
    from appliance.planner import load_model_shape

    shape = load_model_shape(model)
    with torch.device("meta"):
        layout = BloomForCausalLM(config_for_shape(shape, shape.padded_vocab()))
    generator = torch.Generator(device=device).manual_seed(0)
    return [(name, torch.nn.Parameter(0.02 * torch.randn(p.shape, generator=generator, device=device,
                                                         dtype=torch.bfloat16)))
            for name, p in layout.named_parameters()]  # fmt: skip


def _time(run: Callable[[], None], steps: int, cuda: bool) -> float:
    """Median milliseconds of one call (CUDA events on a GPU, wall clock on CPU), after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            started = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def _kernels_against_twins(optimizer: FlatAdamW, with_gradients: Callable[..., Callable[[], None]]) -> dict[str, float]:
    """Three steps from the same state through the kernels and through the torch twins (BLOOM_KERNELS=reference):
    per buffer the largest difference, in units of the last place of its largest value (fp32; bf16 for the
    weights). Both paths end where they started: the state is restored."""
    import os

    optimizer._moments()
    buffers = {"master": optimizer.master, "exp_avg": optimizer.exp_avg, "exp_avg_sq": optimizer.exp_avg_sq,
               "weights": optimizer.weights, "step": optimizer.step_count}  # fmt: skip
    start = {k: v.clone() for k, v in buffers.items()}
    ends = []
    for backend in ("triton", "reference"):
        saved = os.environ.get("BLOOM_KERNELS")
        os.environ["BLOOM_KERNELS"] = backend
        try:
            for _ in range(3):
                with_gradients(optimizer.step)()
        finally:
            os.environ.pop("BLOOM_KERNELS") if saved is None else os.environ.update(BLOOM_KERNELS=saved)
        ends.append({k: v.clone() for k, v in buffers.items()})
        for k, v in buffers.items():
            v.copy_(start[k])
    out = {}
    for key in ("master", "exp_avg", "exp_avg_sq", "weights"):
        got, want = ends[0][key].float(), ends[1][key].float()
        ulp = torch.finfo(ends[1][key].dtype).eps * float(want.abs().max())
        out[key] = float((got - want).abs().max()) / ulp
    return out


def measure(model: str, steps: int, configs: list[tuple[int, int]]) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    named = parameters(model, device)
    optimizer = FlatAdamW(named, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM)
    generator = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator, device=device, dtype=torch.bfloat16) for _, p in named]
    params = [p for _, p in named]

    def with_gradients(step: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g  # as autograd leaves them (the same tensors every step: no allocation timed)
            step()

        return run

    count = optimizer.weights.numel()
    agreement = _kernels_against_twins(optimizer, with_gradients) if cuda else None  # the kernels need a GPU
    out: dict[str, Any] = {"model": model, "device": torch.cuda.get_device_name() if cuda else "CPU",
                           "parameters": sum(p.numel() for p in params), "flat_elements": count,
                           "kernels_against_twins": agreement}  # fmt: skip
    out["one_pass_ms"] = _time(with_gradients(optimizer.step), steps, cuda)
    if cuda and configs:
        from kernels import flat_adamw

        chosen = flat_adamw.launch_config
        try:
            for block, warps in configs:
                flat_adamw.launch_config = lambda capability, b=block, w=warps: (b, w)  # type: ignore[misc]
                out[f"one_pass_ms_{block}x{warps}"] = _time(with_gradients(optimizer.step), steps, cuda)
        finally:
            flat_adamw.launch_config = chosen  # type: ignore[misc]
    flat_grads = torch.empty(count, dtype=torch.bfloat16, device=device)
    fp32_grads = torch.empty(count, dtype=torch.float32, device=device)
    out["before_ms"] = _time(with_gradients(lambda: step_before_one_pass(optimizer, flat_grads, fp32_grads)),
                             steps, cuda)  # fmt: skip
    exp_avg, exp_avg_sq = optimizer._moments()

    def fused_adamw_alone() -> None:
        torch._fused_adamw_([optimizer.master], [fp32_grads], [exp_avg], [exp_avg_sq], [], [optimizer.step_count],
                            lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False,
                            maximize=False)  # fmt: skip

    out["fused_adamw_alone_ms"] = _time(fused_adamw_alone, steps, cuda)
    source, target = optimizer.master, fp32_grads
    copy_ms = _time(lambda: target.copy_(source), steps, cuda)
    out["copy_gb_per_s"] = 2 * 4 * count / copy_ms / 1e6  # read and written
    return out


def main() -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bloom-560m" if cuda else "bloom-micro-test")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    parser.add_argument("--configs", default="", help="also time the kernels at these BLOCKxWARPS, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]
    figures = measure(args.model, args.steps, configs)  # type: ignore[arg-type]
    figures["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(figures, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
