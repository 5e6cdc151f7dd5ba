"""data_prep pipeline: raw rows -> tokenizer -> token rows -> split -> packed blocks -> output dir.

Everything is written under a hidden temporary directory beside the output and renamed
at the end, meta.json last, so an interrupted run never leaves a directory that looks
complete. The same config gives byte-identical output (no timestamps; the validation
split and every fingerprint derive from the config and the inputs).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from moe.config.data_prep import PrepConfig
from moe.config.rules.entries import validate_prep
from moe.config.schema import TOKENIZER_TEMPLATE
from moe.data import tokenizer as tk
from moe.data.arrow_io import SPLITS, SplitWriter, save_splits, token_dtype
from moe.data.packing import ConcatPacker, PadPacker
from moe.data.sources import RawData, load_raw
from moe.data.text_formats import BENIGN, FormatSpec, check_columns, needed_columns, render_batch
from moe.data.tokenizer_chat import NOT_PREFIX, ChatTemplateEncoder, load_template_tokenizer, template_text
from moe.errors import UserError, WriteFailed, on_interrupt, write_errno, write_failed
from moe.outputs import PREPARED_DATA, check_output, mark, publish

META_VERSION = 1
# Config keys that cannot change the blocks; left out of meta.json and of fingerprints.
NOT_CONTENT = ("output", "overwrite", "num_proc", "batch_size", "cache_dir")


class Encoder:
    """Batched map function: render rows, tokenize, append EOS; masks from assistant spans."""

    def __init__(self, tok, spec: FormatSpec, eos_id: int, with_mask: bool, columns: list[str],
                 chat: ChatTemplateEncoder | None = None):
        self.tok, self.spec, self.eos_id, self.with_mask, self.columns = tok, spec, eos_id, with_mask, columns
        self.chat = chat  # chat_template=tokenizer: rows rendered with the tokenizer's own template

    def __call__(self, *columns: list) -> pa.Table:
        if self.chat is not None:
            return self._table(*self._encode_with_template(columns))
        texts, spans, reasons = render_batch(dict(zip(self.columns, columns, strict=True)), self.spec)
        keep = [i for i, t in enumerate(texts) if t is not None]
        good = [texts[i] for i in keep]
        encode = self.tok.encode_batch if self.with_mask else self.tok.encode_batch_fast
        encs = encode(good, add_special_tokens=False)
        ids: list[list[int]] = [[] for _ in texts]
        masks: list[list[int]] = [[] for _ in texts]
        for i, enc in zip(keep, encs, strict=True):
            ids[i] = enc.ids + [self.eos_id]
            if self.with_mask:
                starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(enc.ids))
                m = np.zeros(len(starts), dtype=np.uint8)
                for a, b in spans[i]:
                    m |= (starts >= a) & (starts < b)
                masks[i] = m.tolist() + [1]  # EOS closes the assistant's last turn: trained
        return self._table(ids, masks, reasons)

    def _encode_with_template(self, columns) -> tuple[list, list, list]:
        ids, masks, reasons = [], [], []
        for values in zip(*columns, strict=True):
            row_ids, row_mask, reason = self.chat.encode(dict(zip(self.columns, values, strict=True)))
            ids.append(row_ids)
            masks.append(row_mask)
            reasons.append(reason)
        return ids, masks, reasons

    def _table(self, ids: list, masks: list, reasons: list) -> pa.Table:
        # Arrow arrays built here skip datasets' per-value type inference (a few % of the run).
        out = {"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
               "skip": pa.array(reasons, type=pa.string())}
        if self.with_mask:
            out["loss_mask"] = pa.array(masks, type=pa.list_(pa.uint8()))
        return pa.table(out)


def _features(with_mask: bool) -> datasets.Features:
    cols = {"input_ids": datasets.List(datasets.Value("int32")), "skip": datasets.Value("string")}
    if with_mask:
        cols["loss_mask"] = datasets.List(datasets.Value("uint8"))
    return datasets.Features(cols)


def content_config(cfg: PrepConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_CONTENT}


def digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _as_prep_config(cfg) -> PrepConfig:
    if isinstance(cfg, PrepConfig):
        return cfg
    if isinstance(cfg, DictConfig):
        missing = [k for k in cfg if OmegaConf.is_missing(cfg, k)]
        if missing:
            raise UserError(missing[0], "???", f"pass {missing[0]}=VALUE on the command line",
                            problem="is required by this preset")
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = dict(cfg)
    if cfg.get("input") is not None and not isinstance(cfg["input"], str):
        cfg["input"] = list(cfg["input"])
    known = {f.name for f in dataclasses.fields(PrepConfig)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise UserError(unknown[0], cfg[unknown[0]], f"use one of {sorted(known)}",
                        problem="is not a data_prep key")
    return PrepConfig(**cfg)


def _texts_for_training(raw: datasets.Dataset, spec: FormatSpec, batch_size: int, markers: list[str]):
    """Rendered texts of the good rows, special markers removed (they become whole tokens anyway)."""
    for batch in raw.select_columns(needed_columns(spec, raw.column_names)).iter(batch_size=batch_size):
        for text in render_batch(batch, spec)[0]:
            if text is not None:
                for m in markers:
                    text = text.replace(m, "")
                yield text


def prep_tokenizer(cfg: PrepConfig, raw: datasets.Dataset | None, spec: FormatSpec, markers: list[str],
                   progress: bool):
    """(tokenizer, eos token, pad token or None, specials added for the template, where it came from).
    `raw` is read only to train a BPE (no cfg.tokenizer)."""
    if cfg.tokenizer is not None:
        tok, tcfg = tk.read_tokenizer(cfg.tokenizer)
        source = str(cfg.tokenizer)
    else:
        specials = list(dict.fromkeys([cfg.eos_token or tk.EOS, tk.PAD, *markers]))
        tok = tk.train_bpe(_texts_for_training(raw, spec, cfg.batch_size, markers), cfg.vocab_size, specials,
                           length=len(raw), show_progress=progress)
        tcfg = {"eos_token": specials[0], "pad_token": tk.PAD}
        source = f"trained byte-level BPE (vocab_size={cfg.vocab_size})"
    added = tk.add_special_tokens(tok, markers) if markers else []
    eos = tk.find_token(tok, tcfg, "eos_token", tk.EOS_CANDIDATES, cfg.eos_token)
    if eos is None:
        raise UserError("eos_token", None, "pass eos_token=TOKEN naming the tokenizer's end-of-text token",
                        problem=f"could not be found in {cfg.tokenizer} (no eos_token in "
                        f"tokenizer_config.json and none of {list(tk.EOS_CANDIDATES)} in the vocabulary)")
    pad = tk.find_token(tok, tcfg, "pad_token", tk.PAD_CANDIDATES)
    return tok, eos, pad, added, source


def _count_skips(col: pa.ChunkedArray) -> Counter:
    counts = Counter()
    for item in pc.value_counts(col.drop_null()).to_pylist():
        counts[item["values"]] = item["counts"]
    return counts


def _split_rows(usable: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """Per row: 0 = train, 1 = validation, -1 = unused (`usable`: a bool a row). Validation rows are a seeded
    random share of the usable ones. Per-row state is a byte a row, but for the seeded permutation that picks
    them (4 bytes a usable row), which lives only in here: what the byte-identical choice costs."""
    n = int(usable.sum())
    n_val = int(np.ceil(val_fraction * n)) if val_fraction > 0 else 0
    if val_fraction > 0 and n_val >= n:
        raise UserError("val_fraction", val_fraction,
                        "add rows or lower val_fraction (or 0 for no validation)",
                        problem=f"leaves no training rows out of {n}")
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.default_rng(seed).shuffle(order)  # rng.permutation(n)'s order (it shuffles an int64 arange)
    split = np.zeros(n, dtype=np.int8)  # by usable row, in file order
    split[order[:n_val]] = 1
    assign = np.full(len(usable), -1, dtype=np.int8)
    assign[usable] = split
    return assign


def _flat(chunk: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, per-row lengths) of a list chunk, zero-copy."""
    offsets = chunk.offsets.to_numpy()
    return chunk.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]], np.diff(offsets)


