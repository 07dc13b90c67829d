"""Checkpoints are complete or invisible: each test's name states its pass criterion."""

import os

from appliance.train import checkpoint as ckpt


def _save(root, step, payload=b"weights"):
    step_dir = ckpt.prepare_step_dir(root, step)
    (step_dir / "model.safetensors").write_bytes(payload)
    (step_dir / "rank00000.pt").write_bytes(payload * 2)
    records = [ckpt.FileRecord.of(step_dir / n) for n in ("model.safetensors", "rank00000.pt")]
    return ckpt.commit(root, step, records, {"consumed_samples": step * 16})


def test_committed_checkpoint_is_found_with_mode_0640_files_and_0750_dir(tmp_path):
    step_dir = _save(tmp_path, 10)
    assert ckpt.find_latest(tmp_path) == step_dir
    assert ckpt.read_manifest(step_dir)["consumed_samples"] == 160
    assert oct((step_dir / "model.safetensors").stat().st_mode & 0o777) == "0o640"
    assert oct(step_dir.stat().st_mode & 0o777) == "0o750"


def test_directory_without_manifest_is_invisible(tmp_path):
    good = _save(tmp_path, 10)
    crashed = ckpt.prepare_step_dir(tmp_path, 20)  # a save that died before commit
    (crashed / "model.safetensors").write_bytes(b"half")
    assert ckpt.find_latest(tmp_path) == good


def test_torn_latest_falls_back_to_newest_verified(tmp_path):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    (tmp_path / ckpt.LATEST).write_text("step-000")  # torn pointer
    assert ckpt.find_latest(tmp_path) == newest


def test_corrupted_or_truncated_shard_falls_back_with_warning(tmp_path):
    older = _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    warnings = []
    data = (newest / "rank00000.pt").read_bytes()
    (newest / "rank00000.pt").write_bytes(data[:-1] + b"X")  # same size, different content
    assert ckpt.find_latest(tmp_path, warn=warnings.append) == older
    assert "SHA-256" in warnings[0]
    (newest / "rank00000.pt").write_bytes(data[:3])  # truncated
    assert ckpt.find_latest(tmp_path, verify_hashes=False) == older
    os.remove(newest / "rank00000.pt")  # deleted
    assert ckpt.find_latest(tmp_path, verify_hashes=False) == older


def test_prune_keeps_last_k_and_never_the_newest_valid(tmp_path):
    for step in (10, 20, 30, 40):
        _save(tmp_path, step)
    removed = ckpt.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-00000010", "step-00000020"]
    assert ckpt.find_latest(tmp_path).name == "step-00000040"
    ckpt.prune(tmp_path, keep_last=0)
    assert ckpt.find_latest(tmp_path).name == "step-00000040"


def test_free_space_check_refuses_impossible_save(tmp_path):
    try:
        ckpt.check_free_space(tmp_path, needed_bytes=10**18)
    except ckpt.CheckpointError as e:
        assert "free" in str(e)
    else:
        raise AssertionError("expected CheckpointError")
