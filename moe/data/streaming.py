"""Streaming (data.streaming=true): online blocks packed lazily from the raw files, never all at once.

`BlockSource` reads the input files in order a batch of rows at a time (`datasets` streaming builders,
the same ones and arguments data_prep.py reads with), encodes each batch with data_prep's Encoder and
packs it with its packers, carrying the remainder: one pass gives, block for block, what data_prep.py
with val_fraction=0 writes into its train split. Memory holds one batch of rows and the packer's carry,
whatever the corpus size; nothing is written but the tokenizer.

`BlockStream` turns passes into the training stream: the first `val_blocks` blocks of a pass are the
validation blocks, the rest of every pass the training blocks, passes repeating without end (an epoch
is one pass). Stream position i is the i-th training block of that endless sequence, or, with a shuffle
buffer, the i-th block out of a seeded buffer of K blocks. Both are functions of the seed and the files
alone, so a resume replays the stream from its start and skips the rows already consumed.
"""
from __future__ import annotations

from itertools import islice

import datasets
import numpy as np
import pyarrow as pa

from moe.config.data_prep import PrepConfig
from moe.config.schema import TOKENIZER_TEMPLATE
from moe.data import tokenizer as tk
from moe.data.packing import ConcatPacker, PadPacker, starts_after_eos
from moe.data.prep_pipeline import Encoder, prep_tokenizer
from moe.data.sources import LINE_BASED, builder_args, load_disk, refuse_bad_bytes, resolve
from moe.data.text_formats import BENIGN, FormatSpec, check_columns, needed_columns
from moe.data.tokenizer_chat import NOT_PREFIX, ChatTemplateEncoder, load_template_tokenizer, template_text
from moe.errors import UserError


class BlockSource:
    """One pass over `prep.input` -> packed blocks, in file order, a batch of rows at a time."""

    def __init__(self, prep: PrepConfig):
        kind, items = resolve(prep.input)
        if kind == "hub":
            raise UserError("data.path", prep.input, "pass local files (jsonl/json/parquet/csv/tsv/txt), or "
                            "set data.streaming=false", problem="is a hub dataset name: streaming reads "
                            "local files only")
        self.prep, self.kind, self.items = prep, kind, items
        own = prep.format == "chat" and prep.chat_template == TOKENIZER_TEMPLATE
        self.hf = load_template_tokenizer(prep.tokenizer) if own else None
        self.spec = FormatSpec(prep.format, prep.text_column, prep.chat_template,
                               blank_lines_ok=kind == "text")
        markers = tk.template_markers(prep.chat_template) if prep.format == "chat" else []
        self.tok, self.eos, self.pad, _, _ = prep_tokenizer(prep, None, self.spec, markers, False)
        self.eos_id, self.pad_id = self.tok.token_to_id(self.eos), self.tok.token_to_id(self.pad or self.eos)
        self.chat = ChatTemplateEncoder(self.tok, prep.tokenizer, self.eos_id) if own else None
        self.block_len = prep.seq_len + 1

    def tokenizer_facts(self) -> dict:
        """What the loader and start-up read of meta.json's `tokenizer` entry."""
        return {"dir": "tokenizer", "vocab_size": tk.vocab_size(self.tok), "eos_token": self.eos,
                "eos_id": self.eos_id, "pad_token": self.pad, "pad_id": self.pad_id}

    def save_tokenizer(self, out_dir) -> None:
        """Write the tokenizer the blocks are made with, as data_prep.py does (its template and BOS too)."""
        kept = {"chat_template": template_text(self.hf), "bos_token": self.hf.bos_token} if self.hf else {}
        tk.save_tokenizer(self.tok, out_dir, eos=self.eos, pad=self.pad, model_max_length=self.prep.seq_len,
                          config_extra={k: v for k, v in kept.items() if v is not None})

    def _row_batches(self):
        """Raw rows as column dicts of up to prep.batch_size rows, file by file."""
        size = self.prep.batch_size
        if self.kind == "disk":  # a save_to_disk directory: memory-mapped already
            yield from load_disk(self.items[0], self.prep.split).iter(batch_size=size)
            return
        builder, kwargs = builder_args(self.kind)
        for path in self.items:
            if self.kind in LINE_BASED:
                refuse_bad_bytes(path)
            counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
            datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False  # local files: no request to the hub
            try:
                rows = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True,
                                             **kwargs)
            finally:
                datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts
            try:
                yield from rows.iter(batch_size=size)
            except (ValueError, pa.ArrowException, OSError) as err:
                raise UserError("data.path", path, f"check the file is valid {self.kind}, or prepare it with "
                                "data_prep.py on_bad_row=skip and train with data=prepared",
                                problem=f"could not be read ({type(err).__name__}: {err})") from err

    def _refuse_bad_rows(self, table: pa.Table, batch: dict, first_row: int) -> None:
        """data_prep's on_bad_row=error, a batch at a time: the first bad row is named."""
        reasons = table.column("skip").to_pylist()
        bad = next(((i, r) for i, r in enumerate(reasons) if r is not None and r not in BENIGN), None)
        if bad is None:
            return
        i, reason = bad
        row = {k: v[i] for k, v in batch.items()}
        if reason == NOT_PREFIX:
            raise UserError("data.chat_template", self.prep.chat_template, "use a template that renders a "
                            "conversation's earlier turns the same whatever follows them",
                            problem=f"renders row {first_row + i} so that its first turns are not a "
                            f"prefix of the whole: {self.chat.explain(row)}")
        if self.chat is not None:
            reason = self.chat.explain(row)
        raise UserError("data.path", self.prep.input, "fix that row, or prepare the data with data_prep.py "
                        "on_bad_row=skip and train with data=prepared",
                        problem=f"has a bad row, row {first_row + i} (0-based, in file order): {reason}")

    def blocks(self):
        """One pass: (ids [k, L+1] int64, loss mask [k, L+1] uint8 or None, document starts bool [k, L+1])
        chunks, as data_prep packs. The starts are the rows' own where EOS may sit inside a row (the
        tokenizer's own chat template), else the token after each EOS: what the loader reads of data_prep's
        output."""
        prep = self.prep
        packer = (ConcatPacker(self.block_len, prep.assistant_only_loss) if prep.packing == "concat"
                  else PadPacker(self.block_len, self.pad_id))
        row = 0
        for batch in self._row_batches():
            names = list(batch)
            check_columns(self.spec, names)
            columns = needed_columns(self.spec, names)
            encode = Encoder(self.tok, self.spec, self.eos_id, prep.assistant_only_loss, columns, self.chat)
            table = encode(*[batch[c] for c in columns])
            self._refuse_bad_rows(table, batch, row)
            ids_col = table.column("input_ids").combine_chunks()
            lengths = np.diff(ids_col.offsets.to_numpy())
            ids = ids_col.values.to_numpy(zero_copy_only=False)
            mask = None
            if prep.assistant_only_loss:
                mask = table.column("loss_mask").combine_chunks().values.to_numpy(zero_copy_only=False)
            blocks, masks, starts = packer.add(ids, mask, lengths[lengths > 0])  # empty rows are not rows
            row += len(lengths)
            if len(blocks):
                if self.chat is None:
                    starts = starts_after_eos(blocks, self.eos_id)
                yield blocks.astype(np.int64), masks, starts