def _token_batches(tokenized: datasets.Dataset, table: pa.Table):
    """The token rows' record batches in file order, each read from the map's Arrow files when packing
    reaches it rather than through their memory map: a packed batch's pages leave the process, so its
    resident memory does not grow with the split."""
    files = [f["filename"] for f in tokenized.cache_files]
    if not files:
        yield from table.to_batches()
    for name in files:
        with pa.OSFile(name) as f:
            yield from pa.ipc.open_stream(f)


def _pack(batches, assign: np.ndarray, packers: list, writers: list, progress: bool) -> None:
    """One pass over the token rows in file order; each split's rows go to its packer and writer."""
    bar = tqdm(total=len(assign), desc="Packing", unit=" rows", disable=not progress)
    row = 0
    for batch in batches:
        ids, lengths = _flat(batch.column("input_ids"))
        mask = _flat(batch.column("loss_mask"))[0] if "loss_mask" in batch.schema.names else None
        split_of_row = assign[row:row + len(lengths)]
        for split, (packer, writer) in enumerate(zip(packers, writers, strict=True)):
            rows = split_of_row == split
            if rows.any():
                tokens = np.repeat(rows, lengths)
                row_mask = mask[tokens] if mask is not None else None
                writer.write(*packer.add(ids[tokens], row_mask, lengths[rows]))
        row += len(lengths)
        bar.update(len(lengths))
    bar.close()
    if row != len(assign):
        raise RuntimeError(f"packing read {row} token rows of {len(assign)}")


