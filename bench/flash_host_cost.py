"""The host's cost of one flash attention call, the Triton launch itself left out: microseconds per call of the
launchers (flash_fwd, flash_bwd: tiles, arguments, outputs), of the custom ops bloom::flash_alibi_attention and
bloom::flash_alibi_attention_backward as a compiled block's graph calls them (torch.ops.bloom.*.default: torch's
dispatcher and custom-op layers, then the launcher), and of the eager autograd path
(flash_attention.flash_alibi_attention, forward + backward).

    .venv/bin/python -m bench.flash_host_cost [--calls N] [--repeats R] [--cuda] [--json PATH]

The tensors are CPU tensors laid out as bloom-560m trains (16 heads of 64, bf16, q, k and v strided views of the
fused QKV projection), 16 tokens long so that allocating an output costs about what the CUDA caching allocator's
does (a microsecond or two: from 128 KiB up, glibc maps fresh pages for every allocation, 13 us each here, which a
GPU run never pays); the host's work per call does not depend on the length otherwise. The launchers run inside
kernels.launch.recording as if on an H100: they pick their tiles, allocate their outputs and build every argument
as on a GPU, and `launch` keeps the launch instead of starting it. What a GPU adds on top: Triton's
JITFunction.run (binding and specialising the arguments, the cache lookup, the driver call). Meta tensors would
not do: their operators run Python meta functions, milliseconds a call. The figure is the best of R timings of N
calls, so other processes on the machine inflate it less. --cuda: the same calls on the GPU, the launches started
(run from bench/gpu_campaign.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds a tokenize.py that would shadow the standard library's (Triton reads kernel sources through
# inspect, which imports tokenize): keep bench/ off the import path and put the repository root on it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from kernels import flash_attention as fa  # noqa: E402
from kernels.launch import H100, recording  # noqa: E402
from kernels.reference import alibi_slopes  # noqa: E402

BATCH, HEADS, SEQ, HEAD_DIM = 2, 16, 16, 64  # bloom-560m at micro-batch 2, shorter (the module docstring)


def cases(documents: bool = False, device: str = "cpu") -> dict[str, Callable[[], object]]:
    """name -> one call, on tensors laid out as training lays them out."""
    qkv = torch.randn(BATCH, SEQ, HEADS, 3, HEAD_DIM, device=device).bfloat16()
    # leaves of their own, so that the backward's figure holds no copy of the gradients into the fused layout
    q, k, v = (qkv[..., i, :].transpose(1, 2).requires_grad_() for i in range(3))
    slopes = alibi_slopes(HEADS, torch.device(device))
    docs = torch.zeros(BATCH, SEQ, dtype=torch.long, device=device) if documents else None
    scale = HEAD_DIM**-0.5
    plain = [t.detach() for t in (q, k, v)]
    with contextlib.nullcontext() if device == "cuda" else recording(H100):  # on the CPU, the outputs' shapes
        o, lse = fa.flash_fwd(*plain, slopes, True, scale)
    do = torch.randn_like(o)

    def eager() -> object:
        out = fa.flash_alibi_attention(q, k, v, slopes, True, q_doc=docs, k_doc=docs)
        return torch.autograd.grad(out, (q, k, v), do)

    return {
        "launcher forward": lambda: fa.flash_fwd(*plain, slopes, True, scale, 0, docs, docs),
        "launcher backward": lambda: fa.flash_bwd(do, *plain, o, lse, slopes, True, scale, 0, docs, docs, None),
        "op forward": lambda: torch.ops.bloom.flash_alibi_attention.default(*plain, slopes, True, scale, 0, docs, docs),
        "op backward": lambda: torch.ops.bloom.flash_alibi_attention_backward.default(
            do, *plain, o, lse, slopes, True, scale, 0, docs, docs, None
        ),
        "eager forward + backward": eager,
    }


def host_us(call: Callable[[], object], calls: int, repeats: int, cuda: bool = False) -> float:
    """Best microseconds per call over `repeats` timings of `calls` calls: launches recorded as if on an H100, or
    with `cuda` started on the GPU (the figure then holds the whole launch; the kernels at 16 tokens take a few
    microseconds, so the GPU keeps up with the host and the time is the host's)."""
    best = float("inf")
    with contextlib.nullcontext([]) if cuda else recording(H100) as launches:
        for _ in range(300):  # warm-up: the dispatcher's and the launchers' first-call work, Triton's compiles
            call()
        for _ in range(repeats):
            launches.clear()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter_ns()
            for _ in range(calls):
                call()
            if cuda:
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter_ns() - start) / calls / 1e3)
    return best


def launches_per_call(call: Callable[[], object]) -> int:
    with recording(H100) as launches:
        call()
    return len(launches)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--cuda", action="store_true", help="on the GPU, the Triton launches included")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    device = "cuda" if args.cuda else "cpu"
    rows = {}
    for documents in (False, True):
        for name, call in cases(documents, device).items():
            label = name + (", documents" if documents else "")
            us = host_us(call, args.calls, args.repeats, cuda=args.cuda)
            rows[label] = {"us": us, "launches": launches_per_call(call)}
            print(f"{label:38} {us:7.1f} us  ({rows[label]['launches']} launches)", flush=True)
    if args.json:
        where = torch.cuda.get_device_name() if args.cuda else "CPU, launches recorded (not started)"
        data = {"device": where, "torch": torch.__version__, "rows": rows}
        args.json.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
