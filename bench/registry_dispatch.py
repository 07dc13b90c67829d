"""What a kernel-registry call costs above the implementation it runs: ns per registry.layer_norm call with the
implementation replaced by a no-op, on CPU tensors, for BLOOM_KERNELS=reference and =triton (Triton's interpreter,
the path CUDA tensors take minus the launch itself).

    .venv/bin/python -m bench.registry_dispatch [--calls N] [--repeats R] [--repo CHECKOUT]

Each backend runs in a fresh subprocess (the registry binds its implementations when it builds its table); the
figure is the best of R timings of N calls, so other processes on the machine inflate it less.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import os, sys, time
os.environ["TRITON_INTERPRET"] = "1"
os.environ["BLOOM_KERNELS"] = sys.argv[1]
calls, repeats = int(sys.argv[2]), int(sys.argv[3])
import torch
from kernels import layer_norm, reference

def noop(x, w, b, eps=1e-5):
    return x

reference.layer_norm = noop  # before the registry binds its implementations
layer_norm.layer_norm = noop
from kernels import registry

x, w, b = torch.randn(2, 8), torch.ones(8), torch.zeros(8)
for _ in range(2000):
    registry.layer_norm(x, w, b, 1e-5)
best = float("inf")
for _ in range(repeats):
    start = time.perf_counter_ns()
    for _ in range(calls):
        registry.layer_norm(x, w, b, 1e-5)
    best = min(best, (time.perf_counter_ns() - start) / calls)
print(f"{best:.0f}")
"""


def dispatch_ns(backend: str, calls: int, repeats: int, repo: Path = ROOT) -> float:
    """Best ns per registry.layer_norm call for BLOOM_KERNELS=backend, measured in a fresh process on `repo`."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, backend, str(calls), str(repeats)],
        capture_output=True, text=True, check=True, cwd=repo, env={"PYTHONPATH": str(repo), "PATH": ""},
    )  # fmt: skip
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose registry to measure")
    args = parser.parse_args(argv)
    for backend in ("reference", "triton"):
        ns = dispatch_ns(backend, args.calls, args.repeats, args.repo.resolve())
        print(f"{args.repo}: BLOOM_KERNELS={backend}: {ns:.0f} ns per call")


if __name__ == "__main__":
    main()
