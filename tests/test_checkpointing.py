"""Atomic checkpoint writes, corrupt/truncated detection with fallback, and the resume picker."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from moe.checkpoint.io import CorruptCheckpoint, meta_path
from moe.checkpoint.lightning_io import AtomicCheckpointIO, with_atomic_io
from moe.checkpoint.picker import find_resume_checkpoint, verify_checkpoint
from moe.errors import UserError
from moe.faults import KILL_DURING_SAVE_ENV
from moe.module.train_step import step_seed


def ckpt(step: int, cfg: dict | None = None) -> dict:
    """A Lightning-shaped checkpoint: what verify/resume look at."""
    out = {"global_step": step, "state_dict": {"w": torch.full((64, 64), float(step))}}
    if cfg is not None:
        out["hyper_parameters"] = {"cfg": cfg}
    return out


def save(path, step):
    AtomicCheckpointIO().save_checkpoint(ckpt(step), path)


def test_an_unchanged_file_is_hashed_once_per_process_and_a_changed_one_again(tmp_path, monkeypatch):
    """train.py verifies the newest checkpoint in its preflight and again in train(): one hash."""
    from moe.checkpoint import formats as checkpoint

    path = tmp_path / "step-000003.ckpt"
    save(path, 3)
    hashed = []
    real = checkpoint.file_sha256
    monkeypatch.setattr(checkpoint, "file_sha256", lambda p: (hashed.append(p), real(p))[1])
    assert verify_checkpoint(path) == 3 and verify_checkpoint(path) == 3
    assert len(hashed) == 1
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a later write
    with pytest.raises(CorruptCheckpoint, match="does not match the sha256"):
        verify_checkpoint(path)
    assert len(hashed) == 2


def test_save_writes_file_and_sidecar_and_leaves_no_temp(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    save(path, 7)
    record = json.loads(meta_path(path).read_text())
    data = path.read_bytes()
    assert record == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "global_step": 7}
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt", "last.ckpt.meta.json"]
    loaded = torch.load(path, weights_only=False)
    assert loaded["global_step"] == 7 and torch.equal(loaded["state_dict"]["w"], torch.full((64, 64), 7.0))
    assert verify_checkpoint(path) == 7


KILL_SAVE = """
import sys, torch
from moe.checkpoint.lightning_io import AtomicCheckpointIO
step = int(sys.argv[2])
state = {"global_step": step, "state_dict": {"w": torch.randn(256, 256)}}
AtomicCheckpointIO().save_checkpoint(state, sys.argv[1])
"""


def test_sigkill_half_way_through_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save(path, 1)
    before = path.read_bytes()
    env = {**os.environ, KILL_DURING_SAVE_ENV: "2"}
    run = [sys.executable, "-c", KILL_SAVE, str(path), "2"]
    killed = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert "killing this process half-way through writing" in killed.stderr
    tmp = tmp_path / "last.ckpt.tmp"
    assert tmp.exists() and 0 < tmp.stat().st_size  # the half-written temporary file
    assert path.read_bytes() == before  # the checkpoint under its real name is untouched
    assert verify_checkpoint(path) == 1
    assert find_resume_checkpoint(tmp_path) == path

    # the hook fires once per directory: the next save completes and cleans the stale temp file
    monkeypatch.setenv(KILL_DURING_SAVE_ENV, "2")
    save(path, 2)
    assert verify_checkpoint(path) == 2 and not tmp.exists()


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    save(tmp_path / "step-000004.ckpt", 4)
    save(tmp_path / "step-000008.ckpt", 8)
    save(tmp_path / "last.ckpt", 8)
    for name in ("step-000008.ckpt", "last.ckpt"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 3])
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step-000004.ckpt"
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / 'last.ckpt'} is" in err and "(truncated)" in err
    assert "step-000008.ckpt" in err and "falling back to the previous checkpoint" in err


def test_flipped_bytes_are_caught_by_the_sidecar_hash(tmp_path, capsys):
    save(tmp_path / "step-000004.ckpt", 4)
    save(tmp_path / "step-000008.ckpt", 8)
    bad = tmp_path / "step-000008.ckpt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed inside the tensor data
    bad.write_bytes(bytes(data))
    with pytest.raises(Exception, match="sha256"):
        verify_checkpoint(bad)
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step-000004.ckpt"
    assert "(corrupt)" in capsys.readouterr().err


@pytest.mark.parametrize("damage, says", [
    (b"\x00\xff garbage", "has an unreadable record step-000008.ckpt.meta.json"),
    (b'{"bytes": 1, "sha256": "ab"}',
     "has a corrupt record step-000008.ckpt.meta.json (bad or missing global_step)"),
    (b'{"bytes": true, "sha256": "ab", "global_step": 8}', "(bad or missing bytes)"),
], ids=["garbage", "missing_key", "wrong_type"])
def test_a_corrupt_sidecar_falls_back_to_the_previous_checkpoint(tmp_path, capsys, damage, says):
    """The sidecar vouches for the file; a damaged one cannot, so its checkpoint is treated as damaged."""
    save(tmp_path / "step-000004.ckpt", 4)
    save(tmp_path / "step-000008.ckpt", 8)
    meta_path(tmp_path / "step-000008.ckpt").write_bytes(damage)
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step-000004.ckpt"
    err = capsys.readouterr().err
    assert says in err and "falling back to the previous checkpoint" in err


def test_without_a_sidecar_a_truncated_file_is_caught_by_loading_it(tmp_path):
    torch.save(ckpt(3), tmp_path / "step-000003.ckpt")  # written by plain torch.save: no sidecar
    save(tmp_path / "step-000002.ckpt", 2)
    data = (tmp_path / "step-000003.ckpt").read_bytes()
    (tmp_path / "step-000003.ckpt").write_bytes(data[:-100])
    with pytest.raises(Exception, match="cannot be read"):
        verify_checkpoint(tmp_path / "step-000003.ckpt")
    assert find_resume_checkpoint(tmp_path, quiet=True) == tmp_path / "step-000002.ckpt"


def test_no_loadable_checkpoint_is_a_user_error_with_the_fix(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"\0" * 1000)
    with pytest.raises(UserError) as info:
        find_resume_checkpoint(tmp_path, quiet=True)
    err = info.value
    assert err.field == "resume" and "last.ckpt cannot be read" in err.problem
    assert "resume=false" in err.fix and "another run_name" in err.fix


def test_picker_orders_by_step_not_by_name(tmp_path):
    assert find_resume_checkpoint(tmp_path / "missing") is None
    assert find_resume_checkpoint(tmp_path) is None
    torch.save(ckpt(2), tmp_path / "last.ckpt")  # no sidecar, no step in the name: loaded to learn its step
    save(tmp_path / "step-000003.ckpt", 3)
    save(tmp_path / "step-000001.ckpt", 1)
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step-000003.ckpt"
    assert find_resume_checkpoint(tmp_path, step=2) == tmp_path / "last.ckpt"
    save(tmp_path / "last.ckpt", 3)  # equal steps: last.ckpt, as Lightning users expect
    assert find_resume_checkpoint(tmp_path) == tmp_path / "last.ckpt"
    with pytest.raises(UserError, match="no loadable checkpoint at step 5"):
        find_resume_checkpoint(tmp_path, step=5)


def test_remove_takes_the_sidecar_and_plugins_get_one_checkpoint_io(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(ckpt(1), tmp_path / "step-000001.ckpt")
    io.remove_checkpoint(tmp_path / "step-000001.ckpt")
    assert list(tmp_path.iterdir()) == []
    plugins = with_atomic_io([])
    assert len(plugins) == 1 and isinstance(plugins[0], AtomicCheckpointIO)
    assert with_atomic_io(plugins) == plugins  # a CheckpointIO already there (e.g. Neuron's) wins


def test_step_seed_depends_on_every_coordinate():
    seeds = {step_seed(1234, r, s, m) for r in range(2) for s in range(3) for m in range(2)}
    assert len(seeds) == 12 and step_seed(1234, 1, 2, 1) == step_seed(1234, 1, 2, 1)


def test_infer_and_export_refuse_a_checkpoint_whose_bytes_changed(tmp_path):
    """A bit flip that keeps the size passes torch.load; the sidecar's sha256 catches it first."""
    import pytest
    import torch

    from moe.checkpoint.io import atomic_torch_save
    from moe.checkpoint.picker import read_checkpoint
    from moe.errors import UserError

    path = tmp_path / "step-000004.ckpt"
    atomic_torch_save({"global_step": 4, "state_dict": {"w": torch.arange(1000.0)}}, path)
    assert read_checkpoint(path)["global_step"] == 4
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="sha256") as err:
        read_checkpoint(path)
    assert err.value.field == "ckpt" and "Fix: " in str(err.value)