def build(cfg: PrepConfig, out_dir: Path, work: Path, progress: bool = True) -> dict:
    """Write splits + tokenizer into out_dir (using work for intermediates); returns the meta dict."""
    own_template = cfg.format == "chat" and cfg.chat_template == TOKENIZER_TEMPLATE
    hf = load_template_tokenizer(cfg.tokenizer) if own_template else None  # refused before reading input
    raw: RawData = load_raw(cfg.input, on_bad_row=cfg.on_bad_row, work_dir=work, num_proc=cfg.num_proc,
                            split=cfg.split, hub_config=cfg.hub_config, cache_dir=cfg.cache_dir)
    if len(raw.dataset) == 0:
        raise UserError("input", cfg.input, "point input at files with rows in them", problem="has no rows")
    spec = FormatSpec(cfg.format, cfg.text_column, cfg.chat_template, blank_lines_ok=raw.kind == "text")
    check_columns(spec, raw.dataset.column_names)
    markers = tk.template_markers(cfg.chat_template) if cfg.format == "chat" else []
    tok, eos, pad, added, tok_source = prep_tokenizer(cfg, raw.dataset, spec, markers, progress)
    # the template (and the BOS it writes) travel with the tokenizer: inference renders as training did
    kept = {"chat_template": template_text(hf), "bos_token": hf.bos_token} if hf is not None else {}
    tok_sha = tk.save_tokenizer(tok, out_dir / "tokenizer", eos=eos, pad=pad, model_max_length=cfg.seq_len,
                                config_extra={k: v for k, v in kept.items() if v is not None})
    vocab = tk.vocab_size(tok)
    eos_id, pad_id = tok.token_to_id(eos), tok.token_to_id(pad or eos)

    fingerprint = digest(content_config(cfg), raw.sources, tok_sha, *([template_text(hf)] if hf else []))
    chat = ChatTemplateEncoder(tok, cfg.tokenizer, eos_id) if hf is not None else None
    with_mask = cfg.assistant_only_loss
    columns = needed_columns(spec, raw.dataset.column_names)
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    if cfg.num_proc > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # forked workers each encode serially
    try:
        tokenized = raw.dataset.map(
            Encoder(tok, spec, eos_id, with_mask, columns, chat), input_columns=columns, batched=True,
            batch_size=cfg.batch_size, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
            remove_columns=raw.dataset.column_names, features=_features(with_mask),
            cache_file_name=str(work / "tokenized.arrow"), new_fingerprint=fingerprint[:32],
            desc="Tokenizing")
    finally:
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    table = tokenized.data.table if hasattr(tokenized.data, "table") else tokenized.data

    skips = _count_skips(table.column("skip"))
    reasons = table.column("skip").to_pylist() if any(k not in BENIGN for k in skips) else []
    if skips.get(NOT_PREFIX):  # the template's fault, not the rows': refused whatever on_bad_row says
        first = reasons.index(NOT_PREFIX)
        raise UserError("chat_template", cfg.chat_template, "use a template that renders a conversation's "
                        "earlier turns the same whatever follows them (edit chat_template in "
                        f"{cfg.tokenizer}/tokenizer_config.json), or set chat_template to a "
                        "{prompt}/{completion} template",
                        problem=f"renders {skips[NOT_PREFIX]} row(s) so that a conversation's first turns "
                        "are not a prefix of the whole, and their loss masks cannot be found; the first is "
                        f"row {first} (0-based, in file order): {chat.explain(raw.dataset[first])}")
    bad = {k: v for k, v in skips.items() if k not in BENIGN}
    if bad and cfg.on_bad_row == "error":
        first, reason = next((i, r) for i, r in enumerate(reasons) if r is not None and r not in BENIGN)
        if chat is not None:
            reason = chat.explain(raw.dataset[first])
        raise UserError("input", cfg.input, "fix those rows, or pass on_bad_row=skip to drop them "
                        "(counted in meta.json)", problem=f"has {sum(bad.values())} bad rows ({dict(bad)}); "
                        f"the first is row {first} (0-based, in file order): {reason}")
    skips.update(raw.skipped)
    rows_read = len(raw.dataset) + sum(raw.skipped.values())
    raw.dataset = None  # unmapped: the pages of the input the map read leave the process before packing
    del reasons  # a string a row: not kept through packing
    usable = pc.greater(pc.list_value_length(table.column("input_ids")), 0).to_numpy(zero_copy_only=False)
    rows_used = int(usable.sum())
    if not rows_used:
        raise UserError("input", cfg.input, "check format/text_column match the data",
                        problem=f"has no usable rows (skipped: {dict(skips)})")
    assign = _split_rows(usable, cfg.val_fraction, cfg.seed)
    del usable

    dtype = token_dtype(vocab)
    block_len = cfg.seq_len + 1
    stored_mask = with_mask or cfg.packing == "pad"
    packers = [ConcatPacker(block_len, with_mask) if cfg.packing == "concat" else PadPacker(block_len, pad_id)
               for _ in SPLITS]
    # rows of the tokenizer's own template may hold EOS inside: where each starts is recorded (document_mask)
    writers = [SplitWriter(work / f"{name}.arrow", block_len, dtype, stored_mask, with_starts=own_template)
               for name in SPLITS]
    _pack(_token_batches(tokenized, table), assign, packers, writers, progress)
    split_stats, split_ds = {}, {}
    for split, name in enumerate(SPLITS):
        stats = packers[split].finish()
        split_stats[name] = stats.as_dict()
        split_ds[name] = writers[split].close(name, digest(fingerprint, name)[:32])
        if stats.blocks == 0 and (name == "train" or stats.rows):
            more = "add data" if name == "train" else "raise val_fraction"
            raise UserError("seq_len", cfg.seq_len, f"lower seq_len, {more}, or use packing=pad",
                            problem=f"is too long: the {name} split has {stats.tokens_in} tokens, fewer "
                            f"than one block of seq_len + 1 = {block_len}")
    save_splits(split_ds, out_dir, cfg.one_file_per_split)
    totals = {k: sum(s[k] for s in split_stats.values()) for k in split_stats["train"] if k != "rows"}
    return {
        "format_version": META_VERSION,
        "seq_len": cfg.seq_len,
        "block_len": block_len,
        "packing": cfg.packing,
        "token_dtype": dtype,
        "columns": ["input_ids"] + ["loss_mask"] * stored_mask + ["doc_starts"] * own_template,
        "tokenizer": {"dir": "tokenizer", "sha256": tok_sha, "vocab_size": vocab, "eos_token": eos,
                      "eos_id": eos_id, "pad_token": pad, "pad_id": pad_id, "added_special_tokens": added,
                      "source": tok_source},
        "tokens": totals,
        "splits": split_stats,
        "rows": {"read": rows_read, "used": rows_used,
                 "skipped": {k: v for k, v in sorted(skips.items()) if k not in BENIGN},
                 "repaired": dict(sorted(raw.repaired.items())),
                 "blank_lines_ignored": skips.get("blank_line", 0)},
        "sources": raw.sources,
        "config": content_config(cfg),
    }


