"""Checksums of sharded (DCP) checkpoints: each rank records its files' sizes and sha256; a resume
refuses a truncated or missing shard, infer/export/consolidation a corrupt one.

The directory is written by the real save_sharded in a spawned one-rank gloo process (DCP needs a
process group); the checks run here on the files it left.
"""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import on_gloo_ranks

from moe.checkpoint.io import CorruptCheckpoint
from moe.checkpoint.picker import read_checkpoint, verify_checkpoint
from moe.errors import UserError


def _save(rank, path):
    from torch.distributed.device_mesh import init_device_mesh

    from moe.checkpoint.sharded import save_sharded

    module = torch.nn.Linear(64, 32, bias=False)
    module.weight.is_expert = True
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("expert_dp", "ep"))
    save_sharded(path, module, [optimizer], mesh, {"global_step": 7, "state_dict": {}}, is_global_zero=True)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "step-000007.ckpt"
    on_gloo_ranks(1, _save, str(path))
    return path


@pytest.fixture
def sharded(written, tmp_path):
    """A fresh copy for each test to damage."""
    return Path(shutil.copytree(written, tmp_path / written.name))


def test_each_rank_records_its_files_and_a_resume_checks_their_sizes(sharded):
    manifest = json.loads((sharded / "__0.sha256.json").read_text())
    assert set(manifest) == {"__0_0.distcp", ".metadata"}
    assert manifest["__0_0.distcp"]["bytes"] == (sharded / "__0_0.distcp").stat().st_size
    assert verify_checkpoint(sharded) == 7 and verify_checkpoint(sharded, deep=True) == 7

    data = sharded / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpoint, match=r"is not whole: __0_0.distcp is \d+ bytes but was written"):
        verify_checkpoint(sharded)


def test_a_flipped_byte_in_a_shard_is_refused_by_infer(sharded):
    data = sharded / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    assert verify_checkpoint(sharded) == 7  # same size: a resume's cheap check passes...
    with pytest.raises(UserError) as err:  # ...reading every byte does not
        read_checkpoint(sharded)
    assert "__0_0.distcp does not match the sha256 recorded when it was written" in str(err.value)


def test_a_data_file_no_rank_recorded_is_a_torn_save(sharded):
    (sharded / "__1_0.distcp").write_bytes(b"left over")
    with pytest.raises(CorruptCheckpoint, match="__1_0.distcp, which no rank recorded writing"):
        verify_checkpoint(sharded)


@pytest.mark.parametrize("damage, says", [
    ("{not json", "unreadable record __0.sha256.json"),
    ('{"__0_0.distcp": {"bytes": "12"}}',
     "corrupt record __0.sha256.json: __0_0.distcp (bad or missing bytes"),
    ("[1, 2]", "corrupt record __0.sha256.json (not a JSON object)"),
], ids=["garbage", "wrong_type", "not_an_object"])
def test_a_damaged_manifest_or_trainer_state_sidecar_is_refused_like_a_damaged_shard(sharded, damage, says):
    """A record that cannot vouch for its files makes the directory untrusted (a resume falls back)."""
    (sharded / "__0.sha256.json").write_text(damage)
    with pytest.raises(CorruptCheckpoint, match=re.escape(says)):
        verify_checkpoint(sharded)


def test_a_damaged_trainer_state_sidecar_is_refused(sharded):
    sidecar = sharded / "trainer_state.pt.meta.json"
    assert sidecar.exists()
    sidecar.write_text('{"bytes": 10, "sha256": null, "global_step": 7}')
    says = "trainer_state.pt.meta.json (bad or missing sha256"
    with pytest.raises(CorruptCheckpoint, match=re.escape(says)):
        verify_checkpoint(sharded)