class BlockStream:
    """Validation blocks and the endless, optionally shuffled, training stream of a BlockSource."""

    def __init__(self, source: BlockSource, val_blocks: int, shuffle: bool, buffer: int, seed: int):
        self.source, self.val_blocks = source, val_blocks
        self.buffer = buffer if shuffle else 0
        self.seed = seed

    def _pass(self):
        """One pass, a block at a time: (ids [L+1], mask [L+1] or None, document starts [L+1]), each its own
        copy (a view would keep its batch's whole array alive in the shuffle buffer)."""
        for ids, masks, starts in self.source.blocks():
            for k in range(len(ids)):
                yield ids[k].copy(), None if masks is None else masks[k].copy(), starts[k].copy()

    def validation(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The first val_blocks blocks of a pass, stacked (empty arrays when val_blocks is 0)."""
        taken = list(islice(self._pass(), self.val_blocks))
        if not taken:
            width = self.source.block_len
            return np.zeros((0, width), np.int64), None, np.zeros((0, width), bool)
        masks = None if taken[0][1] is None else np.stack([m for _, m, _ in taken])
        return np.stack([ids for ids, _, _ in taken]), masks, np.stack([s for _, _, s in taken])

    def _epochs(self):
        """The training blocks of every pass, without end."""
        while True:
            blocks = islice(self._pass(), self.val_blocks, None)
            first = next(blocks, None)
            if first is None:
                raise UserError("data.streaming_val_blocks", self.val_blocks, "lower it, add data, or lower "
                                "data.seq_len", problem=f"leaves no training blocks: one pass over "
                                f"{self.source.prep.input} packs at most that many blocks")
            yield first
            yield from blocks

    def _shuffled(self):
        """A seeded shuffle buffer of `buffer` blocks: each incoming block takes the place of a random one,
        which goes out (the first `buffer` blocks only fill it)."""
        rng = np.random.default_rng(self.seed)
        held = []
        for block in self._epochs():
            if len(held) < self.buffer:
                held.append(block)
                continue
            j = int(rng.integers(self.buffer))
            out, held[j] = held[j], block
            yield out

    def train(self, start: int = 0):
        """Training blocks from stream position `start` on (positions before it are read and skipped)."""
        return islice(self._shuffled() if self.buffer else self._epochs(), start, None)
