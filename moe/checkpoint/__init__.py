"""Checkpoints: how they are written, which kinds exist on disk, and the one place that picks one.

    io.py          atomic file IO: temporary name, fsync, rename, a sha256 sidecar; the corruption error
    formats.py     one class per on-disk format, each with detect / verify / read / newest and, in a
                   training run, save / load / remove: a portable file (`.ckpt`), a sharded directory
                   (torch.distributed.checkpoint), a DeepSpeed directory (Lightning's own format, read
                   only), and the formats backends register (`register`: a backend whose library
                   writes its own keeps it in its package); every checkpoint is written by one
    sharded.py     the sharded format's collective writer and loader, into any layout
    picker.py      the one picker: what to resume from, what infer.py / export / consolidation read
    lightning_io.py  Lightning's CheckpointIO over the formats (one process writes the portable file)
    trust.py       weights-only loading; files that need unpickling only with allow_pickle
(The kill-mid-save fault injector the tests use is moe/faults.py.)

Imports run down: io <- sharded <- formats <- picker, lightning_io; nothing here imports the training
loop or a backend.
"""
