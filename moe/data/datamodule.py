"""MoEDataModule: prepared Arrow dirs or online packing -> sharded, resumable micro-batches.

`kind=prepared` memory-maps a data_prep.py output. `kind=online` runs the same pipeline
from raw input at start-up into a cache keyed by the config, the tokenizer and the input
files (size, mtime), so it yields exactly the blocks data_prep.py would write, and later
runs open the cache instantly. Cache root: $MOE_DATA_CACHE, else ~/.cache/moe/data. `kind=online` with
`streaming` packs the same blocks as training reads them instead (moe.data.streaming), caching only the
tokenizer.

Training batches are optimizer steps: a rank's `micro_batch_size x accumulate_grad_batches` rows, its
micro-batches in order (the step cuts them, moe.module.train_step); validation batches are
`val_micro_batches` micro-batches. Each holds `input_ids` [rows, seq_len] and `labels` [rows, seq_len]
(next tokens, -100 where no loss); with data.document_mask also `document_ids` [rows, seq_len]
(moe.model.documents), and no loss on a label that starts a document. Documents start where data_prep
recorded a row's start (the `doc_starts` column; streaming: its packer's), else after each EOS.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from moe.config.data_prep import PrepConfig
from moe.config.rules.entries import validate_prep
from moe.config.schema import TOKENIZER_TEMPLATE
from moe.data import tokenizer as tk
from moe.data.arrow_io import PackedBlocks, check_document_starts, load_prepared, read_meta
from moe.data.mixture import load_mixture, source_dirs
from moe.data.prep_pipeline import content_config, digest, prepare
from moe.data.sampler import StreamSampler, validation_batches
from moe.data.sources import describe_sources, resolve
from moe.data.streaming import BlockSource, BlockStream
from moe.data.tokenizer_chat import load_template_tokenizer, template_text
from moe.errors import UserError, WriteFailed
from moe.model.documents import document_ids_from_starts
from moe.outputs import publish
from moe.paths import local_path

log = logging.getLogger(__name__)
IGNORE_INDEX = -100
ONLINE_FIELDS = {"input": "path", "seed": "split_seed"}  # data_prep key -> data.* key


def cache_root() -> Path:
    return Path(os.environ.get("MOE_DATA_CACHE") or Path.home() / ".cache" / "moe" / "data").expanduser()


def _local(path: str | None) -> str | None:
    return None if path is None else str(local_path(path))


def block_batch(ids: np.ndarray, mask: np.ndarray | None,
                starts: np.ndarray | None) -> dict[str, torch.Tensor]:
    """Blocks of L+1 -> inputs [:-1] and labels [1:] (-100 where the mask says no loss); `starts` (document
    masking, bool [k, L+1]): each token's document, and no target that starts a document (the previous
    document cannot predict it; Megatron's eod_mask_loss)."""
    labels = ids[:, 1:].copy()
    if mask is not None:
        labels[mask[:, 1:] == 0] = IGNORE_INDEX
    inputs = torch.from_numpy(np.ascontiguousarray(ids[:, :-1]))
    batch = {"input_ids": inputs, "labels": torch.from_numpy(labels)}
    if starts is not None:
        batch["labels"][torch.from_numpy(starts[:, 1:])] = IGNORE_INDEX
        batch["document_ids"] = document_ids_from_starts(torch.from_numpy(starts[:, :-1]))
    return batch


class InMemoryBlocks:
    """Blocks held in arrays (streaming's validation blocks), read like PackedBlocks."""

    def __init__(self, ids: np.ndarray, masks: np.ndarray | None, starts: np.ndarray):
        self.ids, self.masks, self.starts = ids, masks, starts

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, idx) -> tuple[np.ndarray, np.ndarray | None]:
        return self.ids[idx], None if self.masks is None else self.masks[idx]

    def document_starts(self, idx, ids: np.ndarray, eos_id: int) -> np.ndarray:
        return self.starts[idx]


