"""Fused kernels against torch eager, torch.compile, FlexAttention (and flash-attn), measured in one run on one GPU.

    .venv/bin/python bench/kernels.py [--iters 50] [--warmup 10] [--out bench/results] [--only flash_attention ...]
    .venv/bin/python bench/kernels.py --allow-cpu     (no GPU: tiny shapes through Triton's interpreter, a smoke check)

For every kernel, first the correctness check against the fp32 torch twin (kernels/reference.py); a kernel that
fails it is not timed and the exit code is 1. Then, per pass (forward, forward+backward): the median of --iters
CUDA-event timings after --warmup calls; the achieved bandwidth (memory-bound kernels) or TFLOP/s (attention,
the LM head) and its share of a ceiling measured in this same run (a device-to-device copy; a large bf16
matmul); the speedup over each peer (peer time / ours). Shapes are BLOOM-176B's per-GPU shapes at tp=4,
micro-batch 2, sequence 2048. Results go to <out>/<date>-<device>-kernels.json, one record per kernel and pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file shares its name with the `kernels` package: drop its directory from the import path and put the
# repository root there, so `import kernels` finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

Thunk = Callable[[], Any]


@dataclass
class Case:
    """One kernel pass: our thunk, the peers' thunks (None: not available, with the reason), the work it does."""

    kernel: str
    passes: str  # "fwd" or "fwd+bwd"
    shape: str
    ours: Thunk
    peers: dict[str, Thunk | str]
    work: float  # bytes moved or floating-point operations per call
    unit: str  # "GB/s" or "TFLOP/s"
    notes: dict[str, Any] = field(default_factory=dict)


class Timer:
    def __init__(self, cuda: bool, warmup: int, iters: int) -> None:
        self.cuda, self.warmup, self.iters = cuda, warmup, iters

    def __call__(self, fn: Thunk) -> float:
        """Median milliseconds per call."""
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)


