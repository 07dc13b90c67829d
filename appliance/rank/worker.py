"""Entry point of one training rank, started by PyTorch's elastic agent (torch.distributed.run, through
appliance/train/agent.py):

    python -m appliance.train.agent --nproc-per-node N ... -m appliance.rank.worker --run-dir D

It reads plan.json, builds the model, the DeepSpeed engine and the data, resumes from the newest valid
checkpoint when there is one (so an agent restart after a failure continues the run), trains, and evaluates.
It exits 0 when done and also after a stop request (with control/preempted written), because any non-zero exit
makes the agent restart the workers; the head process turns the marker into the documented "preempted" code.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from appliance.errors import BadInput
from appliance.monitor.events import EventWriter
from appliance.monitor.sinks import writer_with_sinks
from appliance.parallel.tensor.drift import ReplicaDriftError
from appliance.planner.runspec import RunSpec, load_spec
from appliance.process_exit import exit_without_teardown
from appliance.rundir import RunDir
from appliance.tokenizer.vocab import tokenizer_vocab_size
from appliance.train import checkpoint as ckpt
from appliance.train import elastic, node_record, runlock
from appliance.train.compile_cache import fill_compile_cache_env
from appliance.train.restart_budget import Budget
from appliance.train.settings import TrainSettings
from appliance.train.startup import StartupClock
from appliance.train.state import seed_everything
from appliance.train.trainer_checkpoints import UnrecoverableError

# Failures a restart would repeat: the run stops instead (see RunDir.failed_marker).
UNRECOVERABLE = (UnrecoverableError, ckpt.CheckpointError, ReplicaDriftError)


def _versions() -> dict[str, str]:
    import deepspeed

    from appliance import __version__

    return {"appliance": __version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__}


def _device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    from appliance.train.cpu_memory import keep_freed_memory

    keep_freed_memory()  # the step's large temporaries stay in the heap: no page faults every step
    return torch.device("cpu")


def _start_sampler(run_dir: RunDir, events: EventWriter | None, spec: RunSpec) -> Any:
    """GPU and energy sampling, by one process per node (local rank 0): utilization, memory, temperature,
    power, and energy from NVML's counter or RAPL (or a stated estimate on machines that expose neither)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    import socket

    from appliance.monitor.energy import EnergyMeter, previous_totals
    from appliance.monitor.gpu import GpuSampler

    writer = events or writer_with_sinks(run_dir.metrics)
    # Multi-node launches name each node (BLOOM_NODE_NAME, set by appliance/train/launch.py): simulated nodes share
    # a host, and each node's energy total must carry on from its own.
    node = os.environ.get("BLOOM_NODE_NAME") or socket.gethostname()
    # The meters use the carbon profile the plan estimated with. A restarted or resumed run carries on from this
    # node's last total, so the totals cover the whole run.
    meter = EnergyMeter(profile=spec.run.carbon, before=previous_totals(run_dir.metrics, node))
    return GpuSampler(writer, node=node, energy=meter).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="appliance.rank.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--eval-only", action="store_true", help="evaluate the newest checkpoint, do not train")
    parser.add_argument("--stop-at-step", type=int, default=None, help="save at this step and stop as if preempted")
    # With --eval-only: lm-evaluation-harness tasks instead of the shipped ones (`eval --tasks`, eval/lm_eval_tasks.py).
    parser.add_argument("--tasks", help="comma-separated lm-eval task names")
    parser.add_argument("--limit", type=int, default=None, help="documents per task")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per document")
    parser.add_argument("--include-path", type=Path, action="append", default=[], help="more lm-eval task folders")
    args = parser.parse_args(argv)
    # The start's phases, from the head's launch to the first step's end: rank 0 emits them as `startup`.
    clock = StartupClock.for_rank()
    run_dir = RunDir(args.run_dir)
    fill_compile_cache_env(run_dir, os.environ)  # before anything compiles; launch.py's launcher has set them already
    runlock.join(run_dir)  # this rank keeps the run directory until it exits, even if its launcher is gone
    try:
        spec = load_spec(run_dir.plan)  # an unknown, missing or mistyped key, named, before any process group forms
    except BadInput as e:
        raise SystemExit(str(e)) from None

    from appliance.data.blend import build_datasets
    from appliance.data.documents import dataset_eod_id
    from appliance.data.sampler import PretrainingSampler
    from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm
    from appliance.parallel.topology import ParallelTopology
    from appliance.tokenizer.token_bytes import token_byte_lengths
    from appliance.train.budget_watch import BudgetWatch
    from appliance.train.collective_timeout import collective_timeout_s, use_for_new_groups
    from appliance.train.faults import FaultInjector
    from appliance.train.from_spec import engine_for, kernels_for, model_config, reprice_plan
    from appliance.train.launch import check_plan_runs_here
    from appliance.train.metrics import peak_flops_per_device, step_flops
    from appliance.train.trainer import Trainer

    clock.mark("imports")
    # --spares / --nnodes MIN:MAX: the ranks beyond those that train stand by on the host, before any device or
    # process group is touched; the others form a world of their own (train/elastic.py).
    place = elastic.placement(spec)
    if place.spare:
        return elastic.stand_by(run_dir, place)
    os.environ["WORLD_SIZE"] = str(place.train_world)
    device = _device()
    # Collectives wait for a peer as long as the plan's longest stretch of work allows, not torch's 10 to 30 minutes
    # (train/collective_timeout.py); every group made later, DeepSpeed's too, gets the same.
    timeout = timedelta(seconds=collective_timeout_s(spec))
    use_for_new_groups(timeout)
    # The process group forms on a store rank 0 serves at MASTER_ADDR:MASTER_PORT (the agent's), listening on the one
    # address the launcher named (parallel/store.py): 127.0.0.1 on one node, the node's rendezvous address on several.
    init_deepspeed_comm("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    events = writer_with_sinks(run_dir.metrics) if rank == 0 else None
    if events is not None:
        clock.report_to(events)
    vocab_size = tokenizer_vocab_size(run_dir.tokenizer_json)
    try:
        # --nnodes MIN:MAX: the agents may have re-formed without a node (or with it again); the planner's layout
        # for the ranks there are (train/elastic.py).
        spec = elastic.spec_for_world(spec, world_size)
    except BadInput as e:
        # Every rank fails alike, and again after any restart with these nodes: stop instead (see failed_marker).
        if events is not None:
            events.emit("failure", rank=rank, reason=str(e), fatal=True)
            run_dir.make_control()
            run_dir.failed_marker.write_text(f"{e}\n")
            elastic.release_spares(run_dir)
        dist.destroy_process_group()
        return 0
    settings, layout = spec.train, spec.layout
    try:
        # This node's torch and accelerator, before DeepSpeed would fail inside initialize (under SLURM no head
        # process checked first).
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        check_plan_runs_here(spec, str(run_dir.plan), ranks_here=local_ranks, in_rank=True)
        config = model_config(spec, vocab_size)
        # Every broken rule at once, each factor named: tp * pp * dp * cp against the world, heads % tp (and over cp
        # for ulysses), the blocks over pp, the sequence over the cp chunks. The process groups are built once,
        # here, TP innermost, then CP, then DP, then PP.
        layout.validate(
            world_size,
            config.n_head,
            config.n_layer,
            settings.seq_len,
            moe_num_experts=config.moe_num_experts,
            dtype=settings.dtype,
            expert_device_budget_mb=settings.expert_device_budget_mb,
            expert_host_budget_mb=settings.expert_host_budget_mb,
        )
        topology = ParallelTopology.from_layout(layout, world_size=world_size)
        # reset_attention_mask: documents end at the datasets' EOD token (refused, naming datasets.json, without one).
        eod_id = dataset_eod_id(run_dir.data) if settings.reset_attention_mask else None
    except (BadInput, ValueError) as e:
        if events is not None:
            events.emit("failure", rank=rank, reason=f"{run_dir.plan}: {e}")
        raise SystemExit(f"{run_dir.plan}: {e}") from None
    # The first collective comes after every rank's own checks above, so a plan this node cannot run stops each rank
    # with its reason instead of leaving the others waiting in it.
    node_change = _note_nodes(run_dir, rank, layout.factors)
    start = _account_start(run_dir, rank, spec, node_change, events)
    if start is not None and start.budget.overspent:  # every rank learns it from rank 0: the run stops, resumable
        dist.destroy_process_group()
        return 0
    if rank == 0:
        # Ranks that start again are no longer preempted: the agent stops the workers with SIGTERM (they save and
        # leave this marker) when a node joins (the grow-back) and starts them again, in the same launch.
        run_dir.preempted_marker.unlink(missing_ok=True)
    topology.init_process_groups()
    # The sampler deals samples by the dp coordinate only: the CP ranks of a DP rank take the same sequences.
    dp_rank, dp_size = topology.dp_rank(rank), topology.dp
    watchdog = _start_watchdog(run_dir, rank, settings)

    sampler = _start_sampler(run_dir, events, spec)
    seed_everything(settings.seed)
    clock.mark("process_groups")
    kernels = kernels_for(spec, config, topology, run_dir=run_dir)
    if events is not None:
        events.emit("kernels", **kernels)
        spec = reprice_plan(run_dir, spec, kernels)  # the budget watch compares the steps with this estimate
    clock.mark("kernel_choice")
    engine = engine_for(spec, config, topology, run_dir=run_dir, kernels=kernels)
    clock.mark("engine")

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
        cp_rank=topology.cp_rank(rank),
        world_size=world_size,
        events=events,
        flops=step_flops(spec),
        peak_flops_per_device=peak_flops_per_device(spec),
        layout=spec.layout_section(),
        versions=_versions(),
        device=device,
        drift_check_interval=settings.drift_check_interval,
        faults=FaultInjector(rank),
        stop_at_step=args.stop_at_step,
        on_step=watchdog.set_step,
        budget=BudgetWatch.for_spec(spec) if rank == 0 else None,
        eod_id=eod_id,
        token_bytes=token_byte_lengths(run_dir.tokenizer_json),  # for bits per byte in evaluations
    )
    clock.mark("data")

    def warn(message: str) -> None:
        if events is not None:
            events.emit("warning", message=message)

    resume_from = ckpt.find_latest(run_dir.checkpoints, warn=warn)
    if resume_from is not None:
        trainer.load(resume_from)
    clock.mark("checkpoint_load")  # the first evaluation and the first step: the clock reads their events
    book = None
    if events is not None and start is not None:
        # Which nodes train and stand by, and a change of nodes, are reported as the first step starts
        # (train/node_record.py); an ordinary restart's recovery event too, after the same check. The spare book
        # keeps the standbys' count while the start trains (train/spare_book.py).
        from appliance.train.node_beats import timings
        from appliance.train.spare_book import SpareBook

        book = SpareBook(
            run_dir,
            events,
            timings(),
            idle=lambda: elastic.idle_of_start(run_dir),
            by=elastic.this_node(),
            expected=[] if node_change is None else node_change.before_spares,
        )
        resumed = resume_from
        trainer.on_step = node_record.report_at_first_step(
            events,
            run_dir,
            node_record.StartReport(node_change, trainer.pos.step, start.budget, start.spent),
            idle=lambda: elastic.idle_of_start(run_dir),
            standbys=book.start().standbys,
            then=watchdog.set_step,
            otherwise=None
            if resumed is None
            else lambda: _emit_recovery(events, run_dir, resumed, trainer.pos.step, start.budget.left),
        )
    elif events is not None and resume_from is not None:
        _emit_recovery(events, run_dir, resume_from, trainer.pos.step)
    if args.eval_only and resume_from is None:
        raise SystemExit(f"{run_dir.checkpoints}: no complete checkpoint to evaluate")
    try:
        outcome = "done" if args.eval_only else trainer.fit()
    except UNRECOVERABLE as e:
        # Every rank raises the same error at the same step (each comes from an agreed, collective decision), and
        # every rank exits 0 below: the agent must not restart into the same failure. The head reads the marker.
        outcome = "failed"
        if rank == 0:
            assert events is not None
            if not isinstance(e, ReplicaDriftError):  # the drift check has named the parameter in its own event
                events.emit("failure", rank=rank, reason=f"step {trainer.pos.step}: {e}", fatal=True)
            run_dir.failed_marker.write_text(f"step {trainer.pos.step}: {e}\n")
    if outcome == "done":
        from appliance.eval.final import write_final_eval

        task_runner = None
        if args.tasks:
            from appliance.eval.lm_eval_tasks import lm_eval_task_runner, parse_task_names

            task_runner = lm_eval_task_runner(
                parse_task_names(args.tasks),
                run_root=run_dir.root,
                is_writer=rank == 0,
                limit=args.limit,
                num_fewshot=args.num_fewshot,
                include_paths=args.include_path,
            )
        write_final_eval(trainer, run_dir, vocab_size=vocab_size, is_writer=rank == 0, task_runner=task_runner)
    engine.close()  # the last step's weights may still be in flight over DP (overlap_param_gather)
    dist.barrier()
    watchdog.stop()
    if sampler is not None:
        sampler.stop()  # takes a last sample, so the energy total covers the whole run
    if book is not None:
        book.stop()
    if rank == 0 and elastic.launched_elastic():
        elastic.release_spares(run_dir)  # this start's training ended (done, stopped or failed for good)
    dist.destroy_process_group()
    return 0