class StreamBatches(IterableDataset):
    """Streaming's training batches: steps `start_step .. total-1`, each this rank's share of the next
    `rows x dp_size` stream positions (rank r takes the r-th, the (r+dp)-th, ..., as StreamSampler does),
    from stream position `start_row`. `len()` is `total`, as StreamSampler's."""

    def __init__(self, stream: BlockStream, rows: int, total: int, dp_rank: int, dp_size: int,
                 start_step: int, start_row: int, document_mask: bool):
        self.stream, self.rows, self.total, self.document_mask = stream, rows, total, document_mask
        self.dp_rank, self.dp_size, self.start_step, self.start_row = dp_rank, dp_size, start_step, start_row

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        with _as_data_error():  # a bad row met on the way is named under its data.* key
            blocks = self.stream.train(self.start_row)
            for _ in range(self.start_step, self.total):
                step = [next(blocks) for _ in range(self.rows * self.dp_size)]
                mine = step[self.dp_rank::self.dp_size]
                masks = None if mine[0][1] is None else np.stack([m for _, m, _ in mine])
                starts = np.stack([s for _, _, s in mine]) if self.document_mask else None
                yield block_batch(np.stack([ids for ids, _, _ in mine]), masks, starts)


class BlockBatches(Dataset):
    """Index array -> collated batch; blocks of L+1 become inputs [:-1] and labels [1:]. `eos_id` (document
    masking): each token's document from the blocks' document starts (after each EOS where none were
    recorded), and no target that starts a document. `by_source`: a mixture's
    validation batches, each of one source, also say which (`source`, its index in data.sources)."""

    def __init__(self, blocks: PackedBlocks, eos_id: int | None = None, by_source: bool = False):
        self.blocks, self.eos_id, self.by_source = blocks, eos_id, by_source

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, idx) -> dict[str, torch.Tensor]:
        ids, mask = self.blocks.get(idx)
        starts = None if self.eos_id is None else self.blocks.document_starts(idx, ids, self.eos_id)
        batch = block_batch(ids, mask, starts)
        if self.by_source:
            batch["source"] = int(self.blocks.source_of(idx[:1])[0])
        return batch


class _ResumableLoader(DataLoader):
    """Marks the loader resumable for Lightning: the DataModule's state_dict carries the position."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def online_prep_config(data) -> PrepConfig:
    """The data_prep config that online mode runs (data_prep.py with these values writes the same blocks)."""
    if not data.path:
        raise UserError("data.path", data.path,
                        "pass data.path=FILE_OR_GLOB (raw jsonl/json/parquet/csv/tsv/txt)",
                        problem="is required for data.kind=online")
    if not data.tokenizer:
        raise UserError("data.tokenizer", data.tokenizer, "pass data.tokenizer=DIR (holding tokenizer.json), "
                        "or train one with `python data_prep.py vocab_size=N ...` and use data=prepared",
                        problem="is required for data.kind=online")
    prep = PrepConfig(
        input=_local(data.path), format=data.format, text_column=data.text_column,
        chat_template=data.chat_template, assistant_only_loss=data.assistant_only_loss,
        tokenizer=_local(data.tokenizer), seq_len=data.seq_len,
        val_fraction=data.val_fraction, seed=data.split_seed, packing=getattr(data, "packing", "concat"),
        on_bad_row=getattr(data, "on_bad_row", "error"))
    with _as_data_error():
        validate_prep(prep)
    return prep


@contextlib.contextmanager
def _as_data_error():
    """Re-raise a data_prep UserError under the train-side key (input -> data.path, ...)."""
    try:
        yield
    except UserError as err:
        if isinstance(err, WriteFailed) or err.field.startswith(("data.", "model.")):
            raise
        field = ONLINE_FIELDS.get(err.field, err.field)
        raise UserError(f"data.{field}", err.value, err.fix, err.problem) from None


def online_cache_dir(prep: PrepConfig) -> Path:
    """Cache path keyed by the content config, the tokenizer bytes and the input files' size and mtime."""
    kind, items = resolve(prep.input)
    stamp = [(p, os.stat(p).st_mtime_ns) for p in items] if kind not in ("hub",) else []
    tok_file = Path(prep.tokenizer) / "tokenizer.json"
    tok_sha = tk.file_sha256(tok_file) if tok_file.is_file() else str(prep.tokenizer)
    # the tokenizer's template is content too: another template, another cache
    own = prep.format == "chat" and prep.chat_template == TOKENIZER_TEMPLATE
    template = [template_text(load_template_tokenizer(prep.tokenizer))] if own else []
    key = digest(content_config(prep), describe_sources(kind, items), stamp, tok_sha, *template)
    return cache_root() / f"{Path(str(items[0])).stem}-{key[:16]}"


