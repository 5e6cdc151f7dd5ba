"""train.py with an injected loss spike, for multi-process tests (Lightning's DDP launcher re-runs
this file for every rank, so each rank is patched): MOE_TEST_SPIKE_STEP=N multiplies the training
loss of optimizer step N by 50 on every rank."""
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe.module.lit_moe import LitMoE  # noqa: E402

SPIKE_STEP = int(os.environ["MOE_TEST_SPIKE_STEP"])
_losses = LitMoE.losses


def spiky_losses(self, batch):
    loss, lm_loss, out = _losses(self, batch)
    if self.training and self.trainer.global_step + 1 == SPIKE_STEP:
        loss = loss * 50.0
    return loss, lm_loss, out


LitMoE.losses = spiky_losses
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