def local_inputs(input_value) -> dict[str, Path]:
    """The local paths data_prep reads, by field name: each file or directory of `input`, a glob's matches
    (a recursive one's whole directory), and nothing for a hub dataset's name."""
    import glob

    listed = isinstance(input_value, (list, tuple)) or OmegaConf.is_list(input_value)
    items = [str(item) for item in (input_value if listed else [input_value]) if item is not None]
    paths = {}
    for i, text in enumerate(items):
        name = "input" if len(items) == 1 else f"input[{i}]"
        text = os.path.expanduser(text)
        if "**" in text:
            paths[name] = Path(text[:text.index("**")])
        elif glob.has_magic(text):
            paths.update({f"{name} ({match})": Path(match) for match in sorted(glob.glob(text))})
        elif Path(text).exists():
            paths[name] = Path(text)
    return paths


def prepare(cfg, progress: bool = True) -> Path:
    """Run data_prep for `cfg` (PrepConfig, dict or DictConfig); returns the output directory."""
    cfg = _as_prep_config(cfg)
    validate_prep(cfg)
    if not cfg.output:
        raise UserError("output", cfg.output, "pass output=DIR", problem="is required")
    out = check_output("output", cfg.output, PREPARED_DATA, cfg.overwrite,
                       {**local_inputs(cfg.input), "tokenizer": cfg.tokenizer, "cache_dir": cfg.cache_dir})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    bars_were_off = datasets.are_progress_bars_disabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        with on_interrupt(f"{out} was not written (its temporary directory was removed; data already there "
                          "is as it was)"):
            work = tmp / "_work"
            meta = build(cfg, tmp, work, progress)
            shutil.rmtree(work)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            mark(tmp, PREPARED_DATA)
            publish(tmp, out, replace=cfg.overwrite)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, WriteFailed) or (isinstance(err, OSError) and write_errno(err) is not None):
            refused = err.__cause__ or err  # the file system's own error, under the output it was building
            raise write_failed(out, refused, cleaned="its temporary directory was removed") from err
        raise
    finally:
        if not progress and not bars_were_off:
            datasets.enable_progress_bars()
    return out