def _note_nodes(run_dir: RunDir, rank: int, factors: str) -> node_record.NodeChange | None:
    """Every rank's node name to rank 0, which records them and compares them with the last start's
    (train/node_record.py). Only an elastic launch reports a change: a job requeued on other nodes (SLURM) is no lost
    node, and its recovery event keeps its own lost-time rule (train/watchdog.py lost_seconds)."""
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, elastic.this_node())
    if rank != 0:
        return None
    change = node_record.note_nodes(run_dir, [str(n) for n in names], factors)
    if not elastic.launched_elastic():
        return None
    elastic.clear_old_starts(run_dir)
    return change


@dataclass(frozen=True)
class Start:
    budget: Budget
    spent: bool


def _account_start(
    run_dir: RunDir, rank: int, spec: RunSpec, change: node_record.NodeChange | None, events: EventWriter | None
) -> Start | None:
    """An elastic launch's restart budget (train/restart_budget.py): rank 0 counts this start, spends a restart
    when it follows a failure no spare covered, and, past the budget, stops the run through the failed marker;
    every rank gets its decision (None: not an elastic launch, whose agents keep torch's budget)."""
    from appliance.train.restart_budget import StartFacts, account_start

    if not elastic.launched_elastic():
        return None
    found: list[Any] = [None]
    if rank == 0:
        facts = None
        if change is not None:
            facts = StartFacts(
                stopped_cleanly=run_dir.preempted_marker.exists(),
                before_nodes=change.before_nodes,
                nodes=change.nodes,
                replacements=change.took_over,
                layout_kept=change.old_layout == change.new_layout,
            )
        why = "a restart after a failure" if change is None or not change.lost else f"lost {', '.join(change.lost)}"
        budget, spent = account_start(run_dir, spec.run.max_restarts, facts, why)
        if budget.overspent and events is not None:
            reason = (
                f"restart budget spent: {budget.spent} failures against run.max_restarts {budget.budget} (the newest:"
                f" {why}); spares' takeovers count none. Resume with the same command, or raise it with"
                " --set max_restarts=N"
            )
            events.emit("failure", rank=rank, reason=reason, fatal=True)
            run_dir.failed_marker.write_text(reason + "\n")
            elastic.release_spares(run_dir)
        found = [Start(budget, spent)]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def _start_watchdog(run_dir: RunDir, rank: int, settings: TrainSettings) -> Any:
    from appliance.train.watchdog import Watchdog, prune_attempts

    def on_hung(hung_rank: int, reason: str) -> None:
        # Any rank may be the one that notices; each event is one O_APPEND write, so writers never interleave.
        with EventWriter(run_dir.metrics) as writer:
            writer.emit("failure", rank=hung_rank, reason=reason, detected_by=rank)

    if rank == 0:
        prune_attempts(run_dir.heartbeats)
    return Watchdog(
        run_dir.heartbeats,
        rank,
        interval_s=settings.heartbeat_interval_s,
        timeout_s=settings.hang_timeout_s,
        on_hung=on_hung,
    ).start()


def _emit_recovery(
    events: EventWriter, run_dir: RunDir, resumed_from: Path, step: int, restarts_left: int | None = None
) -> None:
    """`restarts_left`: the elastic launch's own count (train/restart_budget.py); else the agent's."""
    import time

    from appliance.train.watchdog import attempt_id, lost_seconds

    manifest = json.loads((resumed_from / ckpt.MANIFEST).read_text())
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts_left is None:
        restarts_left = max(0, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart)
    events.emit(
        "recovery",
        restart=restart,
        resumed_step=step,
        lost_seconds=lost_seconds(run_dir.heartbeats, attempt_id(), float(manifest["time"]), step, time.time()),
        checkpoint=str(resumed_from),
        restarts_left=restarts_left,
    )


if __name__ == "__main__":
    exit_without_teardown(main())  # a finished rank skips the interpreter's teardown (appliance/process_exit.py)
