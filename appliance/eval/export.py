"""`export`: a run's newest checkpoint as a Hugging Face transformers Bloom directory."""

from __future__ import annotations

from pathlib import Path

from appliance.errors import BadInput
from appliance.planner.runspec import load_spec
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt


def export_run(run_dir: RunDir, out_dir: Path, *, force: bool = False) -> Path:
    """The newest checkpoint of `run_dir` into `out_dir`, which must be new, empty or an earlier export, and must not
    be, hold or lie inside what the export reads (checked before anything is read)."""
    from appliance.eval.hf_export import claim_export_dir, export_hf
    from appliance.model.config import config_for_shape
    from appliance.parallel.checkpoint.weight_shards import LazyFullStateDict

    if not run_dir.plan.exists():
        raise BadInput(f"--run-dir {run_dir.root}: no plan.json, not a run directory")
    # The run's own <run>/export is fine; the run directory itself, its checkpoints or its tokenizer are not.
    inputs = {"--run-dir": [run_dir.plan, run_dir.checkpoints, run_dir.tokenizer]}
    claim_export_dir(out_dir, inputs=inputs, force=force)
    step_dir = ckpt.find_latest(run_dir.checkpoints)
    if step_dir is None:
        raise BadInput(f"--run-dir {run_dir.root}: no complete checkpoint under {run_dir.checkpoints}")
    spec = load_spec(run_dir.plan)
    # Read parameter by parameter from model.safetensors or the tensor/pipeline-parallel shards: the export never
    # holds the whole model, only one output shard.
    try:
        state = LazyFullStateDict(step_dir)
    except FileNotFoundError as e:
        raise BadInput(str(e)) from None
    # config.json states the plan's layer_norm_epsilon and init_std (as initializer_range), not transformers' defaults.
    config = config_for_shape(spec.model, state["transformer.word_embeddings.weight"].shape[0])
    return export_hf(state, config, run_dir.tokenizer_json, out_dir, inputs=inputs, force=force)
