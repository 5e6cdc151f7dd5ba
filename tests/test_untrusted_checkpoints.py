"""No code runs from a checkpoint the user did not opt into (moe/checkpoint/trust.py).

A malicious file's unpickling would create a marker file (builtins.open(marker, "w")). Loaded by
infer.py, a resume, the consolidation tool or through a sharded directory's DCP metadata, it is
refused with exit 2 naming `allow_pickle`, and the marker never appears; with allow_pickle=true the
user's explicit choice, it is unpickled (the marker appears) with a warning.
"""
from __future__ import annotations

import argparse
import pickle
import shutil

import pytest
import torch
from conftest import FAST_RUN, run_entry
from test_infer import icfg, save_ckpt, tiny_model

from moe.checkpoint.trust import PickleRefused, check_dcp_metadata, set_allow_pickle
from moe.errors import UserError
from moe.infer.command import run
from moe.infer.load import model_from_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


class Payload:
    """Unpickling calls open(marker, "w"): a file appears if any code from the pickle runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(autouse=True)
def weights_only_policy():
    set_allow_pickle(False)
    yield
    set_allow_pickle(False)


def _malicious(path, marker):
    return save_ckpt(path, tiny_model(), extra={"payload": Payload(marker)})


def test_infer_refuses_a_malicious_checkpoint_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = _malicious(tmp_path / "evil.ckpt", marker)
    proc = run_entry("infer.py", f"ckpt={path}", "prompt=hi", here=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "allow_pickle" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_a_resume_refuses_a_malicious_checkpoint_in_the_run_dir(tmp_path):
    marker, run_dir = tmp_path / "pwned", tmp_path / "run"
    _malicious(run_dir / "checkpoints" / "step-000010.ckpt", marker)
    proc = run_entry("train.py", f"hydra.run.dir={run_dir}", *FAST_RUN, "trainer.max_steps=12", here=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "allow_pickle=False" in proc.stderr and "step-000010.ckpt" in proc.stderr
    assert not marker.exists()


def test_consolidate_refuses_it_and_allow_pickle_opts_in(tmp_path):
    from moe.tools.consolidate import main

    marker = tmp_path / "pwned"
    path = _malicious(tmp_path / "evil.ckpt", marker)
    with pytest.raises(SystemExit) as exit_:
        main([str(path), str(tmp_path / "out.ckpt")])
    assert exit_.value.code == 2 and not marker.exists()
    with pytest.raises(UserError, match="allow_pickle"):  # the same refusal in infer's own process
        run(icfg(ckpt=str(path), prompt="hi"))
    assert not marker.exists()
    set_allow_pickle(True)  # the user's explicit choice: its code runs
    model_from_checkpoint(path)
    assert marker.exists()


def test_a_foreign_object_loads_only_with_allow_pickle_and_a_warning(tmp_path, capsys):
    path = save_ckpt(tmp_path / "x.ckpt", tiny_model(), extra={"args": argparse.Namespace(lr=1.0)})
    with pytest.raises(PickleRefused, match="Namespace"):
        model_from_checkpoint(path)
    set_allow_pickle(True)
    model, _ = model_from_checkpoint(path)
    assert "allow_pickle=true: unpickling" in capsys.readouterr().err
    assert torch.equal(model.lm_head.weight, tiny_model().lm_head.weight)


def test_a_sharded_directorys_metadata_is_read_restricted(tmp_path):
    """torch.distributed.checkpoint unpickles `.metadata` unrestricted: ours reads only DCP's classes."""
    from moe.checkpoint.sharded import read_full_checkpoint

    marker, good = tmp_path / "pwned", tmp_path / "good"
    good.mkdir()
    with open(good / ".metadata", "wb") as f:  # what DCP writes: its Metadata dataclass, torch sizes, dtypes
        from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

        meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, 3]), [])
        pickle.dump(Metadata(state_dict_metadata={"model.w": meta}), f)
    check_dcp_metadata(good / ".metadata")
    evil = tmp_path / "evil.ckpt"
    shutil.copytree(good, evil)
    with open(evil / ".metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    (evil / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(PickleRefused, match="io.open. is not DCP metadata"):
        read_full_checkpoint(evil)
    assert not marker.exists()
