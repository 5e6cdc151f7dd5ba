"""data_prep throughput beside the tokenizer's raw speed and the standard `datasets` recipe, and its
peak memory as the corpus grows.

    python bench/data_prep.py [--mb 20] [--num-proc 1] [--tokenizer data/sample] [--seq-len 2048]
    python bench/data_prep.py --memory 10,40,160 [--with-hf] [--num-proc 1]

Throughput (default): writes a text corpus (the sample generator, more documents) and times, alternating
--repeats times and keeping the best of each:
  raw        the tokenizer's own `encode_batch_fast` over the lines batch by batch, ids in hand;
  data_prep  the whole `prepare()` (load, render, tokenize, split, pack, write Arrow + meta.json);
  HF recipe  the run_clm recipe at the same num_proc: `load_dataset("text")`, `ds.map(tokenize,
             batched=True, num_proc=N, remove_columns=...)` with transformers' fast tokenizer (ids + EOS,
             no attention mask), `ds.map(group_texts, batched=True, num_proc=N)` (concatenate each map
             batch and cut it into seq_len + 1 blocks), `save_to_disk`.
It prints tokens/s for each (wall and per CPU second, map workers included) and the ratios
(targets: data_prep >= 0.8x raw, >= 0.9x the HF recipe).

Memory (--memory MB,MB,... [--with-hf]): runs prepare() (and the HF recipe) on corpora of those sizes,
each in a fresh child process, and prints the child's peak RSS (the kernel's high-water mark, os.wait4's
ru_maxrss, memory-mapped Arrow pages it read included) and its peak anonymous memory (RssAnon, sampled
every 10 ms: what it allocated itself), beside its RSS after imports.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from itertools import chain
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moe.data import prepare  # noqa: E402
from moe.data.sample_corpus import corpus_lines  # noqa: E402
from moe.data.tokenizer import read_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> float:
    """CPU time of this process's threads and of finished child processes (num_proc workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def write_corpus(path: Path, megabytes: float) -> int:
    """Write ~megabytes of sample documents, one a line, chunk by chunk; returns the line count."""
    size, seed, count = 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            chunk = corpus_lines(seed=seed, num_docs=2000)
            text = "\n".join(chunk) + "\n"
            f.write(text)
            size += len(text.encode())
            count += len(chunk)
            seed += 1
    return count


def raw_encode(tokenizer_dir: str, lines: list[str], batch_size: int) -> tuple[int, float, float]:
    """(tokens, wall s, cpu s) of the tokenizer's own batch encode over the lines, ids in hand."""
    tok, _ = read_tokenizer(tokenizer_dir)
    wall, cpu = time.perf_counter(), cpu_seconds()
    tokens = 0
    for i in range(0, len(lines), batch_size):
        ids = [e.ids for e in tok.encode_batch_fast(lines[i:i + batch_size], add_special_tokens=False)]
        tokens += sum(map(len, ids))
    return tokens, time.perf_counter() - wall, cpu_seconds() - cpu


def prep_config(src: Path, out: Path, args) -> dict:
    return {"input": str(src), "output": str(out), "tokenizer": args.tokenizer, "seq_len": args.seq_len,
            "val_fraction": 0.1, "num_proc": args.num_proc, "batch_size": args.batch_size}


def end_to_end(src: Path, out: Path, args) -> tuple[dict, float, float]:
    """(meta, wall s, cpu s) of prepare() on the same file."""
    shutil.rmtree(out, ignore_errors=True)
    wall, cpu = time.perf_counter(), cpu_seconds()
    prepare(prep_config(src, out, args), progress=False)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    return json.loads((out / "meta.json").read_text()), wall, cpu


def hf_recipe(src: Path, out: Path, args) -> tuple[int, float, float]:
    """(tokens, wall s, cpu s) of the run_clm recipe on the same file, in a fresh datasets cache."""
    import datasets
    from transformers import AutoTokenizer

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    num_proc = args.num_proc if args.num_proc > 1 else None
    block_size = args.seq_len + 1
    if num_proc:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as transformers asks of forked map workers
    wall, cpu = time.perf_counter(), cpu_seconds()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = tokenizer.eos_token_id
    ds = datasets.load_dataset("text", data_files=str(src), split="train", cache_dir=str(out / "cache"))

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return {"input_ids": [row + [eos] for row in ids]}

    def group_texts(batch):  # run_clm's, on input_ids only (labels are input_ids shifted at training)
        concatenated = list(chain(*batch["input_ids"]))
        total = len(concatenated) // block_size * block_size
        return {"input_ids": [concatenated[i:i + block_size] for i in range(0, total, block_size)]}

    tokenized = ds.map(tokenize, batched=True, batch_size=args.batch_size, num_proc=num_proc,
                       remove_columns=ds.column_names)
    blocks = tokenized.map(group_texts, batched=True, batch_size=args.batch_size, num_proc=num_proc)
    blocks.save_to_disk(str(out / "saved"))
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    import pyarrow.compute as pc
    tokens = int(pc.sum(pc.list_value_length(tokenized.data.column("input_ids"))).as_py()) - len(tokenized)
    return tokens, wall, cpu


