"""Train an MoE language model: `python train.py [group=preset ...] [key=value ...]`.

Examples:
    python train.py                                    # tiny model, bundled data, CPU
    python train.py parallel=dp2 trainer.devices=2      # 2-process DDP over gloo
    python train.py experiment=karakuri_8x7b_trn1 dry_run=true        # the trn1 plan, 16 nodes
    python train.py -m moe_opt.capacity_factor=1.0,1.25,1.5,2.0
"""
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import moe.config  # noqa: F401  (registers the typed schemas with Hydra)
from moe.errors import exit_on_user_error
from moe.train.preflight import preflight


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> float | None:
    """Returns the final validation loss (else training loss) for sweepers such as Optuna."""
    from moe.train.run import objective, train

    return objective(train(cfg, run_dir=HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    preflight(sys.argv[1:], str(Path(__file__).resolve().parent / "conf"))  # config errors: exit 2, no dir
    main()
