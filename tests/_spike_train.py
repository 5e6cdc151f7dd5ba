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
_micro_batch_loss = LitMoE.micro_batch_loss


def spiky_micro_batch_loss(self, batch):
    loss, lm_loss, routing, mtp_loss = _micro_batch_loss(self, batch)
    if self.trainer.global_step + 1 == SPIKE_STEP:
        loss = loss * 50.0
    return loss, lm_loss, routing, mtp_loss


LitMoE.micro_batch_loss = spiky_micro_batch_loss
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
