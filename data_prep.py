"""Prepare training data: `python data_prep.py input=PATH format=text|chat|sentence output=DIR ...`.

Examples:
    python data_prep.py input=corpus.jsonl output=data/prepared/corpus tokenizer=data/sample seq_len=512
    python data_prep.py input='shards/*.txt' output=DIR vocab_size=32000 num_proc=8   # train a BPE too
    python data_prep.py data=sample_chat                                        # a preset
Then: python train.py data=prepared data.path=DIR. Keys and outputs: docs/DATA.md.
"""
import hydra
from omegaconf import DictConfig

import moe.config.data_prep  # noqa: F401  (registers data_prep_schema with Hydra)
from moe.errors import exit_on_user_error


@hydra.main(config_path="conf/data_prep", config_name="data_prep", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    import json

    from moe.data.prep_pipeline import prepare

    out = prepare(cfg)
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["tokens"]
    splits = meta["splits"]
    print(f"wrote {out}: {splits['train']['blocks']} train + {splits['validation']['blocks']} "
          f"validation blocks of {meta['seq_len']}+1 tokens; {tokens['tokens_in']} tokens in, "
          f"{tokens['tail_tokens_dropped']} tail dropped; rows skipped: {meta['rows']['skipped'] or 'none'}")
    print(f"train on it: python train.py data=prepared data.path={out}")


if __name__ == "__main__":
    import sys
    from pathlib import Path

    from moe.train.preflight import check_composes

    # a composition error (unknown key, YAML slip, a config file in another encoding): one paragraph, exit 2
    conf = Path(__file__).resolve().parent / "conf" / "data_prep"
    check_composes(sys.argv[1:], str(conf), "data_prep", "data_prep.py")
    main()
