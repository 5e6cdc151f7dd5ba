"""A skipped step skips: the probe and the verdict of tests/test_skip_every_backend.py on every backend, and
of run.sh's `skip` check on neuronx-distributed's real code (`python skip_probe.py RUN_DIR WORLD` after
train.py trained RUN_DIR with the probe). Here, beside the NxD harness, because its venv has no pytest.

A run of STEPS optimizer steps (moe.module.train_step: the guard decides, `backend.skip_update` skips):

- step NONFINITE: a hook on the backward of rank 0's first attention output projection multiplies its output
  gradient by inf, so every gradient below it is non-finite while the loss (the forward's) stays finite; the
  guard must see the non-finite global norm on every rank (metrics.csv logs the norm it decided from) and
  skip;
- step GUARDED: the rollback ledger (moe.train.guard, rollbacks.json; `write_ledger` puts it in the run dir
  before the run, as a relaunch after a rollback finds it) has the guard skip a step whose gradient is
  finite: the skip alone must hold the update back, not the backend's own handling of a non-finite
  gradient (DeepSpeed skips those itself);
- the last step updates as usual.

`SkipProbe` (a callback, on every rank) copies the rank's weights and its optimizer's whole state_dict as
step NONFINITE starts and as every later step ends: Adam's moments and step counts, DeepSpeed's fp32
partitions and loss scaler, FSDP2's local shards, NxD's ZeRO-1 shards. `problems` says what went wrong:
steps NONFINITE and GUARDED must leave every tensor and number in them bit for bit as it was (but the
state_dict keys in MOVING), the last step must change every weight and every moment, and the run must
count 2 skipped steps, 1 of them non-finite.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import lightning as L
import torch

NONFINITE, GUARDED, STEPS = 2, 3, 4  # the step whose gradient is made non-finite, the ledger's, the last
TARGET = "layers.0.attn.o_proj"  # its output gradient becomes inf on rank 0 (which holds layer 0 under pp)
# state_dict keys that move on a skipped step by design: the LR schedule steps (every backend), DeepSpeed
# records that its last step overflowed (`overflow`) and its fp16/bf16 optimizer without ZeRO counts steps for
# its loss scaler, skipped or not (`cur_iter`, deepspeed 0.19.8 runtime/fp16/unfused_optimizer.py:301)
MOVING = {"lr", "overflow", "cur_iter"}


def write_ledger(run_dir: Path) -> None:
    """The ledger a rollback from step GUARDED to GUARDED - 1 leaves (moe.train.guard)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    event = {"spike_step": GUARDED, "from_step": GUARDED - 1, "loss": 99.0, "running_mean": 6.0}
    (Path(run_dir) / "rollbacks.json").write_text(json.dumps({"rollbacks": [event]}))


