"""Train an MoE language model: `python train.py [group=preset ...] [key=value ...]`.

Examples:
    python train.py                                    # tiny model, bundled data, CPU
    python train.py parallel=dp2 trainer.devices=2      # 2-process DDP over gloo
    python train.py experiment=karakuri_8x7b_trn1 dry_run=true        # the trn1 plan, 16 nodes
    python train.py simulate=true experiment=...       # the real parallelize on fake tensors
    python train.py -m moe_opt.capacity_factor=1.0,1.25,1.5,2.0
"""
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import moe.config  # noqa: F401  (registers the typed schemas with Hydra)
from moe.errors import exit_on_user_error
from moe.train.preflight import preflight

FAILED_JOBS: list[str] = []  # sweep jobs of this process that stopped on an error (the sweep goes on)


def plan(settled, run_dir: str) -> None:
    """dry_run=true prints the layout and memory plan; simulate=true runs the real parallelize on fake
    tensors and writes simulation.json into the run dir (`settled`: moe.train.run.settle's)."""
    cfg, dims = settled.config, settled.dims
    if cfg.dry_run:
        from moe.tools.plan import make_plan

        print(make_plan(cfg, dims).render())
    else:
        from moe.errors import on_interrupt
        from moe.tools.simulate import simulate

        with on_interrupt(f"the simulation stopped; {Path(run_dir) / 'simulation.json'} was not written"):
            print(simulate(cfg, dims, run_dir).render())
        print(f"wrote {Path(run_dir) / 'simulation.json'}")


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Returns the final validation loss (else training loss) for sweepers such as Optuna. In a sweep a
    job that stops on an error is recorded (its train.log and the sweep's report say why) and the next
    job runs; the sweep exits 1 at the end, naming the failed jobs."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        return exit_on_user_error(job)(cfg)
    try:
        return job(cfg)
    except Exception as err:  # a UserError's paragraph, or an unexpected error's first line
        from moe.errors import UserError, log_to_files

        run_dir = HydraConfig.get().runtime.output_dir
        what = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
        log_to_files(f"error: {what}", exc_info=None if isinstance(err, UserError) else sys.exc_info())
        print(f"error: sweep job {HydraConfig.get().job.num} ({run_dir}) failed: {what}", file=sys.stderr)
        FAILED_JOBS.append(f"job {HydraConfig.get().job.num} ({run_dir})")
        return None


def job(cfg: DictConfig) -> float | None:
    """One run: a plan (dry run, simulation) or a training run."""
    from moe.eval.in_run import InRunEval
    from moe.train.console import say
    from moe.train.run import objective, settle, train

    run_dir = HydraConfig.get().runtime.output_dir
    if cfg.dry_run or cfg.simulate:  # a simulation, or a dry run inside a multirun
        settled = settle(cfg)
        for note in settled.notes:
            say(note)
        plan(settled, run_dir)
        return None
    return objective(train(cfg, run_dir=run_dir, in_run_eval=InRunEval))


if __name__ == "__main__":
    settled = preflight(sys.argv[1:], str(Path(__file__).resolve().parent / "conf"))  # errors: exit 2, no dir
    if settled is not None and settled.config.dry_run:  # the plan, before Hydra makes a run dir
        plan(settled, run_dir="")
        sys.exit(0)
    main()
    if FAILED_JOBS:
        print(f"error: {len(FAILED_JOBS)} sweep job(s) failed: {', '.join(FAILED_JOBS)}; the others "
              "finished. python -m moe.report <sweep dir> tabulates every job and why each failed one "
              "stopped", file=sys.stderr)
        sys.exit(1)