def _old_names(state: dict) -> dict:
    """A state_dict as checkpoints from before the shared expert was a SwiGLU named it."""
    from moe.model.mlp import RENAMED

    back = {new: old for old, new in RENAMED.items()}

    def old_name(key: str) -> str:
        return next((key[: -len(new)] + old for new, old in back.items() if key.endswith(new)), key)

    return {old_name(k): v for k, v in state.items()}


def test_a_checkpoint_with_the_shared_experts_older_names_still_loads(tmp_path):
    """Portable files (resume through Lightning, infer and export through the picker) and sharded DCP
    directories written before the rename load under today's names."""
    from dataclasses import asdict

    import torch.distributed.checkpoint as dcp

    from moe.checkpoint.sharded import MODEL_KEY, TRAINER_STATE, _under_saved_names, read_full_checkpoint
    from moe.config import ModelConfig, MoEOptConfig
    from moe.infer.load import model_from_checkpoint
    from moe.model import MoETransformer

    model_cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_layers=2, num_heads=2,
                            num_kv_heads=2, num_experts=4, top_k=2, shared_expert_intermediate_size=8)
    model = MoETransformer(model_cfg, MoEOptConfig(), init_seed=3)
    old = _old_names({f"model.{k}": v for k, v in model.state_dict().items()})
    assert "model.layers.0.ffn.shared_expert.gate_up.weight" in old
    cfg = {"model": asdict(model_cfg), "moe_opt": asdict(MoEOptConfig())}
    checkpoint = {"global_step": 1, "state_dict": old, "hyper_parameters": {"cfg": cfg}}
    AtomicCheckpointIO().save_checkpoint(checkpoint, tmp_path / "old.ckpt")
    assert set(AtomicCheckpointIO().load_checkpoint(tmp_path / "old.ckpt")["state_dict"]) == {
        f"model.{k}" for k in model.state_dict()}
    loaded, _ = model_from_checkpoint(tmp_path / "old.ckpt")
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    sharded = tmp_path / "old-sharded"
    weights = _old_names(dict(model.state_dict()))
    dcp.save({MODEL_KEY: weights}, checkpoint_id=str(sharded), no_dist=True)
    torch.save({"global_step": 1}, sharded / TRAINER_STATE)
    assert set(read_full_checkpoint(sharded)["state_dict"]) == set(model.state_dict())
    live = {MODEL_KEY: {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    as_saved = _under_saved_names(sharded, live)
    assert set(as_saved[MODEL_KEY]) == set(weights)
    dcp.load(as_saved, checkpoint_id=str(sharded), no_dist=True)
    for name, value in model.state_dict().items():
        assert torch.equal(live[MODEL_KEY][name], value), name


@pytest.mark.parametrize("damage", ["truncated", "flipped", "no_sidecar"])
def test_a_zero_partition_is_verified_with_its_checkpoint(tmp_path, damage):
    """DeepSpeed's ZeRO partitions beside a portable file are part of its format: each is written atomically
    with a sidecar, and a damaged one makes the checkpoint corrupt (resume falls back past it). One an older
    version wrote without a sidecar is checked by its zip CRC-32s."""
    from moe.checkpoint.formats import PORTABLE, Live, zero_partitions_dir

    path = tmp_path / f"step-000004-{damage}.ckpt"
    partition = {"optimizer": {"state": {0: {"exp_avg": torch.arange(4096.0)}}}, "layout": {"world": 2}}
    for rank in (1, 0):  # the format's collective save, one rank after the other (its barriers: no-ops)
        live = Live(module=None, optimizers=[], dims=None, device_type="cpu", rank=rank,
                    is_global_zero=rank == 0, barrier=lambda: None, writes=PORTABLE, per_rank=partition)
        PORTABLE.save(live, {"state_dict": {}, "global_step": 4, "loops": {}, "optimizer_states": []}, path)
        assert path.exists() == (rank == 0)  # the file, whose sidecar marks it complete, comes last
    assert sorted(p.name for p in zero_partitions_dir(path).iterdir()) == [
        "rank_00000.pt", "rank_00000.pt.meta.json", "rank_00001.pt", "rank_00001.pt.meta.json"]
    assert verify_checkpoint(path) == 4
    shard = zero_partitions_dir(path) / "rank_00001.pt"
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    else:
        at = data.find(b"\x00\x00\x80\x3f")  # inside the tensor's bytes: 1.0 in float32
        data[at + 3] ^= 0xFF
        shard.write_bytes(data)
        if damage == "no_sidecar":
            meta_path(shard).unlink()
    again = path.with_name(path.name.replace(".ckpt", "-again.ckpt"))  # not the cached verdict
    for file in (path, meta_path(path)):
        again.with_name(file.name.replace(path.name, again.name)).write_bytes(file.read_bytes())
    zero_partitions_dir(path).rename(zero_partitions_dir(again))
    with pytest.raises(CorruptCheckpoint, match="ZeRO partition"):
        verify_checkpoint(again)


def test_checkpoints_are_written_only_through_the_formats():
    """Every backend declares a format the repository writes, and no code outside moe/checkpoint (and the
    formats backends register with it) writes or loads a checkpoint itself (the strategies call the declared
    format: moe.backends.checkpoints)."""
    import re
    from pathlib import Path

    from moe.backends.checkpoint_formats import BACKEND_FORMATS
    from moe.backends.registry import SPECS
    from moe.checkpoint.formats import BY_KEY, DEEPSPEED

    for spec in SPECS.values():
        for ep in (1, 2):
            assert BY_KEY[spec.checkpoint_format(ep)] is not DEEPSPEED, spec.name  # read-only format
    repo = Path(__file__).resolve().parents[1]
    writes = re.compile(r"\b(torch\.save|dcp\.save|dcp\.load|atomic_torch_save|save_sharded|load_sharded|"
                        r"(?<!super\(\)\.)(?<!Strategy\.)(?<!trainer\.)(save|load)_checkpoint)\(")
    # not a strategy's own, nor Lightning's public save (its strategy writes the declared format)
    registered = {type(found).__module__.replace(".", "/") + ".py" for found in BACKEND_FORMATS}
    found = []
    for path in sorted((repo / "moe").rglob("*.py")):
        relative = path.relative_to(repo).as_posix()
        if relative.startswith("moe/checkpoint/") or relative == "moe/faults.py":  # faults: sizes a buffer
            continue
        if relative in registered:  # a backend's own format, registered with moe.checkpoint.formats
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if writes.search(code) and not re.search(r"\bdef (save|load)_checkpoint\(", code):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "write and load checkpoints through moe.checkpoint.formats:\n" + "\n".join(found)