class SkipProbe(L.Callback):
    """Poisons step NONFINITE's gradient on rank 0; writes what steps NONFINITE and GUARDED changed in this
    rank's weights and optimizer state, and how much the last step changed, to `out`/rank<N>.json."""

    def __init__(self, out: str):
        self.out, self.hooks, self.seen = Path(out), [], {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 != NONFINITE:
            return
        self.seen[NONFINITE - 1] = snapshot(trainer, pl_module)
        if trainer.global_rank == 0:
            for name, m in pl_module.named_modules():
                if name == TARGET or name.endswith(f".{TARGET}"):
                    self.hooks.append(m.register_forward_hook(_poison_backward))
            assert self.hooks, f"no {TARGET} on rank 0"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # the step just taken
        if step < NONFINITE:
            return
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.seen[step] = snapshot(trainer, pl_module)
        if step < STEPS:
            return
        before, after = self.seen[STEPS - 1], self.seen[STEPS]
        params = [f"param/{n}" for n, p in pl_module.named_parameters() if p.requires_grad]  # not NxD's ranks
        moments = [k for k in before if "/exp_avg" in k]
        last = set(changed(before, after))
        result = {"rank": trainer.global_rank, "params": len(params), "moments": len(moments),
                  "changed": {s: changed(self.seen[s - 1], self.seen[s]) for s in (NONFINITE, GUARDED)},
                  "params_changed": len(last.intersection(params)),
                  "moments_changed": len(last.intersection(moments))}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _poison_backward(module, args, output) -> None:
    output.register_hook(lambda grad: grad * math.inf)  # the loss, computed in the forward, stays finite


def snapshot(trainer, module) -> dict:
    """This rank's weights and its optimizer's state_dict, copied: {path: tensor or plain value}."""
    out = {f"param/{name}": _local(p) for name, p in module.named_parameters()}
    _flatten(trainer.optimizers[0].state_dict(), "optimizer", out)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard
        t = t.to_local()
    return t.to("cpu", copy=True).contiguous()


def _flatten(obj, path: str, out: dict, depth: int = 0) -> None:
    """Every tensor and plain value in a state_dict, by path; other objects by their attributes."""
    if isinstance(obj, torch.Tensor):
        out[path] = _local(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if key not in MOVING:
                _flatten(value, f"{path}/{key}", out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{path}/{i}", out, depth + 1)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        out[path] = obj
    elif hasattr(obj, "__dict__") and depth < 8:  # DeepSpeed's loss scaler, its fragment addresses
        _flatten(vars(obj), f"{path}:{type(obj).__name__}", out, depth + 1)
    else:
        out[path] = repr(obj)


def changed(before: dict, after: dict) -> list[str]:
    """The paths whose value differs (tensors bit for bit)."""
    assert before.keys() == after.keys(), sorted(before.keys() ^ after.keys())
    return [key for key in before if not _same(before[key], after[key])]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return type(a) is type(b) and a == b


def problems(run_dir: Path, probe: Path, world: int) -> list[str]:
    """What the run in `run_dir` (its probe's files in `probe`) did wrong; [] when the skips held."""
    from moe.train.metrics import read_metrics

    found = []
    ranks = [json.loads(p.read_text()) for p in sorted(Path(probe).glob("rank*.json"))]
    if sorted(r["rank"] for r in ranks) != list(range(world)):
        return [f"probe files of ranks {[r['rank'] for r in ranks]}, not of all {world}"]
    for r in ranks:
        where = f"rank {r['rank']}"
        if not (r["params"] and r["moments"]):
            found.append(f"{where}: no weights or no Adam moments seen ({r['params']}, {r['moments']})")
        for step in (NONFINITE, GUARDED):  # bit for bit: weights, moments, step counts, partitions
            if r["changed"][str(step)]:
                found.append(f"{where}: skipped step {step} changed {r['changed'][str(step)][:6]} "
                             f"({len(r['changed'][str(step)])} in all)")
        if (r["params_changed"], r["moments_changed"]) != (r["params"], r["moments"]):
            found.append(f"{where}: step {STEPS} changed {r['params_changed']} of {r['params']} weights, "
                         f"{r['moments_changed']} of {r['moments']} moments")
    rows = [row for row in read_metrics(Path(run_dir) / "metrics.csv") if row["loss"]]
    skipped = [int(row["skipped_steps"]) for row in rows]
    if skipped != [0] * (NONFINITE - 1) + [1, 2] + [2] * (STEPS - GUARDED):
        found.append(f"metrics.csv's skipped_steps: {skipped}")
    else:
        nonfinite, guarded = rows[NONFINITE - 1], rows[GUARDED - 1]
        if not math.isfinite(float(nonfinite["loss"])) or math.isfinite(float(nonfinite["grad_norm"])):
            found.append(f"step {NONFINITE}: loss {nonfinite['loss']} (finite wanted), grad_norm "
                         f"{nonfinite['grad_norm']} (the guard's: non-finite wanted)")
        if not math.isfinite(float(guarded["grad_norm"])):
            found.append(f"step {GUARDED}: grad_norm {guarded['grad_norm']} (finite wanted)")
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    if (summary["skipped_steps"], summary["nonfinite_steps"]) != (2, 1):
        found.append(f"summary.json: skipped_steps {summary['skipped_steps']}, nonfinite_steps "
                     f"{summary['nonfinite_steps']} (2, 1 wanted)")
    return found


if __name__ == "__main__":  # run.sh: `python skip_probe.py --ledger RUN_DIR` before train.py, then
    if sys.argv[1] == "--ledger":  # `python skip_probe.py RUN_DIR WORLD` (the probe's files in RUN_DIR/probe)
        write_ledger(Path(sys.argv[2]))
        sys.exit(0)
    run, world = Path(sys.argv[1]), int(sys.argv[2])
    listed = problems(run, run / "probe", world)
    for line in listed:
        print(f"[rank 0]   {line}", flush=True)
    verdict = "FAILED" if listed else f"weights and optimizer state unchanged, step {STEPS} updated"
    print(f"summary: {world} ranks, steps {NONFINITE} (non-finite gradient) and {GUARDED} (the guard's) "
          f"skipped: {verdict}")
    sys.exit(1 if listed else 0)
