"""In-run evaluation (trainer.eval_every_n_steps): training is the same with it as without, its numbers
reach metrics.csv, every logger and `python -m moe.report RUN`, and where it cannot run it is refused with
the fix."""
import csv

import pytest
from conftest import compose_cfg, trained_rows
from test_infer import SAMPLE_TOK

from moe.config.validate import validate
from moe.errors import ConfigError, UserError
from moe.tools.report import load_run, main

pytestmark = pytest.mark.usefixtures("one_thread")

# 4 steps, validation after step 2 and 4 (it draws from the same generators), small batches
RUN = ("trainer.max_steps=4", "trainer.micro_batch_size=2", "data.seq_len=64", "trainer.val_check_interval=2",
       "trainer.limit_val_batches=1", "trainer.save_checkpoints=false")
EVAL = ("trainer.eval_every_n_steps=2", "trainer.eval_tasks=[moe_tiny_mc,moe_tiny_cloze]",
        "trainer.eval_limit=3")
# what a step computes (tokens_per_s and mfu are timings)
SAME = ("loss", "lm_loss", "aux_loss", "z_loss", "drop_fraction", "max_expert_load", "router_entropy", "lr",
        "grad_norm", "tokens_per_expert")


def test_eval_every_n_steps_leaves_training_as_it_was_and_logs_to_metrics_csv_loggers_and_the_report(
        train_here, tmp_path, capsys):
    plain = train_here(*RUN, run_dir=tmp_path / "plain")
    logged = tmp_path / "csvlogger"
    evaluated = train_here(*RUN, *EVAL, "+logger.extra._target_=lightning.pytorch.loggers.CSVLogger",
                           f"+logger.extra.save_dir={logged}", run_dir=tmp_path / "evaluated")

    without, with_eval = trained_rows(plain), trained_rows(evaluated)
    assert [r["step"] for r in with_eval] == ["1", "2", "3", "4"]
    for a, b in zip(without, with_eval, strict=True):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}  # bit for bit, as written
    def val(run_dir):
        return [(r["step"], r["val_loss"]) for r in csv.DictReader((run_dir / "metrics.csv").open())
                if r["val_loss"]]

    assert val(plain) == val(evaluated) and len(val(plain)) == 2

    run = load_run(evaluated)
    names = ["moe_tiny_mc/acc", "moe_tiny_mc/acc_norm", "moe_tiny_cloze/perplexity", "moe_tiny_cloze/acc"]
    assert [step for step, _ in run.evals] == [2, 4] and all(list(v) == names for _, v in run.evals)
    for _, values in run.evals:
        assert all(0.0 <= values[n] <= 1.0 for n in names if "acc" in n) and values[names[2]] > 1.0
    lightning_rows = list(csv.DictReader(next(logged.rglob("metrics.csv")).open()))
    from_logger = {(int(r["step"]), k[len("eval/"):]): float(v)
                   for r in lightning_rows for k, v in r.items() if k.startswith("eval/") and v}
    assert from_logger == {(step, k): v for step, values in run.evals for k, v in values.items()}

    main([str(evaluated)])
    assert str(evaluated / "eval.png") in capsys.readouterr().out.split()
    md = (evaluated / "report.md").read_text()
    table = md.split("## Evaluations")[1].split("![")[0]
    assert "| step | " + " | ".join(names) + " |" in table
    last = [f"{run.evals[-1][1][n]:.4f}" for n in names]
    assert "| 4 | " + " | ".join(last) + " |" in table
    head = next(line for line in md.splitlines() if line.startswith("| run |"))
    assert "| val loss | " + " | ".join(names) + " | drop % |" in head


@pytest.mark.parametrize("overrides, said", [
    (("hardware=cpu_fsdp2", "trainer.devices=1"), "hardware.strategy=fsdp2"),
    (("trainer.devices=2", "parallel.ep=2"), "parallel.ep=2"),
], ids=["fsdp2", "expert_parallel"])
def test_where_each_rank_lacks_the_whole_model_it_is_refused_naming_the_key_and_the_fix(overrides, said):
    with pytest.raises(ConfigError) as refused:
        validate(compose_cfg("trainer.eval_every_n_steps=10", *overrides))
    text = str(refused.value)
    assert "trainer.eval_every_n_steps" in text and said in text and "python -m moe.eval" in text
    validate(compose_cfg("trainer.eval_every_n_steps=0", *overrides))  # off: the run is as before


def test_a_task_that_is_not_there_is_refused_before_the_run_starts():
    from moe.eval.in_run import InRunEval

    cfg = compose_cfg("trainer.eval_every_n_steps=10", "trainer.eval_tasks=[hellaswag]")
    with pytest.raises(UserError, match="hellaswag.*is not a task in the bundled tasks"):
        InRunEval(cfg.trainer, SAMPLE_TOK, 0)


@pytest.mark.slow
def test_on_two_ddp_ranks_each_evaluates_and_training_is_as_without(train_run, tmp_path):
    """trainer.devices=2 on the CPU (gloo): every rank evaluates its replica (lm_eval hands results only to
    LOCAL_RANK 0, which each rank is meanwhile), rank 0 writes the rows, and training is as without."""
    two = (*RUN, "trainer.devices=2")
    plain, _ = train_run(*two, run_dir=tmp_path / "plain")
    evaluated, _ = train_run(*two, *EVAL, run_dir=tmp_path / "evaluated")
    for a, b in zip(trained_rows(plain), trained_rows(evaluated), strict=True):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
    assert [step for step, _ in load_run(evaluated).evals] == [2, 4]