def stream_tokenizer_home(prep: PrepConfig) -> Path:
    """Streaming keeps only its tokenizer, keyed by the content config and the tokenizer's bytes (not by the
    input files: nothing of them is kept)."""
    tok_file = Path(prep.tokenizer) / "tokenizer.json"
    tok_sha = tk.file_sha256(tok_file) if tok_file.is_file() else str(prep.tokenizer)
    return cache_root() / f"stream-{digest(content_config(prep), tok_sha)[:16]}"


class MoEDataModule(L.LightningDataModule):
    """`dims` (moe.parallel.dims.ParallelDims) says which data-parallel rank this process is: ranks of one
    tensor/pipeline-parallel group read the same data. Without one, every process is its own rank.
    `val_micro_batches`: micro-batches per validation batch (a backend's pipeline evaluates a whole
    step's at once); such batches are complete, a shorter last one is left out."""

    def __init__(self, data_cfg, micro_batch_size: int, accumulate_grad_batches: int, max_steps: int,
                 seed: int, limit_val_batches: int, dims=None, dp_rank: int | None = None,
                 dp_size: int | None = None, val_micro_batches: int = 1):
        super().__init__()
        self.cfg, self.dims = data_cfg, dims
        self.micro_batch_size, self.accumulate = micro_batch_size, accumulate_grad_batches
        self.val_micro_batches = val_micro_batches
        self.max_steps, self.seed, self.limit_val_batches = max_steps, seed, limit_val_batches
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # where this launch's stream begins: the step its sampler starts at (None: not made yet) and the rows
        # every rank consumed before it (a resume sets it)
        self.start_step: int | None = None
        self.start_row = 0
        self.prepared = None
        self.sources = None  # a mixture's [(dir, meta)] in data.sources' order; None: the one source
        if data_cfg.sources:
            self.sources = source_dirs(data_cfg.sources)
            self.dir, self.meta = self.sources[0]
            for k, (path, meta) in enumerate(self.sources):
                self._check_document_starts(path, meta, f"data.sources[{k}].path")
                self._check_prepared_tokenizer(path, meta, f"data.sources[{k}].path")
            self._vocab_size = self.meta["tokenizer"]["vocab_size"]
            self._take_seq_len()
        elif data_cfg.kind == "prepared":
            if not data_cfg.path:
                raise UserError("data.path", data_cfg.path,
                                "pass data.path=DIR, a `python data_prep.py` output",
                                problem="is required for data=prepared")
            self.dir = Path(_local(data_cfg.path)).expanduser().absolute()
            self.meta = read_meta(self.dir)
            self._check_document_starts(self.dir, self.meta)
            self._check_prepared_tokenizer(self.dir, self.meta)
            self._vocab_size = self.meta["tokenizer"]["vocab_size"]
            self._take_seq_len()
        elif data_cfg.kind == "online" and getattr(data_cfg, "streaming", False):
            self.prep = online_prep_config(data_cfg)
            self.dir, self.meta = stream_tokenizer_home(self.prep), None
            self.stream, self._stream_validation = None, None
            with _as_data_error():
                self._vocab_size = self._online_vocab()
        elif data_cfg.kind == "online":
            self.prep = online_prep_config(data_cfg)
            with _as_data_error():
                self.dir = online_cache_dir(self.prep)
            self.prep.output = str(self.dir)
            self.meta = read_meta(self.dir) if (self.dir / "meta.json").is_file() else None
            if self.meta is not None:
                self._check_document_starts(self.dir, self.meta)
            with _as_data_error():
                self._vocab_size = self.meta["tokenizer"]["vocab_size"] if self.meta else self._online_vocab()
        else:
            raise UserError("data.kind", data_cfg.kind,
                            "use prepared (data.path=DIR from data_prep.py) or online",
                            problem="is not a data kind")

    # ---- what train.py and inference read ----
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def seq_len(self) -> int:
        return self.meta["seq_len"] if self.meta else self.cfg.seq_len

    @property
    def tokenizer_dir(self) -> Path:
        """Directory with the tokenizer.json the blocks were made with (online: built on first access)."""
        if self.meta is None:
            self.prepare_data()
        return self.dir / self.meta["tokenizer"]["dir"]

    def check_model(self, model_cfg) -> None:
        """At start-up, before the model exists: the data's vocabulary and length fit the model, and prepared
        data opens whole (a damaged shard is named here, not in the middle of Lightning's setup)."""
        if self.cfg.kind == "prepared" and self.prepared is None:
            self.prepared = self._open()
        if self.vocab_size > model_cfg.vocab_size:
            raise UserError("model.vocab_size", model_cfg.vocab_size,
                            f"set model.vocab_size={self.vocab_size} (or more; a multiple of 64 is faster on "
                            "GPUs)",
                            problem=f"is smaller than the tokenizer's {self.vocab_size} tokens ({self.dir})")
        if self.seq_len > model_cfg.max_position_embeddings:
            raise UserError("model.max_position_embeddings", model_cfg.max_position_embeddings,
                            f"set model.max_position_embeddings={self.seq_len} or more, or prepare shorter "
                            "blocks (data_prep.py seq_len=N / data.seq_len=N)",
                            problem=f"is shorter than the data's seq_len {self.seq_len}")

    def _take_seq_len(self) -> None:
        if self.cfg.seq_len != self.meta["seq_len"]:
            log.warning("data.seq_len=%s replaced by %s from %s/meta.json", self.cfg.seq_len,
                        self.meta["seq_len"], self.dir)
            self.cfg.seq_len = self.meta["seq_len"]  # downstream (throughput, MFU) reads cfg.data.seq_len

    def _open(self):
        """The prepared blocks, memory-mapped (a mixture: every source's, end to end)."""
        self.prepare_data()
        return load_mixture(self.sources) if self.sources else load_prepared(self.dir)

    def _check_document_starts(self, path: Path, meta: dict, field: str = "data.path") -> None:
        if getattr(self.cfg, "document_mask", False):
            check_document_starts(meta, path, field)

    def _check_prepared_tokenizer(self, path: Path, meta: dict, field: str = "data.path") -> None:
        tok_dir = path / meta["tokenizer"]["dir"]
        if tk.file_sha256(tok_dir / "tokenizer.json") != meta["tokenizer"]["sha256"]:
            raise UserError(field, str(path), "re-run data_prep.py, or restore the tokenizer "
                            "it wrote", problem="holds a tokenizer/tokenizer.json that changed since "
                            "data_prep.py wrote it (sha256 differs from meta.json)")
        if self.cfg.tokenizer:
            given, _ = tk.read_tokenizer(_local(self.cfg.tokenizer), "data.tokenizer")
            ours, _ = tk.read_tokenizer(tok_dir)
            if given.get_vocab(with_added_tokens=True) != ours.get_vocab(with_added_tokens=True):
                raise UserError("data.tokenizer", self.cfg.tokenizer, f"drop data.tokenizer (prepared dirs "
                                f"carry their own, {tok_dir}), or re-run data_prep.py with this tokenizer",
                                problem=f"has a different vocabulary from the one {path} was tokenized "
                                "with")

    def _online_vocab(self) -> int:
        tok, _ = tk.read_tokenizer(self.prep.tokenizer, "data.tokenizer")
        if self.prep.format == "chat":
            tk.add_special_tokens(tok, tk.template_markers(self.prep.chat_template))
        return tk.vocab_size(tok)

    # ---- Lightning hooks ----
    @property
    def streaming(self) -> bool:
        return self.cfg.kind == "online" and getattr(self.cfg, "streaming", False)

    def prepare_data(self) -> None:
        """Online: build the cache once (atomic; when processes race, the first finished one is kept:
        moe.outputs.publish). Streaming: its source, and its tokenizer written once the same way."""
        if self.streaming:
            self._prepare_stream()
            return
        if self.cfg.kind == "online" and not (self.dir / "meta.json").is_file():
            log.info("online data: packing %s into %s", self.prep.input, self.dir)
            try:
                with _as_data_error():
                    prepare(self.prep)
            except UserError:
                if not (self.dir / "meta.json").is_file():  # else another process finished it first
                    raise
        if self.meta is None:
            self.meta = read_meta(self.dir)

    def _prepare_stream(self) -> None:
        if self.stream is not None:
            return
        with _as_data_error():
            source = BlockSource(self.prep)
            # the rows up to the first block, read now: a wrong format or a corpus shorter than one block
            # fails at start-up, not in the middle of Lightning's loop
            if next(source.blocks(), None) is None:
                raise UserError("data.seq_len", self.prep.seq_len, "lower data.seq_len, or add data",
                                problem=f"is too long: {self.prep.input} holds fewer tokens than one block "
                                f"of seq_len + 1 = {self.prep.seq_len + 1}")
        log.info("streaming %s: validation is its first %d blocks (data.val_fraction is not read)",
                 self.prep.input, self.cfg.streaming_val_blocks)
        self.stream = BlockStream(source, self.cfg.streaming_val_blocks, self.cfg.shuffle,
                                  self.cfg.shuffle_buffer, self.seed)
        self.meta = {"seq_len": self.prep.seq_len, "tokenizer": source.tokenizer_facts()}
        if not (self.dir / "tokenizer").is_dir():
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.dir.parent / f".{self.dir.name}.tmp-{os.getpid()}"
            source.save_tokenizer(tmp / "tokenizer")
            try:
                publish(tmp, self.dir, replace=False)
            except UserError:  # another process published the same tokenizer first
                shutil.rmtree(tmp, ignore_errors=True)

    def setup(self, stage: str | None = None) -> None:
        if self.streaming:
            self.prepare_data()
        elif self.prepared is None:
            self.prepared = self._open()
        rank, size = self._data_parallel_rank_and_size()
        self.dp_rank = rank if self.dp_rank is None else self.dp_rank
        self.dp_size = size if self.dp_size is None else self.dp_size

    def _data_parallel_rank_and_size(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        if self.dims is None:
            return trainer.global_rank, trainer.world_size
        return self.dims.dp_rank(trainer.global_rank), self.dims.dp

    @property
    def rows_per_step(self) -> int:
        """Rows one optimizer step takes from the stream, every data-parallel rank together."""
        return self.micro_batch_size * self.accumulate * self.dp_size

    def train_sampler(self) -> StreamSampler:
        """A step's rows at a time (its micro-batches, in order), from the restored step and stream
        position."""
        trainer = getattr(self, "trainer", None)
        self.start_step = trainer.global_step if trainer is not None else 0
        train = self.prepared.splits["train"]
        sizes, weights = len(train), None
        if self.sources:
            sizes, weights = train.sizes, [source.weight for source in self.cfg.sources]
        return StreamSampler(sizes, self.micro_batch_size * self.accumulate,
                             total=self.max_steps, seed=self.seed, shuffle=self.cfg.shuffle,
                             dp_rank=self.dp_rank, dp_size=self.dp_size, start_step=self.start_step,
                             start_row=self.start_row, weights=weights)

    @property
    def _eos_id(self) -> int | None:
        """The EOS id document masking reads boundaries from where no row starts were recorded; None without
        it."""
        return self.meta["tokenizer"]["eos_id"] if getattr(self.cfg, "document_mask", False) else None

    def _loader(self, blocks: PackedBlocks, sampler, by_source: bool = False) -> DataLoader:
        workers = self.cfg.num_workers
        return _ResumableLoader(BlockBatches(blocks, self._eos_id, by_source), sampler=sampler,
                                batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                                pin_memory=torch.cuda.is_available())

    def train_dataloader(self) -> DataLoader:
        if self.streaming:
            return self._stream_loader()
        return self._loader(self.prepared.splits["train"], self.train_sampler())

    def _stream_loader(self) -> DataLoader:
        """Streaming: the same rows per step and rank as train_sampler's, read from the files in order."""
        trainer = getattr(self, "trainer", None)
        self.start_step = trainer.global_step if trainer is not None else 0
        batches = StreamBatches(self.stream, self.micro_batch_size * self.accumulate, self.max_steps,
                                self.dp_rank, self.dp_size, self.start_step, self.start_row,
                                getattr(self.cfg, "document_mask", False))
        workers = self.cfg.num_workers
        return _ResumableLoader(batches, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                                pin_memory=torch.cuda.is_available())

    def _validation_blocks(self):
        if self.streaming:
            if self._stream_validation is None:  # read once: the first streaming_val_blocks blocks
                with _as_data_error():
                    self._stream_validation = InMemoryBlocks(*self.stream.validation())
            return self._stream_validation
        return self.prepared.splits.get("validation")

    def val_dataloader(self) -> DataLoader:
        """One source: its first `limit_val_batches` micro-batches. A mixture: that many of each source's
        validation blocks in turn, a batch never spanning two sources (their losses are logged apart)."""
        blocks = self._validation_blocks()
        size = self.micro_batch_size * self.val_micro_batches
        parts = [(0, len(blocks) if blocks is not None else 0)]
        if self.sources and blocks is not None:
            parts = list(zip(blocks.starts[:-1].tolist(), blocks.sizes, strict=True))
        batches = []
        for start, n in parts:
            own = validation_batches(n, size, self.limit_val_batches, self.dp_rank, self.dp_size)
            batches += [start + b for b in own if self.val_micro_batches == 1 or len(b) == size]
        return self._loader(blocks, batches, by_source=bool(self.sources)) if batches else []

    # ---- resume ----
    def state_dict(self) -> dict:
        """The stream's position in rows every rank consumed together (any batch geometry resumes at the
        next row), and what the stream is (its seed, its block count)."""
        trainer = getattr(self, "trainer", None)
        steps = 0 if trainer is None or self.start_step is None else trainer.global_step - self.start_step
        return {"rows_consumed": int(self.start_row + steps * self.rows_per_step), "seed": self.seed,
                "train_blocks": self._train_blocks()}

    def _train_blocks(self):
        """The block count the stream runs over (a mixture: one per source)."""
        if self.prepared is None:
            return None
        train = self.prepared.splits["train"]
        return list(train.sizes) if self.sources else len(train)

    def load_state_dict(self, state_dict: dict) -> None:
        if "rows_consumed" in state_dict:
            self.start_row = int(state_dict["rows_consumed"])
        else:  # written before the position was kept in rows: per-rank micro-batches of today's size
            self.start_row = (int(state_dict["micro_batches_consumed"]) * self.micro_batch_size
                              * int(state_dict.get("dp_size") or self.dp_size or 1))
        if state_dict.get("seed") not in (None, self.seed):
            log.warning("resuming with a different data order (saved seed %s, now %s): the stream position "
                        "is kept, the blocks at it differ", state_dict["seed"], self.seed)
