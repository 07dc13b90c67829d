"""Peak host memory and time of building the engine with its initial weights, per rank, for 1, 2 and 4 ranks.

    .venv/bin/python bench/init_memory.py                      # tp,pp = 1,1  1,2  2,1  2,2 (one launch each)
    .venv/bin/python bench/init_memory.py --layouts 2,2 --hidden 2048 --layers 16

Each rank is a fresh spawned gloo process (appliance.parallel.testing.run_distributed) with one CPU thread. It
first builds and drops a tiny engine at the same layout, so DeepSpeed's lazily imported modules and the process
groups of the pipeline grid exist before measuring; then it resets the kernel's peak-RSS mark (writing 5 to
/proc/self/clear_refs sets VmHWM back to the current RSS) and builds the measured model's engine (fp32, ZeRO 0:
no copy of the weights beside the module). The rise is VmHWM after the build minus RSS before it: everything the
build held at its peak, the rank's parameters included. Times are the build's wall clock and this process's CPU
time (ranks share the machine's cores, so wall time includes waiting for the others).

The per-rank function ``measure_init`` is also what tests/distributed/test_init_shards.py runs; the script uses
only ``build_test_engine`` (whose keywords stay as build_engine's signature changes) and ``model_shard``, so it
measures an older checkout that has them just as well (PYTHONPATH=that checkout).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this directory would come first on the import path, where bench/tokenize.py hides the
    # standard library's tokenize: put the repository root there instead (or PYTHONPATH's checkout, to measure
    # another one). The ranks are gloo processes on this CPU whatever the machine has.
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    if not os.environ.get("PYTHONPATH"):
        sys.path.insert(0, str(_HERE.parent))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse
import contextlib
import gc
import hashlib
import io
import re
import time
from typing import Any

import torch

from appliance.model.config import BloomConfig
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology

SEED = 1234
TINY = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)  # 256 = 128 x tp(2)


def measured_config(hidden: int = 1024, layers: int = 8, vocab: int = 1024) -> BloomConfig:
    """hidden 1024, 8 layers: 8 x (12 x 1024^2 + 13 x 1024) + 1024^2 + 4 x 1024 = 101.8 M parameters, 407 MB fp32."""
    return BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=16)


def _kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match[1])


def _engine(config: BloomConfig, topology: ParallelTopology) -> Any:
    from appliance.parallel.testing import build_test_engine

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's start-up prints
        # fp32, ZeRO 0, no recompute: no copy of the weights beside the module (build_test_engine's defaults)
        return build_test_engine(config, topology, micro_batch_size=1, global_batch_size=topology.dp, seed=SEED)


def digest(tensor: torch.Tensor) -> str:
    """The bytes of a tensor's values, hashed: equal digests mean bit-identical tensors of one dtype and shape."""
    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(str((t.dtype, tuple(t.shape))).encode() + t.view(torch.uint8).numpy().tobytes()).hexdigest()


def measure_init(topology: ParallelTopology, config: BloomConfig) -> dict[str, Any]:
    """On one rank: build the engine for ``config`` and report the rise of peak RSS, the times, this rank's
    parameter bytes and a digest of each of its tensors; also the tiny warm-up engine's tensors, whole."""
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed (one process per rank, all on this CPU)
    tiny = _engine(TINY, topology)
    tiny_shard = tiny.model_shard()
    del tiny
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    engine = _engine(config, topology)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _kib("VmHWM")
    named = engine.named_parameters()
    return {
        "coords": (engine.pp_rank, engine.dp_rank, engine.tp_rank),
        "rise_mb": (peak - before) / 1024,
        "param_mb": sum(p.numel() * p.element_size() for _, p in named) / 2**20,
        "wall_s": wall,
        "cpu_s": cpu,
        "digests": {name: digest(p) for name, p in named},
        "tiny": tiny_shard,
    }


def launch(config: BloomConfig, tp: int, pp: int, timeout_s: float = 600) -> list[dict[str, Any]]:
    return run_distributed(measure_init, tp * pp, config, tp=tp, pp=pp, timeout_s=timeout_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["1,1", "1,2", "2,1", "2,2"], help="tp,pp pairs")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    config = measured_config(args.hidden, args.layers, args.vocab)
    size = config.num_parameters()
    shape = f"hidden {config.hidden_size}, {config.n_layer} layers, vocab {config.vocab_size}"
    print(f"model: {shape}: {size / 1e6:.1f} M parameters, {4 * size / 2**20:.0f} MiB fp32")
    print("| tp,pp | ranks | params per rank (MiB) | peak RSS rise per rank (MiB) | build wall (s) | build CPU (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layout in args.layouts:
        tp, pp = (int(x) for x in layout.split(","))
        ranks = launch(config, tp, pp)
        cells = [
            "/".join(f"{r[key]:.{digits}f}" for r in ranks)
            for key, digits in (("param_mb", 0), ("rise_mb", 0), ("wall_s", 2), ("cpu_s", 2))
        ]
        print(f"| {tp},{pp} | {tp * pp} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
