"""`import`: a transformers Bloom checkpoint becomes the starting point of a run.

The run directory gets a plan for the checkpoint's shape, the checkpoint's own tokenizer (training must see the
ids the weights were trained on, so the tokenizer stage keeps it instead of training a new one), and a committed
step-0 checkpoint with the weights. `run --run-dir D` or `train --run-dir D` then continues from it at whatever
layout the plan chose: a full-model checkpoint loads at any layout, with a fresh optimizer.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

from safetensors.torch import save_file

from appliance.atomic import make_dir, write_atomic
from appliance.errors import BadInput
from appliance.output_dirs import claim_run_dir, make_run_dir
from appliance.planner.runspec import ImportedWeights, RunSpec
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt

MODEL_FILE = "model.safetensors"


def import_run(hf_dir: Path, run_dir: Path, *, hardware: str | None = None, seq_len: int = 2048) -> RunSpec:
    from appliance.eval.hf_export import import_hf
    from appliance.hardware import detect, load_hardware
    from appliance.planner import ModelShape, make_plan

    rd = RunDir(run_dir)
    inputs = {"--hf-dir": [Path(hf_dir)]}
    claim_run_dir(run_dir, inputs=inputs)  # before the checkpoint is read: new, empty or a run's, and not --hf-dir
    if rd.plan.exists() or rd.checkpoints.exists():
        raise BadInput(f"--run-dir {run_dir}: already holds a run; import into a new directory")
    tokenizer_json = Path(hf_dir) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise BadInput(f"--hf-dir {hf_dir}: no tokenizer.json (a fast tokenizer file) to train with")
    config, state = import_hf(Path(hf_dir))
    shape = ModelShape(
        layers=config.n_layer,
        hidden=config.hidden_size,
        heads=config.n_head,
        vocab_size=config.vocab_size,
        seq_len=seq_len,
        name=f"imported-{Path(hf_dir).resolve().name}",
        description=f"imported from {Path(hf_dir).resolve()}",
        layer_norm_epsilon=config.layer_norm_epsilon,
        init_std=config.initializer_range,  # not used (the weights are loaded), but what the checkpoint states
    )
    spec = make_plan(load_hardware(hardware) if hardware else detect(), shape).spec()
    if shape.padded_vocab(spec.layout.tp) != config.vocab_size:
        raise BadInput(
            f"--hf-dir {hf_dir}: vocabulary {config.vocab_size} is not a multiple of 128 x tp({spec.layout.tp})"
        )
    imported = ImportedWeights(
        source=str(Path(hf_dir).resolve()), tokenizer_sha256=hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    )
    spec = replace(spec, init=imported)

    make_run_dir(run_dir, inputs=inputs)
    make_dir(rd.tokenizer)
    shutil.copyfile(tokenizer_json, rd.tokenizer_json)
    step_dir = ckpt.prepare_step_dir(rd.checkpoints, 0)
    tensors = {k: v.float().contiguous() for k, v in state.items() if k != "lm_head.weight"}  # the tie is implied
    save_file(tensors, str(step_dir / MODEL_FILE), metadata={"imported_from": str(Path(hf_dir).resolve())})
    # layout None: every layout loads the weights and starts a fresh optimizer.
    meta = {"consumed_samples": 0, "layout": None, "world_size": None, "imported_from": imported.source}
    ckpt.commit(rd.checkpoints, 0, [ckpt.FileRecord.of(step_dir / MODEL_FILE)], meta)
    write_atomic(rd.plan, spec.dumps())
    return spec
