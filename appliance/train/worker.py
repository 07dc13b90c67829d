"""Entry point of one training rank, started by PyTorch's elastic agent (torch.distributed.run):

    python -m torch.distributed.run --nproc-per-node N ... -m appliance.train.worker --run-dir D

It reads plan.json, builds the model, the DeepSpeed engine and the data, resumes from the newest valid
checkpoint when there is one (so an agent restart after a failure continues the run), trains, and evaluates.
It exits 0 when done and also after a stop request (with control/preempted written), because any non-zero exit
makes the agent restart the workers; the head process turns the marker into the documented "preempted" code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.settings import TrainSettings
from appliance.train.state import seed_everything


def _versions() -> dict[str, str]:
    import deepspeed

    from appliance import __version__

    return {"appliance": __version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__}


def _device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _start_sampler(run_dir: RunDir, events: EventWriter | None) -> Any:
    """GPU and energy sampling, by one process per node (local rank 0): utilization, memory, temperature,
    power, and energy from NVML's counter or RAPL (or a stated estimate on machines that expose neither)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    import socket

    from appliance.monitor.energy import EnergyMeter
    from appliance.monitor.gpu import GpuSampler

    writer = events or EventWriter(run_dir.metrics)
    return GpuSampler(writer, node=socket.gethostname(), energy=EnergyMeter()).start()


def build_model(plan: dict[str, Any], vocab_size: int, seed: int) -> torch.nn.Module:
    from appliance.model.bloom import BloomForCausalLM
    from appliance.model.config import BloomConfig

    shape = plan["model"]
    config = BloomConfig(
        vocab_size=vocab_size, hidden_size=shape["hidden"], n_layer=shape["layers"], n_head=shape["heads"]
    )
    generator = torch.Generator().manual_seed(seed)
    model = BloomForCausalLM(config, checkpoint_blocks=plan["layout"].get("recompute") == "full")
    model.init_weights(generator=generator)
    return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's split: no weight decay on biases and LayerNorm weights (1-D tensors)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def tokenizer_vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="appliance.train.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--eval-only", action="store_true", help="evaluate the newest checkpoint, do not train")
    args = parser.parse_args(argv)
    run_dir = RunDir(args.run_dir)
    plan = json.loads(run_dir.plan.read_text())
    settings = TrainSettings.from_plan(plan)
    layout = plan["layout"]

    import deepspeed

    from appliance.data.blend import build_datasets
    from appliance.data.sampler import PretrainingSampler
    from appliance.parallel.deepspeed_config import deepspeed_config
    from appliance.train.metrics import peak_flops_per_device, step_flops
    from appliance.train.trainer import Trainer

    device = _device()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if layout["tp"] * layout["pp"] * layout["dp"] != world_size:
        raise SystemExit(f"tp({layout['tp']}) * pp({layout['pp']}) * dp({layout['dp']}) != world size({world_size})")
    dp_rank, dp_size = rank, world_size  # data parallel only in this engine; TP/PP add their own groups

    events = EventWriter(run_dir.metrics) if rank == 0 else None
    sampler = _start_sampler(run_dir, events)
    seed_everything(settings.seed)
    vocab_size = tokenizer_vocab_size(run_dir.tokenizer_json)
    model = build_model(plan, vocab_size, settings.seed)
    optimizer = torch.optim.AdamW(
        param_groups(model, settings.weight_decay),
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
    )
    config = deepspeed_config(
        global_batch_size=settings.global_batch_size,
        micro_batch_size=settings.micro_batch_size,
        dp=dp_size,
        zero_stage=layout.get("zero_stage", 0),
        dtype=settings.dtype,
        grad_clip=settings.grad_clip,
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    train_data, valid_data = build_datasets(
        run_dir.data,
        seq_len=settings.seq_len,
        train_samples=settings.train_samples,
        valid_samples_per_lang=settings.eval_samples,
        seed=settings.seed,
        cache_dir=run_dir.data / "index-cache",
    )

    def micro_batches(consumed: int) -> Any:
        return iter(
            PretrainingSampler(
                total_samples=len(train_data),
                consumed_samples=consumed,
                micro_batch_size=settings.micro_batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
            )
        )

    trainer = Trainer(
        engine=engine,
        settings=settings,
        train_data=train_data,
        valid_data=valid_data,
        micro_batches=micro_batches,
        run_dir=run_dir,
        rank=rank,
        dp_rank=dp_rank,
        dp_size=dp_size,
        world_size=world_size,
        events=events,
        flops=step_flops(plan),
        peak_flops_per_device=peak_flops_per_device(plan),
        layout=layout,
        versions=_versions(),
        device=device,
    )

    def warn(message: str) -> None:
        if events is not None:
            events.emit("warning", message=message)

    resume_from = ckpt.find_latest(run_dir.checkpoints, warn=warn)
    if resume_from is not None:
        trainer.load(resume_from)
        if events is not None:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            events.emit(
                "recovery",
                restart=restart,
                resumed_step=trainer.pos.step,
                lost_seconds=0.0,
                checkpoint=str(resume_from),
            )
    if args.eval_only and resume_from is None:
        raise SystemExit(f"{run_dir.checkpoints}: no complete checkpoint to evaluate")
    outcome = "done" if args.eval_only else trainer.fit()
    if outcome == "done":
        from appliance.eval.final import write_final_eval

        write_final_eval(trainer, run_dir, vocab_size=vocab_size, is_writer=rank == 0)
    dist.barrier()
    if sampler is not None:
        sampler.stop()  # takes a last sample, so the energy total covers the whole run
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
