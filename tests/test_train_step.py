"""The optimizer step (moe.module.train_step): the module it drives reached through six declared members, a
step's rows cut into its micro-batches in order, and accumulation that equals one larger batch (each
micro-batch's loss divided once by their count)."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch
from conftest import single_process_module, trained_rows

from moe.module.train_step import StepModule, TrainStep, micro_batches

EXACT = ("moe_opt=dropless", "moe_opt.aux_loss_coeff=0", "moe_opt.z_loss_coeff=0", "trainer.max_steps=3",
         "trainer.limit_val_batches=0", "trainer.save_checkpoints=false", "optimizer.grad_clip=0.5")


def step_module_members() -> set[str]:
    """The members StepModule declares (typing.get_protocol_members from Python 3.13 on)."""
    return {name for name in {*StepModule.__annotations__, *vars(StepModule)} if not name.startswith("_")}


def test_the_step_reaches_its_module_through_at_most_six_declared_members_which_litmoe_has():
    """Whatever TrainStep reads of its module is a member of StepModule (NeuronLitMoE has them too:
    tests/test_neuron.py); the backend and the guard it asks are its own."""
    from omegaconf import OmegaConf

    from moe.config import ModelConfig, TrainConfig

    members = step_module_members()
    assert len(members) <= 6, sorted(members)
    source = ast.parse(inspect.getsource(TrainStep))
    reached = {node.attr for node in ast.walk(source) if isinstance(node, ast.Attribute)
               and ast.unparse(node.value) in ("module", "self.module")}
    assert reached == members
    cfg = OmegaConf.structured(TrainConfig(model=ModelConfig(num_layers=2), run_name="t"))
    assert members <= set(dir(single_process_module(cfg)))


def test_a_steps_rows_are_cut_into_its_micro_batches_in_order():
    rows = {"input_ids": torch.arange(12).reshape(6, 2), "labels": -torch.arange(12).reshape(6, 2)}
    parts = micro_batches(rows, 2)
    assert [p["input_ids"][:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]
    assert all(torch.equal(p["labels"], -p["input_ids"]) for p in parts)


def test_two_micro_batches_of_4_step_as_one_batch_of_8(train_here, tmp_path):
    """Without router terms (their statistics are per forward) and dropless, the mean of 2 micro-batch losses
    is the loss of their 8 rows: same losses, gradient norms (clipped at 0.5) and so the same updates."""
    one = train_here(*EXACT, "trainer.micro_batch_size=8", run_dir=tmp_path / "one")
    two = train_here(*EXACT, "trainer.micro_batch_size=4", "trainer.accumulate_grad_batches=2",
                     run_dir=tmp_path / "two")
    got, want = trained_rows(two), trained_rows(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == ["1", "2", "3"]
    for a, b in zip(got, want, strict=True):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), abs=2e-5)
        assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-4)
        assert float(b["grad_norm"]) > 0.5  # the clipping acted on every step


def _loops(automatic_steps: int, manual_steps: int, batches: int) -> dict:
    count = {"ready": batches, "completed": batches, "started": batches, "processed": batches}
    return {"fit_loop": {
        "epoch_loop.batch_progress": {"total": dict(count), "current": dict(count), "is_last_batch": False},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {"step": {
            "total": {"ready": automatic_steps, "completed": automatic_steps},
            "current": {"ready": automatic_steps, "completed": automatic_steps}}}},
        "epoch_loop.manual_optimization.optim_step_progress": {
            "total": {"ready": manual_steps, "completed": manual_steps},
            "current": {"ready": manual_steps, "completed": manual_steps}}}}


@pytest.mark.parametrize("automatic, manual", [(30, 0), (0, 30)], ids=["lit_moe", "nxd"])
def test_a_checkpoint_from_before_resumes_at_its_step(automatic, manual):
    """Saved when a batch was a micro-batch (accumulation 4): LitMoE's under automatic optimization
    (Lightning's global_step would restart at 0 under manual: the resumed run retrained from step 1), NxD's
    already manual; both continue at step 30 with 30 batches counted. Today's are left as they are."""
    from moe.module.train_step import upgrade_loop_state

    old = {"loops": _loops(automatic, manual, 120), "hyper_parameters": {"cfg": {"trainer": {
        "accumulate_grad_batches": 4}}}}
    upgrade_loop_state(old)
    loop = old["loops"]["fit_loop"]
    assert loop["epoch_loop.manual_optimization.optim_step_progress"]["total"]["completed"] == 30
    assert loop["epoch_loop.batch_progress"]["total"] == dict.fromkeys(("ready", "completed", "started",
                                                                          "processed"), 30)
    today = {"loops": _loops(0, 30, 30), "hyper_parameters": old["hyper_parameters"]}
    upgrade_loop_state(today)
    assert today["loops"] == _loops(0, 30, 30)


def test_the_settled_config_cannot_be_edited_while_the_run_trains(train_here, tmp_path):
    """After start-up the run's config is read, never edited: an assignment raises, wherever it is held."""
    from tests._edit_probe import TRIED

    run = train_here("trainer.max_steps=2", "+callbacks.edit._target_=tests._edit_probe.ConfigEditProbe",
                     run_dir=tmp_path / "run")
    assert TRIED == {"module": "FrozenInstanceError", "backend": "FrozenInstanceError"}
    assert [r["step"] for r in trained_rows(run)] == ["1", "2"]


def test_gc_every_n_steps_keeps_the_collector_out_of_the_steps(train_here, tmp_path):
    """trainer.gc_every_n_steps=2: no automatic collection while training (the collector is off as every
    batch starts): a full one before the first step, a young one after steps 2 and 4 (batches 1 and 3), a
    full one at the end, and the collector on again after the run."""
    import gc

    from tests._gc_probe import SEEN

    train_here("trainer.max_steps=4", "trainer.gc_every_n_steps=2",
               "+callbacks.gc_probe._target_=tests._gc_probe.GcProbe", run_dir=tmp_path / "run")
    assert SEEN["enabled"] == [False] * 4
    assert SEEN["collected_in"] == [(1, 1), (3, 1), (3, 2)]  # the first full one precedes the probe's hook
    assert gc.isenabled()