def throughput(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_data_prep_"))
    try:
        src = work / "corpus.txt"
        n_lines = write_corpus(src, args.mb)
        lines = src.read_text(encoding="utf-8").splitlines()
        raw, e2e, peer = [], [], []
        for _ in range(args.repeats):  # alternate, keep the best of each: robust to a busy machine
            raw.append(raw_encode(args.tokenizer, lines, args.batch_size))
            e2e.append(end_to_end(src, work / "out", args))
            peer.append(hf_recipe(src, work / "peer", args))
        raw_tokens = raw[0][0]
        meta = e2e[0][0]
        e2e_tokens = meta["tokens"]["tokens_in"] - n_lines  # without the EOS we add, as raw counts
        assert e2e_tokens == raw_tokens == peer[0][0], (e2e_tokens, raw_tokens, peer[0][0])
        best = {name: (min(r[1] for r in runs), min(r[2] for r in runs))
                for name, runs in (("raw", raw), ("e2e", e2e), ("peer", peer))}
        print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}; "
              f"corpus {src.stat().st_size / 1e6:.1f} MB, {n_lines:,} lines, {raw_tokens:,} tokens; "
              f"tokenizer {args.tokenizer} (vocab {meta['tokenizer']['vocab_size']}); "
              f"num_proc {args.num_proc}; best of {args.repeats}")
        print(f"{'':26} {'M tok/s (wall)':>15} {'M tok/cpu-s':>12}")
        m = raw_tokens / 1e6
        for name, label in (("raw", "raw encode_batch_fast"), ("e2e", "data_prep end-to-end"),
                            ("peer", "HF recipe (map+group)")):
            print(f"{label:26} {m / best[name][0]:15.3f} {m / best[name][1]:12.3f}")
        for name, label, target in (("raw", "data_prep / raw", "0.80x"),
                                    ("peer", "data_prep / HF recipe", "0.90x")):
            wall_ratio, cpu_ratio = best[name][0] / best["e2e"][0], best[name][1] / best["e2e"][1]
            print(f"{label:26} {wall_ratio:14.2f}x {cpu_ratio:11.2f}x   (target >= {target})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_child(args) -> None:
    """Run prepare() once here and print {"baseline_kib", "anon_peak_kib", "tokens"} as JSON."""
    baseline = rss_kib("VmRSS")
    peak, done = [rss_kib("RssAnon")], threading.Event()

    def sample():
        while not done.wait(0.01):
            peak[0] = max(peak[0], rss_kib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    src, out = Path(args.src), Path(args.out)
    if args.memory_child == "hf":
        tokens = hf_recipe(src, out, args)[0]
    else:
        prepare(prep_config(src, out, args), progress=False)
        meta = json.loads((out / "meta.json").read_text())
        tokens = meta["tokens"]["tokens_in"] - meta["rows"]["used"]  # without the EOS, as the HF side counts
    done.set()
    sampler.join()
    print(json.dumps({"baseline_kib": baseline, "anon_peak_kib": peak[0], "tokens": tokens}))


def peak_memory(side: str, src: Path, out: Path, args) -> tuple[dict, int, float]:
    """(the child's JSON, its ru_maxrss in KiB, wall s) of one run of `side` in a fresh process."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--memory-child", side, "--src", str(src), "--out", str(out),
           "--num-proc", str(args.num_proc), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--tokenizer", args.tokenizer]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own high-water mark, not the parent's
    wall = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the {side} child failed on {src}")
    return json.loads(stdout.strip().splitlines()[-1]), usage.ru_maxrss, wall


def memory(args) -> None:
    sizes = [float(x) for x in args.memory.split(",")]
    sides = ["data_prep", "hf"] if args.with_hf else ["data_prep"]
    work = Path(tempfile.mkdtemp(prefix="bench_data_prep_mem_"))
    try:
        print(f"machine: {platform.machine()}, {os.cpu_count()} cpus; each run in a fresh process, "
              f"num_proc {args.num_proc}, seq_len {args.seq_len}, tokenizer {args.tokenizer}")
        print(f"{'':10} {'corpus MB':>9} {'M tokens':>9} {'RSS after imports MiB':>22} {'peak RSS MiB':>13} "
              f"{'peak anon MiB':>14} {'wall s':>7}")
        for mb in sizes:
            src = work / "corpus.txt"
            write_corpus(src, mb)
            for side in sides:
                got, maxrss, wall = peak_memory(side, src, work / "out", args)
                mib = {k: got[k] / 1024 for k in ("baseline_kib", "anon_peak_kib")}
                print(f"{side:10} {src.stat().st_size / 1e6:9.1f} {got['tokens'] / 1e6:9.2f} "
                      f"{mib['baseline_kib']:22.0f} {maxrss / 1024:13.0f} {mib['anon_peak_kib']:14.0f} "
                      f"{wall:7.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=20.0, help="corpus size in MB (throughput)")
    ap.add_argument("--memory", help="comma-separated corpus sizes in MB: peak memory of prepare() at each")
    ap.add_argument("--tokenizer", default=str(REPO / "data" / "sample"))
    ap.add_argument("--num-proc", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-hf", action="store_true", help="--memory: the HF recipe's peak memory too")
    ap.add_argument("--memory-child", choices=["data_prep", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args)
    elif args.memory:
        memory(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
