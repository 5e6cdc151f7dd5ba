"""Generate from a checkpoint or a Mixtral / DeepSeek-V3 directory, or export one:
`python infer.py key=value ...`.

Examples:
    python infer.py ckpt=last prompt="Once upon a time"
    python infer.py ckpt=runs/my_run prompts_file=prompts.txt chat=true temperature=0.8 top_p=0.9
    python infer.py ckpt=last export_hf=exports/tiny        # Mixtral/DeepseekV3ForCausalLM loads it
    python infer.py hf_dir=exports/tiny prompt="Hello"
Keys: moe/config/infer.py (InferConfig); guide: docs/INFERENCE.md.
"""
import hydra
from omegaconf import DictConfig

import moe.config.infer  # noqa: F401  (registers the typed schema with Hydra)
from moe.errors import exit_on_user_error


@hydra.main(config_path="conf", config_name="infer", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from moe.infer.command import run

    run(cfg)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    from moe.train.preflight import check_composes

    # a composition error (unknown key, YAML slip, a config file in another encoding): one paragraph, exit 2
    check_composes(sys.argv[1:], str(Path(__file__).resolve().parent / "conf"), "infer", "infer.py")
    main()