def ceilings(timer: Timer, device: torch.device, small: bool) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write counted) and bf16 matmul rate (TFLOP/s), measured now."""
    n = (1 << 20) if small else (1 << 28)  # 1 GiB of fp32 on a GPU: far past L2
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    copy_ms = timer(lambda: dst.copy_(src))
    m = 256 if small else 8192
    a, b = (torch.randn(m, m, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm_ms = timer(lambda: a @ b)
    return {"copy_gbps": 2 * src.nbytes / copy_ms / 1e6, "bf16_matmul_tflops": 2 * m**3 / mm_ms / 1e9}


def forward_only(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> Thunk:
    """Inference forward: no graph is kept (and our LM-head loss skips its gradient work)."""

    def call() -> torch.Tensor:
        with torch.no_grad():
            return fn(*inputs)

    return call


def with_backward(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> Thunk:
    """Forward then backward of fn(*inputs) with a fixed random output gradient (no .grad accumulation)."""
    out = fn(*inputs)
    grad_out = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    wrt = [t for t in inputs if t.requires_grad]
    return lambda: torch.autograd.grad(fn(*inputs), wrt, grad_out)


def outputs_and_grads(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = fn(*inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_out)
    return [out, *grads]


def check(
    ours: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], inputs: list[torch.Tensor]
) -> float:
    """Largest max|ours - fp32| / max|fp32| over the output and every input gradient; ours runs on the real
    (bf16) inputs, the fp32 twin on fp32 copies of them."""
    upcast = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    errors = [
        ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        for a, b in zip(outputs_and_grads(ours, inputs), outputs_and_grads(reference, upcast), strict=True)
    ]
    return max(errors)


class Bench:
    """Builds the cases of each kernel; shapes are BLOOM-176B's per GPU at tp=4 (tiny ones for --allow-cpu)."""

    def __init__(self, device: torch.device) -> None:
        from kernels import reference, registry

        self.reference, self.registry = reference, registry
        self.device, self.cuda = device, device.type == "cuda"
        # micro-batch 2 x seq 2048 tokens, hidden 14336, 112 / 4 = 28 heads of 128, MLP 4 * 14336 / 4 = 14336
        # columns per rank, vocab 250880 / 4 = 62720 rows per rank
        small = not self.cuda
        self.tokens, self.hidden, self.heads, self.seq, self.vocab = (
            (9, 40, 2, 17, 50) if small else (4096, 14336, 28, 2048, 62720)
        )
        self.batch = 1 if small else self.tokens // self.seq
        self.gen = torch.Generator().manual_seed(0)

    def rand(self, *shape: int, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
        t = (scale * torch.randn(*shape, generator=self.gen)).to(self.device, torch.bfloat16)
        return t.requires_grad_(grad)

    def compiled(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | str:
        return torch.compile(fn) if self.cuda else "skipped: torch.compile is measured on GPU only"

    def cases(self, kernel: str, shape: str, ours: Callable[..., torch.Tensor], peers: dict[str, Any],
              inputs: list[torch.Tensor], fwd_work: float, bwd_work: float, unit: str) -> list[Case]:  # fmt: skip
        """A forward case and a forward+backward case; `peers` values are callables or why they are absent."""
        made = []
        for passes, work in (("fwd", fwd_work), ("fwd+bwd", fwd_work + bwd_work)):
            wrap = forward_only if passes == "fwd" else with_backward
            wrapped = {name: (wrap(fn, inputs) if callable(fn) else fn) for name, fn in peers.items()}
            made.append(Case(kernel, passes, shape, wrap(ours, inputs), wrapped, work, unit))
        return made

    def layer_norm(self) -> tuple[float, list[Case]]:
        import torch.nn.functional as F

        n = self.hidden
        x, w, b = self.rand(self.tokens, n), self.rand(n, scale=0.1), self.rand(n, scale=0.1)
        error = check(self.registry.layer_norm, self.reference.layer_norm, [x, w, b])

        def torch_ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x, (n,), w, b)

        apex = self.registry.nvidia_apex_layer_norm()
        peers: dict[str, Any] = {"torch_eager": torch_ln, "torch_compile": self.compiled(torch_ln)}
        peers["apex"] = (lambda x, w, b: apex(x, w, b, (n,), 1e-5)) if apex and self.cuda else "not installed"
        # forward reads x and writes y; backward reads x and dy and writes dx (weights are negligible)
        return error, self.cases("layer_norm", f"[{self.tokens}, {n}]", self.registry.layer_norm, peers,
                                 [x, w, b], 2 * x.nbytes, 3 * x.nbytes, "GB/s")  # fmt: skip

    def bias_gelu(self) -> tuple[float, list[Case]]:
        import torch.nn.functional as F

        x, b = self.rand(self.tokens, self.hidden, scale=2.0), self.rand(self.hidden, scale=0.1)
        error = check(self.registry.bias_gelu, self.reference.bias_gelu, [x, b])

        def torch_bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.gelu(x + b, approximate="tanh")

        peers = {"torch_eager": torch_bias_gelu, "torch_compile": self.compiled(torch_bias_gelu)}
        return error, self.cases("bias_gelu", f"[{self.tokens}, {self.hidden}]", self.registry.bias_gelu, peers,
                                 [x, b], 2 * x.nbytes, 3 * x.nbytes, "GB/s")  # fmt: skip

    def alibi_softmax(self) -> tuple[float, list[Case]]:
        b, h, s = self.batch, self.heads, self.seq
        slopes = self.reference.alibi_slopes(h, self.device)
        scores = self.rand(b, h, s, s, scale=3.0)
        mask = torch.ones(b, s, dtype=torch.long, device=self.device)
        mask[0, : s // 8] = 0  # some left padding

        def ours(x: torch.Tensor) -> torch.Tensor:
            return self.registry.alibi_softmax(x, slopes, mask, 0.125)

        def plain(x: torch.Tensor) -> torch.Tensor:  # the same math in torch ops (fp32 inside)
            return self.reference.alibi_softmax(x, slopes, mask, 0.125)

        error = check(ours, plain, [scores])
        peers = {"torch_eager": plain, "torch_compile": self.compiled(plain)}
        return error, self.cases("alibi_softmax", f"[{b}, {h}, {s}, {s}]", ours, peers, [scores],
                                 2 * scores.nbytes, 3 * scores.nbytes, "GB/s")  # fmt: skip

    def flash_attention(self, d: int) -> tuple[float, list[Case]]:
        b, s = self.batch, self.seq
        h = self.heads * 128 // d if self.cuda else self.heads  # same hidden size for both head dims
        slopes = self.reference.alibi_slopes(h, self.device)
        q, k, v = (self.rand(b, h, s, d) for _ in range(3))

        def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.registry.flash_alibi_attention(q, k, v, slopes)

        def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.reference.flash_alibi_attention(q, k, v, slopes)

        # the fp32 twin materializes the scores: check one sequence of an odd length (a ragged last block)
        error = check(ours, plain, [t[:1, :, : min(s, 1025)].detach().requires_grad_() for t in (q, k, v)])
        # causal FLOPs: 4 * b * h * s^2 * d / 2 forward, 2.5x that backward (FlashAttention-2's convention)
        fwd = 4 * b * h * s * s * d / 2
        return error, self.cases(f"flash_attention_d{d}", f"[{b}, {h}, {s}, {d}]", ours,
                                 self.attention_peers(slopes), [q, k, v], fwd, 2.5 * fwd, "TFLOP/s")  # fmt: skip

    def attention_peers(self, slopes: torch.Tensor) -> dict[str, Any]:
        """SDPA with an additive ALiBi+causal bias (eager, compiled), FlexAttention with an ALiBi score_mod,
        flash-attn's alibi_slopes when installed."""
        import torch.nn.functional as F

        pos = torch.arange(self.seq, device=self.device)
        rel = (pos[None, :] - pos[:, None]).float()  # j - i
        bias = (slopes.view(-1, 1, 1) * rel).masked_fill(rel > 0, float("-inf")).to(torch.bfloat16)[None]

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

        peers: dict[str, Any] = {"torch_eager_sdpa": sdpa, "torch_compile_sdpa": self.compiled(sdpa)}
        if not self.cuda:
            return peers | {"flex_attention": "skipped: GPU only", "flash_attn": "skipped: GPU only"}
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def alibi(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
            return score + slopes[h] * (kv_idx - q_idx)

        causal = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, self.seq, self.seq)
        flex = torch.compile(flex_attention)
        peers["flex_attention"] = lambda q, k, v: flex(q, k, v, score_mod=alibi, block_mask=causal)
        try:
            from flash_attn import flash_attn_func  # [b, s, h, d]; causal ALiBi -slope * (i - j), as ours
        except ImportError:
            peers["flash_attn"] = "not installed"
        else:
            peers["flash_attn"] = lambda q, k, v: flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, alibi_slopes=slopes
            ).transpose(1, 2)
        return peers

    def vocab_cross_entropy(self) -> tuple[float, list[Case]]:
        import torch.nn.functional as F

        n, hd, v = self.tokens, self.hidden, self.vocab
        hidden, weight = self.rand(n, hd), self.rand(v, hd, scale=0.02)
        labels = torch.randint(0, v, (n,), generator=self.gen).to(self.device)

        def ours(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.registry.vocab_cross_entropy(h, w, y)

        def plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # full fp32 logits
            return F.cross_entropy((h @ w.t()).float(), y)

        part = min(n, 512)
        error = check(ours, plain, [hidden[:part].detach().requires_grad_(), weight, labels[:part]])
        mm = 2 * n * hd * v  # the logits matmul; the two gradient matmuls cost as much again each
        peers = {"torch_eager": plain, "torch_compile": self.compiled(plain)}
        return error, self.cases("vocab_cross_entropy", f"[{n}, {hd}] x [{v}, {hd}]", ours, peers,
                                 [hidden, weight, labels], mm, 2 * mm, "TFLOP/s")  # fmt: skip

    def builders(self) -> dict[str, Callable[[], tuple[float, list[Case]]]]:
        return {
            "layer_norm": self.layer_norm,
            "bias_gelu": self.bias_gelu,
            "alibi_softmax": self.alibi_softmax,
            "flash_attention_d64": lambda: self.flash_attention(64),
            "flash_attention_d128": lambda: self.flash_attention(128),
            "vocab_cross_entropy": self.vocab_cross_entropy,
        }


def run(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(cuda, args.warmup, args.iters)
    ceiling = ceilings(timer, device, small=not cuda)
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu-interpreter"
    print(
        f"{device_name}: copy {ceiling['copy_gbps']:.0f} GB/s, bf16 matmul {ceiling['bf16_matmul_tflops']:.1f} TFLOP/s"
    )
    tolerance = 2e-2  # bf16: output and gradients within 2% of the largest fp32 value
    records: list[dict[str, Any]] = []
    failed = False
    for kernel, build in Bench(device).builders().items():
        if args.only and not any(kernel.startswith(prefix) for prefix in args.only):
            continue
        error, cases = build()  # correctness first, then timing
        for case in cases:
            record: dict[str, Any] = {"kernel": kernel, "pass": case.passes, "shape": case.shape, "dtype": "bf16",
                                      "max_rel_error": error, "correct": error <= tolerance}  # fmt: skip
            records.append(record)
            if not record["correct"]:
                failed = True
                print(f"{kernel:22s} {case.passes:8s} FAILED correctness: relative error {error:.2e} > {tolerance}")
                continue
            record.update(measure(case, timer, ceiling))
            ratios = "  ".join(f"{name} x{value:.2f}" for name, value in record["speedup"].items())
            print(f"{kernel:22s} {case.passes:8s} {record['ms']:9.3f} ms {record['achieved']:8.1f} {case.unit:7s} "
                  f"{record['pct_of_ceiling']:5.1f}% of ceiling  {ratios}")  # fmt: skip
        if cuda:
            torch.cuda.empty_cache()
    write_results(args.out, device_name, ceiling, records)
    return 1 if failed else 0


def measure(case: Case, timer: Timer, ceiling: dict[str, float]) -> dict[str, Any]:
    ms = timer(case.ours)
    achieved = case.work / ms / (1e6 if case.unit == "GB/s" else 1e9)  # bytes/ms -> GB/s, FLOP/ms -> TFLOP/s
    peak = ceiling["copy_gbps"] if case.unit == "GB/s" else ceiling["bf16_matmul_tflops"]
    result: dict[str, Any] = {"ms": ms, "unit": case.unit, "achieved": achieved, "ceiling": peak,
                              "pct_of_ceiling": 100 * achieved / peak}  # fmt: skip
    speedup = {}
    for name, peer in case.peers.items():
        if isinstance(peer, str):  # why this peer was not measured
            result[f"{name}_ms"] = peer
            continue
        result[f"{name}_ms"] = timer(peer)
        speedup[name] = result[f"{name}_ms"] / ms  # > 1: ours is faster
    result["speedup"] = speedup
    if "apex" in speedup:
        result["apex_faster"] = speedup["apex"] < 1.0  # the reason to call registry.use_apex_layer_norm(True)
    return result


def write_results(out: Path, device_name: str, ceiling: dict[str, float], records: list[dict[str, Any]]) -> Path:
    today = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{today}-{slug}-kernels.json"
    payload = {"device": device_name, "date": today, "torch": torch.__version__, "ceilings": ceiling,
               "records": records}  # fmt: skip
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before each measurement")
    parser.add_argument("--out", type=Path, default=_HERE / "results", help="directory for the JSON results")
    parser.add_argument("--only", nargs="*", default=[], help="kernel name prefixes to run (default: all)")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, smoke-run tiny shapes on CPU")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.allow_cpu:
            message = (
                "bench/kernels.py needs a CUDA GPU to measure the kernels; none is visible. "
                "Use --allow-cpu for a smoke run of tiny shapes through Triton's CPU interpreter."
            )
            print(message, file=sys.stderr)
            return 1
        # Before any kernel module is imported: @triton.jit reads TRITON_INTERPRET when it decorates.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["BLOOM_KERNELS"] = "triton"
        args.iters, args.warmup = 1, 0  # a smoke check of the code paths, not a measurement
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
