"""The training loop of one rank: steps, evaluation, checkpoints and stop requests.

Everything that differs between ranks (which samples, which files) is decided here from (dp_rank, dp_size);
everything that must agree (loss, grad norm, when to save or stop) goes through a collective, so all ranks take
the same branch at the same step.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from appliance.model.ops import cross_entropy
from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.control import ControlChannel
from appliance.train.metrics import StepFlops
from appliance.train.settings import TrainSettings
from appliance.train.state import rng_state, set_rng_state

MODEL_FILE = "model.safetensors"


class SampleSource(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> np.ndarray: ...


@dataclass
class Position:
    step: int = 0
    consumed_samples: int = 0


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def to_batch(source: SampleSource, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of seq_len + 1 tokens -> (inputs, next-token labels), each [micro_batch, seq_len]."""
    tokens = torch.from_numpy(np.stack([np.asarray(source[int(i)], dtype=np.int64) for i in indices]))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class Trainer:
    def __init__(
        self,
        *,
        engine: Any,
        settings: TrainSettings,
        train_data: SampleSource,
        valid_data: Mapping[str, SampleSource],
        micro_batches: Callable[[int], Iterator[list[int]]],
        run_dir: RunDir,
        rank: int,
        dp_rank: int,
        dp_size: int,
        world_size: int,
        events: EventWriter | None,
        flops: StepFlops,
        peak_flops_per_device: float | None,
        layout: dict[str, Any],
        versions: dict[str, str],
        device: torch.device,
    ) -> None:
        self.engine = engine
        self.s = settings
        self.train_data = train_data
        self.valid_data = valid_data
        self.micro_batches = micro_batches
        self.run_dir = run_dir
        self.rank, self.dp_rank, self.dp_size, self.world_size = rank, dp_rank, dp_size, world_size
        self.events = events
        self.flops = flops
        self.peak = peak_flops_per_device
        self.layout = layout
        self.versions = versions
        self.device = device
        self.pos = Position()
        self.control = ControlChannel(run_dir, poll_files=rank == 0)
        self.accumulation = settings.global_batch_size // (settings.micro_batch_size * dp_size)
        self.first_valid_loss: float | None = None
        self.last_eval: tuple[int, dict[str, float]] | None = None  # (step, losses) of the newest evaluation

    # ---- collectives -------------------------------------------------------------------------------------
    def _all_reduce(self, values: list[float], op: Any = None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator[list[int]]) -> dict[str, float]:
        # The lr for the samples this step consumes: at the end of them, so the first warmup step is not lr = 0.
        lr = self.s.lr_schedule.at(self.pos.consumed_samples + self.s.global_batch_size)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self.engine.train()
        loss_sum = 0.0
        own_norm: float | None = None
        for micro in range(self.accumulation):
            inputs, labels = to_batch(self.train_data, next(batches))
            logits = self.engine(inputs.to(self.device))
            loss = cross_entropy(logits, labels.to(self.device))
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps
            if micro == self.accumulation - 1:
                own_norm = self._grad_norm_before_clipping()
            self.engine.step()  # steps the optimizer only at the accumulation boundary
            loss_sum += loss.item()
        # Mean over micro-batches here, then over DP ranks: every rank reports the same global loss.
        (global_loss,) = self._all_reduce([loss_sum / self.accumulation / self.dp_size])
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = own_norm
        self.pos.step += 1
        self.pos.consumed_samples += self.s.global_batch_size
        return {"loss": global_loss, "lr": lr, "grad_norm": float(grad_norm) if grad_norm is not None else math.nan}

    def _grad_norm_before_clipping(self) -> float | None:
        """The global gradient norm before clipping, where DeepSpeed does not report it.

        DeepSpeed's ZeRO and bf16 optimizers record the norm they clip with; its plain fp32 path clips and
        discards it. On that path the gradients are already averaged over DP when the boundary backward returns,
        so every DP rank holds the full gradient and the local norm is the global one.
        """
        if self.engine.zero_optimization() or self.engine.bfloat16_enabled() or self.engine.fp16_enabled():
            return None
        squares = [p.grad.detach().float().pow(2).sum() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(squares).sum().sqrt()) if squares else 0.0

    # ---- evaluation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean next-token loss per validation set. Each DP rank takes every dp_size-th sample; sums are
        all-reduced, so the figure is the same as one process evaluating everything."""
        self.engine.eval()
        names = sorted(self.valid_data)
        sums = []
        for name in names:
            data = self.valid_data[name]
            count = min(len(data), self.s.eval_samples)
            mine = list(range(self.dp_rank, count, self.dp_size))
            # Every rank runs ceil(count / dp_size) samples: the short ones repeat sample 0 with its labels
            # ignored. The same number of forward passes everywhere, so collectives inside a forward (ZeRO-3
            # gathers, tensor/pipeline traffic) always pair up and an uneven split cannot hang the evaluation.
            padded = mine + [0] * (-(-count // self.dp_size) - len(mine))
            total = 0.0
            for i in range(0, len(padded), self.s.micro_batch_size):
                inputs, labels = to_batch(data, padded[i : i + self.s.micro_batch_size])
                labels = labels.clone()  # a one-sample batch's labels are a view of its inputs
                labels[max(0, len(mine) - i) :] = -100
                logits = self.engine(inputs.to(self.device))
                total += cross_entropy(logits, labels.to(self.device), reduction="sum").item()
            sums += [total, float(len(mine) * self.s.seq_len)]
        reduced = self._all_reduce(sums)
        losses = {n: reduced[2 * i] / max(reduced[2 * i + 1], 1.0) for i, n in enumerate(names)}
        total_tokens = sum(reduced[1::2])
        losses["all"] = sum(reduced[0::2]) / max(total_tokens, 1.0)
        self.engine.train()
        return losses

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save(self) -> Path:
        started = time.time()
        root = self.run_dir.checkpoints
        model_state = {k: v.detach().float().contiguous().cpu() for k, v in self.engine.module.state_dict().items()}
        ok = 1.0
        error = ""
        if self.rank == 0:
            try:
                needed = sum(t.numel() * 4 for t in model_state.values()) * 4  # weights + ~3x optimizer/rank files
                ckpt.check_free_space(root.parent, needed)
                ckpt.prepare_step_dir(root, self.pos.step)
            except (OSError, ckpt.CheckpointError) as e:
                ok, error = 0.0, str(e)
        (ok,) = self._all_reduce([ok], dist.ReduceOp.MIN)
        step_dir = root / ckpt.step_dir_name(self.pos.step)
        records: list[ckpt.FileRecord] = []
        if ok:
            try:
                if self.rank == 0:
                    # Tied weights share storage; safetensors refuses aliases, and the tie is restored on load.
                    model_state.pop("lm_head.weight", None)
                    save_file(model_state, str(step_dir / MODEL_FILE), metadata={"step": str(self.pos.step)})
                    records.append(ckpt.FileRecord.of(step_dir / MODEL_FILE))
                payload = {"optimizer": self.engine.optimizer.state_dict(), "rng": rng_state()}
                torch.save(payload, step_dir / rank_file(self.rank))
                records.append(ckpt.FileRecord.of(step_dir / rank_file(self.rank)))
            except OSError as e:  # ENOSPC, EIO...: every rank learns it below and nobody commits
                ok, error = 0.0, f"rank {self.rank}: {e}"
            (ok,) = self._all_reduce([ok], dist.ReduceOp.MIN)
        if not ok:
            raise ckpt.CheckpointError(f"checkpoint at step {self.pos.step} failed, previous one kept: {error}")
        gathered: list[list[ckpt.FileRecord]] = [[] for _ in range(self.world_size)]
        if dist.is_initialized():
            dist.all_gather_object(gathered, records)
        else:
            gathered = [records]
        if self.rank == 0:
            meta = {
                "consumed_samples": self.pos.consumed_samples,
                "layout": self.layout,
                "world_size": self.world_size,
                "versions": self.versions,
            }
            ckpt.commit(root, self.pos.step, [r for recs in gathered for r in recs], meta)
            ckpt.prune(root, self.s.keep_last)
        self._barrier()
        size = sum(r.bytes for recs in gathered for r in recs)
        self._emit("checkpoint", step=self.pos.step, path=str(step_dir), seconds=time.time() - started, bytes=size)
        return step_dir

    def load(self, step_dir: Path) -> None:
        manifest = json.loads((step_dir / ckpt.MANIFEST).read_text())
        state = load_file(str(step_dir / MODEL_FILE))
        missing, unexpected = self.engine.module.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise ckpt.CheckpointError(f"{step_dir}: missing {missing}, unexpected {unexpected}")
        same_layout = manifest.get("world_size") == self.world_size and manifest.get("layout") == self.layout
        if same_layout:
            payload = torch.load(step_dir / rank_file(self.rank), map_location="cpu", weights_only=True)
            self.engine.optimizer.load_state_dict(payload["optimizer"])
            set_rng_state(payload["rng"])
        else:
            self._emit("warning", message=f"layout changed since {step_dir.name}: weights loaded, optimizer reset")
        self.pos = Position(step=manifest["step"], consumed_samples=manifest["consumed_samples"])

    # ---- the loop ----------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train until train_samples; returns "done", or "preempted" after a stop request and a checkpoint."""
        total_steps = self.s.train_steps
        batches = self.micro_batches(self.pos.consumed_samples)
        last_save_time = time.time()
        tokens_per_step = self.s.global_batch_size * self.s.seq_len
        if self.pos.step == 0:
            self._record_eval(self.evaluate())
        while self.pos.step < total_steps:
            started = time.time()
            out = self.train_step(batches)
            seconds = time.time() - started
            per_device = seconds * self.world_size
            self._emit(
                "step",
                step=self.pos.step,
                loss=out["loss"],
                lr=out["lr"],
                grad_norm=out["grad_norm"],
                tokens_per_s=tokens_per_step / seconds,
                samples_per_s=self.s.global_batch_size / seconds,
                step_time_s=seconds,
                tflops_per_gpu=self.flops.hardware / per_device / 1e12,
                model_tflops_per_gpu=self.flops.model / per_device / 1e12,
                mfu=self.flops.model / per_device / self.peak if self.peak else None,
                consumed_samples=self.pos.consumed_samples,
                total_steps=total_steps,
            )
            if not math.isfinite(out["loss"]):
                raise FloatingPointError(f"loss is {out['loss']} at step {self.pos.step}")
            if self.pos.step % self.s.eval_interval == 0 or self.pos.step == total_steps:
                self._record_eval(self.evaluate())
            requests = self.control.poll()
            # Every rank computes the same decision from the all-reduced inputs: wall time is agreed on too.
            (elapsed,) = self._all_reduce([time.time() - last_save_time], dist.ReduceOp.MAX)
            due = self.pos.step % self.s.save_interval == 0 or elapsed >= self.s.save_interval_minutes * 60
            if requests.save or requests.stop or due or self.pos.step == total_steps:
                self.save()
                last_save_time = time.time()
            if requests.stop and self.pos.step < total_steps:
                reason = self.control.signal_name or "save-and-exit requested"
                self._emit("run", state="preempted", step=self.pos.step, reason=reason)
                if self.rank == 0:
                    self.run_dir.preempted_marker.write_text(f"{self.pos.step}\n")
                return "preempted"
        return "done"

    def evaluation_at_current_step(self) -> dict[str, float]:
        """The newest evaluation if it was taken at this step (the last training step evaluates), else a new one."""
        if self.last_eval is not None and self.last_eval[0] == self.pos.step:
            return self.last_eval[1]
        return self.evaluate()

    def _record_eval(self, losses: dict[str, float]) -> None:
        self.last_eval = (self.pos.step, losses)
        if self.first_valid_loss is None:
            self.first_valid_loss = losses["all"]
        self._emit(
            "eval",
            step=self.pos.step,
            consumed_samples=self.pos.consumed_samples,
            valid_loss=losses["all"],
            valid_ppl=math.exp(min(losses["all"], 50.0)),
            per_source={k: v for k, v in losses.items() if k != "all"},
        )
