"""The chunked cross entropy's torch twin on one CPU thread, as the planner charges it (calibration.py,
TORCH_CHUNKED_CE_BYTES_PER_LOGIT): nanoseconds per logit beyond its three GEMMs, at bloom-tiny-cpu's shape on one
rank (micro-batch 8 x 128 tokens, hidden 128, vocabulary 8192).

    .venv/bin/python bench/planner_cpu_loss.py [--repeats 7]

Prints the best of `repeats` timings (the least disturbed by other processes) and the bytes per logit that time
equals at the memory rate the planner gives one core of this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, this directory would come first on the import path, where bench/tokenize.py hides the standard
# library's tokenize: put the repository root there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import dataclasses  # noqa: E402  (after the path fix: it imports tokenize)

import torch  # noqa: E402

from appliance.hardware import detect  # noqa: E402
from appliance.planner.device import make_device  # noqa: E402
from kernels.chunked_ce import chunked_vocab_ce  # noqa: E402

TOKENS, HIDDEN, VOCAB = 1024, 128, 8192


def best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden, weight = torch.randn(TOKENS, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.02
    labels = torch.randint(0, VOCAB, (TOKENS,))

    def loss() -> object:
        return chunked_vocab_ce(
            hidden, weight, labels, chunk_size=None, ignore_index=-100, tp_group=None, want_grad=(True, True)
        )

    def gemms() -> object:  # the logits, the hidden gradient and the weight gradient, unchunked
        logits = hidden @ weight.t()
        return logits @ weight, logits.t() @ hidden

    elementwise = best(loss, args.repeats) - best(gemms, args.repeats)
    per_logit = elementwise / (TOKENS * VOCAB)
    hw = dataclasses.replace(detect(), gpus_per_node=0)  # the CPU side of this machine, GPUs or not
    core = make_device(hw, hw.cpu_cores)  # one rank per core: the rate the planner gives one core
    rate = core.memory_bw * core.efficiency.memory
    print(f"{per_logit * 1e9:.1f} ns per logit = {per_logit * rate:.0f} bytes at {rate / 1e9:.1f} GB/s per core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
