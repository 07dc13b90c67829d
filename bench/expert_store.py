"""Step time of an MoE stack with its experts in the tiered store, all resident against budgets that force evictions
(to host memory only; to host and disk), and the overhead ratio; plus the same model without a store.

    .venv/bin/python bench/expert_store.py                    # hidden 256, 4 MoE layers x 8 experts, 5 steps
    .venv/bin/python bench/expert_store.py --hidden 512 --steps 3

The model is the stand-in MoE stack (appliance/parallel/experts/store_stand_in.py: DeepSpeed's Experts of BLOOM
MLPs, fixed routing), one micro-batch of --tokens tokens a step, forward + backward + AdamW. An expert of hidden h
has 8 h^2 + 5 h parameters; with its gradient and AdamW's two moments, 4 x 4 bytes each (fp32). The budgets:
device = 2 layers' experts (the forward and backward each hold one layer and prefetch the next), host = all the
rest ("host") or 4 experts with the rest on disk ("host+disk", a temporary directory). On a CPU-only machine
"device" and "host" are both RAM: the host tier's cost is a memcpy per move, the disk tier's a safetensors write
and read through the page cache (the files stay hot in RAM here), so these figures are the store's own overhead
(bookkeeping, copies, serialisation), not a PCIe or NVMe transfer. One thread (the figures then do not depend on
what else the machine runs); the median of --steps steps after one warm-up step, the setups
taking turns step by step.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/tokenize.py hides the stdlib's
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from appliance.parallel.experts.store import ExpertStore, expert_tier_event  # noqa: E402
from appliance.parallel.experts.store_hooks import attach_expert_store  # noqa: E402
from appliance.parallel.experts.store_stand_in import MoeStack, dense_parameters  # noqa: E402


class Setup:
    """One way of holding the experts, with its model, optimizers and the step times measured so far."""

    def __init__(self, args: argparse.Namespace, name: str, disk: Path) -> None:
        self.name, self.times = name, []
        self.model = model = MoeStack(args.hidden, args.experts, args.layers)
        self.store: ExpertStore | None = None
        if name == "no store":
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            return
        expert_bytes = 16 * sum(p.numel() for p in model.expert_layers()[0][0].parameters())
        self.store = ExpertStore(
            model.expert_layers(),
            device="cpu",
            device_budget_bytes=None if name == "all resident" else 2 * args.experts * expert_bytes,
            host_budget_bytes=4 * expert_bytes if name == "host+disk" else None,
            disk_dir=disk / name if name == "host+disk" else None,
        )
        attach_expert_store(self.store, model.expert_containers())
        self.optimizer = torch.optim.AdamW(dense_parameters(model), lr=1e-4, foreach=False)
        self.before: dict[str, Any] = {}

    def step(self, x: torch.Tensor, measured: bool) -> None:
        start = time.perf_counter()
        self.model(x).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.store is not None:
            self.store.step(lr=1e-4)
        if measured:
            self.times.append(time.perf_counter() - start)
        elif self.store is not None:  # after the warm-up: the counters of the measured steps start here
            self.before = expert_tier_event(self.store.counters())

    def result(self, steps: int) -> dict[str, Any]:
        out: dict[str, Any] = {"setup": self.name, "step_s": statistics.median(self.times)}
        if self.store is not None:
            after = expert_tier_event(self.store.counters(), self.store.placement())
            out.update({k: (after[k] - self.before[k]) / steps for k in ("hits", "fetches", "bytes_in", "bytes_out")})
            out["placement"] = after["placement"]
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per step (a multiple of --experts)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = 8 * args.hidden**2 + 5 * args.hidden
    print(
        f"{args.layers} MoE layers x {args.experts} experts, hidden {args.hidden}: {params:,} parameters and "
        f"{16 * params / 1e6:.1f} MB (weights, grads, 2 AdamW moments) per expert; {args.tokens} tokens a step"
    )
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as disk:
        setups = [Setup(args, name, Path(disk)) for name in ("no store", "all resident", "host", "host+disk")]
        for step in range(args.steps + 1):
            for setup in setups:  # one step of each in turn: a load change on the machine hits them all alike
                setup.step(x, measured=step > 0)
        rows = [setup.result(args.steps) for setup in setups]
    resident = rows[1]["step_s"]
    header = f"{'setup':<13} {'step s':>8} {'x resident':>10} {'hits':>6} {'fetches':>8} {'MB in':>8} {'MB out':>8}"
    print(f"{header}  experts")
    for r in rows:
        moves = ""
        if "hits" in r:
            where = ", ".join(f"{n} {t}" for t, n in r["placement"].items())
            mb_in, mb_out = r["bytes_in"] / 1e6, r["bytes_out"] / 1e6
            moves = f"{r['hits']:6.1f} {r['fetches']:8.1f} {mb_in:8.1f} {mb_out:8.1f}  {where}"
        print(f"{r['setup']:<13} {r['step_s']:8.3f} {r['step_s'] / resident:10.2f} {moves}")
    print("(hits, fetches, MB per step, onto and off the device)")


if __name__ == "__main__":
    main()
