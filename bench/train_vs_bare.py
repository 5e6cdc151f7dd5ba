"""train.py beside the bare model: tokens/s and host syncs per step of the same model, batch and precision,
through train.py's whole Lightning step and through a plain loop (issue O: within 10% on one GPU).

The bare loop is what a user would write: the model (moe.model.MoETransformer, built as train.py builds it),
the same batch from the same data, autocast in the run's precision, the chunked LM head and loss plus the
router terms, backward, clipping at optimizer.grad_clip by one foreach norm, the fused AdamW with train.py's
parameter groups. train.py adds what a run needs: Lightning's loop, the metrics and their reductions, the
spike guard, the step seed. Each runs --warmup steps, then one step whose host syncs are counted
(moe.tools.syncs; on CUDA each is a wait for every kernel queued before it), then --steps timed steps: the
counting is a Python dispatch mode that sees every op, so no timed step runs under it (an H100 run that timed
under it measured the mode: the bare loop at 55k tokens/s where train.py alone made 65k).

    python bench/train_vs_bare.py                                   # tiny model on this CPU
    python bench/train_vs_bare.py --gpu                             # moe_1b at seq 2048 on one CUDA GPU
    python bench/train_vs_bare.py --gpu --backend fsdp2             # train.py through FSDP2 (one GPU)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moe.tools.syncs import counting_syncs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CPU_SHAPE = ("model=tiny", "data.seq_len=128", "trainer.micro_batch_size=8")
GPU_SHAPE = ("model=moe_1b", "data.seq_len=2048", "trainer.micro_batch_size=8")
BACKENDS = {  # (on the CPU, on a GPU): the hardware presets train.py runs through
    "ddp": ((), ("hardware=gpu", "hardware.strategy=ddp", "parallel=single")),
    "fsdp2": (("hardware=cpu_fsdp2",), ("hardware=gpu_fsdp2",)),
}


def compose(overrides: list[str], run_dir: Path):
    from moe.train.preflight import compose_config

    common = [f"hydra.run.dir={run_dir}", "trainer.progress_bar=false", "trainer.limit_val_batches=0",
              "trainer.save_checkpoints=false", "trainer.log_every_n_steps=10", "resume=false"]
    cfg, _ = compose_config([*common, *overrides], str(REPO / "conf"), "train")
    return cfg


def through_train_py(overrides: list[str], steps: int, warmup: int) -> tuple[float, int]:
    """(tokens/s over the timed steps, host syncs of the counted step) of train.py itself, in this process:
    a callback, last of the run's, counts the step after the warm-up and times the steps after that."""
    import lightning as L

    import moe.train.callbacks as callbacks
    from moe.train.run import train

    class CountAndTime(L.Callback):
        def __init__(self):
            self.syncs, self._counting, self.start, self.seconds = 0, None, None, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == warmup:
                self._counting = counting_syncs()
                self._counter = self._counting.__enter__()
            elif trainer.global_step == warmup + 1:
                self.start = synchronized_clock(pl_module.device)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self._counting is not None:
                self._counting.__exit__(None, None, None)
                self._counting, self.syncs = None, len(self._counter.syncs)
            if trainer.global_step == warmup + 1 + steps:
                self.seconds = synchronized_clock(pl_module.device) - self.start

    probe, build = CountAndTime(), callbacks.build_callbacks
    callbacks.build_callbacks = lambda *a, **kw: [*build(*a, **kw), probe]
    try:
        run_dir = Path(tempfile.mkdtemp(prefix="train-vs-bare-"))
        cfg = compose([*overrides, f"trainer.max_steps={warmup + 1 + steps}"], run_dir)
        train(cfg, run_dir)
    finally:
        callbacks.build_callbacks = build
    tokens = cfg.trainer.micro_batch_size * cfg.data.seq_len
    return tokens * steps / probe.seconds, probe.syncs


def synchronized_clock(device: torch.device) -> float:
    """perf_counter once the device has run everything queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def bare_loop(overrides: list[str], steps: int, warmup: int) -> tuple[float, int]:
    """The same model, batch and precision in a plain loop: (tokens/s over the timed steps, host syncs of the
    counted step)."""
    from moe.config.derived import precision_of
    from moe.data import MoEDataModule
    from moe.model.model import MoETransformer
    from moe.module.optim import build_optimizer
    from moe.parallel.grad_norm import clip_local_grads, global_grad_norm
    from moe.train.run import settle

    run_dir = Path(tempfile.mkdtemp(prefix="train-vs-bare-"))
    settled = settle(compose([*overrides, f"trainer.max_steps={warmup + 1 + steps}"], run_dir))
    cfg, dims = settled.config, settled.dims
    device = torch.device("cuda" if cfg.hardware.accelerator == "gpu" else "cpu")
    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg.model, cfg.moe_opt, init_seed=cfg.seed).to(device)
    precision = precision_of(cfg.trainer, cfg.hardware)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    optimizer = build_optimizer(model, cfg.optimizer)
    data = MoEDataModule(cfg.data, micro_batch_size=cfg.trainer.micro_batch_size, accumulate_grad_batches=1,
                         max_steps=warmup + 1 + steps, seed=cfg.seed, limit_val_batches=0, dims=dims)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    tokens = cfg.trainer.micro_batch_size * cfg.data.seq_len

    def step() -> None:
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        with autocast:
            out = model(batch["input_ids"], labels_BS=batch["labels"])
            loss = out.loss
        loss.backward()
        if cfg.optimizer.grad_clip:
            clip_local_grads(model.parameters(), global_grad_norm(model.parameters(), [], None, device),
                             cfg.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    with counting_syncs() as counter:
        step()
    start = synchronized_clock(device)
    for _ in range(steps):
        step()
    seconds = synchronized_clock(device) - start
    return tokens * steps / seconds, len(counter.syncs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="moe_1b at seq 2048 on one CUDA GPU")
    parser.add_argument("--backend", choices=list(BACKENDS), default="ddp", help="train.py's path")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="train.py overrides on top of the shape")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        print("error: --gpu measures a CUDA GPU and torch sees none here. Fix: run it on a GPU machine, or "
              "drop --gpu for the CPU shape.", file=sys.stderr)
        sys.exit(2)
    hardware = BACKENDS[args.backend][1 if args.gpu else 0]
    overrides = [*hardware, *(GPU_SHAPE if args.gpu else CPU_SHAPE), *args.overrides]
    card = torch.cuda.get_device_name() if args.gpu else "CPU"
    print(f"{card}, torch {torch.__version__}; {' '.join(overrides)}; {args.steps} timed steps after "
          f"{args.warmup} warm-up steps and one counted step")
    bare, bare_syncs = bare_loop(overrides, args.steps, args.warmup)
    ours, our_syncs = through_train_py(overrides, args.steps, args.warmup)
    print("| path | tokens/s | host syncs / step |\n|---|---|---|")
    print(f"| bare loop | {bare:,.0f} | {bare_syncs} |")
    print(f"| train.py | {ours:,.0f} | {our_syncs} |")
    print(f"train.py runs at {100 * ours / bare:.1f}% of the bare loop")


if __name__ == "__main__":
    main()
