"""Peak host memory of one pass of streaming (data.streaming=true) against online packing, by corpus size.

    python bench/streaming_memory.py [--mb 5 20] [--seq-len 2048]

For each size, writes a text corpus (the sample generator), then in a fresh process each: **online**
packs the corpus into its cache (moe.data.prepare, what data=online runs at start-up) and **streaming**
takes as many training blocks as that packed, through the default shuffle buffer of 1024 blocks
(moe.data.streaming.BlockStream.train, what data.streaming=true trains on; each block in hand, then
dropped). Prints each process's RSS after its imports (torch among them, as in training), its peak RSS
(ru_maxrss), the blocks and the wall time. Streaming's peak should not grow with the corpus.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def measure(mode: str, corpus: str, work: str, seq_len: int, blocks: int) -> dict:
    """In this process: one online packing, or `blocks` blocks of the shuffled stream."""
    import torch  # noqa: F401  (a training process has it; `datasets` streaming imports it otherwise)

    from moe.config.data_prep import PrepConfig
    from moe.data import prepare
    from moe.data.streaming import BlockSource, BlockStream

    prep = PrepConfig(input=corpus, tokenizer=str(REPO / "data" / "sample"), seq_len=seq_len,
                      val_fraction=0.0, output=str(Path(work) / "prep"))
    base, start = rss_mb(), time.perf_counter()
    if mode == "streaming":
        stream = BlockStream(BlockSource(prep), val_blocks=0, shuffle=True, buffer=1024, seed=0)
        for _ in islice(stream.train(), blocks):
            pass
    else:
        out = prepare(prep, progress=False)
        blocks = json.loads((out / "meta.json").read_text())["splits"]["train"]["blocks"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "after_imports_mb": round(base), "peak_mb": round(peak), "blocks": blocks,
            "wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, nargs="+", default=[5, 20])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # mode corpus work blocks: the child
    args = parser.parse_args()
    if args.one:
        mode, corpus, work, blocks = args.one
        print(json.dumps(measure(mode, corpus, work, args.seq_len, int(blocks))))
        return
    from bench.data_prep import write_corpus

    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.mb:
            corpus = Path(tmp) / f"corpus{mb:g}.txt"
            write_corpus(corpus, mb)
            blocks = 0
            for mode in ("online", "streaming"):
                work = tempfile.mkdtemp(dir=tmp)
                command = [sys.executable, __file__, "--seq-len", str(args.seq_len), "--one", mode,
                           str(corpus), work, str(blocks)]
                line = subprocess.run(command, check=True, capture_output=True, text=True,
                                      cwd=REPO).stdout.strip().splitlines()[-1]
                result = json.loads(line)
                blocks = result["blocks"]
                print(json.dumps({"corpus_mb": mb, **result}), flush=True)


if __name__ == "__main__":
    main()
