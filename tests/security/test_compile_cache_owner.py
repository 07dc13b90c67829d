"""A run directory copied from someone else brings no code into this user's ranks through its compile caches.

torch's Inductor unpickles its cache entries and imports the modules it generated; Triton loads its launcher as a
shared library. The ranks' caches live in the run directory (train/compile_cache.py compile_cache_env), under a folder
named by an HMAC of the user's own key (train/compile_cache.py). These tests plant a cache where the ranks of the run's
owner (another key) would look, and check that this user's ranks look elsewhere, while this user's own restarts
keep finding theirs."""

import os
import stat
from pathlib import Path

from appliance.rundir import RunDir
from appliance.train.compile_cache import cache_tag, compile_cache_env, key_path, read_or_make_key


def _env_of(home: Path) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(home / ".config")}


def test_a_copied_runs_caches_are_not_the_ones_this_user_loads(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path / "run")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "alice" / ".config"))
    alices = compile_cache_env(run_dir)
    planted = Path(alices["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph" / "entry"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"a pickle that runs code")
    # The same user again (a restart, a requeue, a rerun): the same folder.
    assert compile_cache_env(run_dir) == alices
    # The run directory copied to bob: his ranks get folders the copy does not hold.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "bob" / ".config"))
    bobs = compile_cache_env(run_dir)
    for name, path in bobs.items():
        assert path != alices[name]
        assert not Path(path).exists()
        assert Path(path).is_relative_to(run_dir.compile_cache)


def test_the_key_is_private_made_once_and_kept(tmp_path):
    env = _env_of(tmp_path)
    path = key_path(env)
    first = cache_tag(env)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode == 0o600, oct(mode)
    assert cache_tag(env) == first and read_or_make_key(path) == path.read_bytes()
    # Control: another key gives another tag, so the equality above is not a constant.
    assert cache_tag(_env_of(tmp_path / "other")) != first


def test_a_home_that_cannot_hold_a_key_gets_a_tag_for_this_process_only(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    env = {"XDG_CONFIG_HOME": str(blocked)}
    tag = cache_tag(env)
    assert len(tag) == 16 and tag == cache_tag(env)
    assert tag != cache_tag(_env_of(tmp_path))
