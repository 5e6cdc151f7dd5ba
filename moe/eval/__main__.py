"""Evaluate a checkpoint, a run or a Hugging Face directory: `python -m moe.eval key=value ...`.

Examples:
    python -m moe.eval ckpt=runs/my_run                     # the bundled tasks; writes runs/my_run/eval.json
    python -m moe.eval ckpt=last perplexity_file=heldout.txt
    python -m moe.eval hf_dir=exports/tiny task_dirs=[~/lm_eval_local] tasks=[arc_easy_local] output=arc.json
Keys: moe/config/eval.py (EvalConfig); guide: docs/EVALUATION.md.
"""
import sys

import hydra
from omegaconf import DictConfig

import moe.config.eval  # noqa: F401  (registers the typed schema with Hydra)
from moe.errors import exit_on_user_error
from moe.paths import REPO_ROOT

CONF_DIR = str(REPO_ROOT / "conf")


@hydra.main(config_path=CONF_DIR, config_name="eval", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from moe.eval.command import run

    run(cfg)


if __name__ == "__main__":
    from moe.train.preflight import check_composes

    # a composition error (unknown key, YAML slip): one paragraph, exit 2
    check_composes(sys.argv[1:], CONF_DIR, "eval", "-m moe.eval")
    main()
