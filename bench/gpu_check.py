"""`make gpu-check`: every GPU path of train.py trains on this machine's CUDA GPUs, one table proves it.

Each path trains moe_1b (1.2B parameters, 0.4B active) at seq 2048 for --steps steps from the bundled data,
with the product's defaults (bf16-mixed, clipping at 1.0, fused AdamW), as `python train.py ...` in its own
process: DDP, DeepSpeed ZeRO-2 with and without overlap_comm, FSDP2 at zero_stage 3 and 2, FSDP2 compiled,
FSDP2 with its experts offloaded, and with 2 or more GPUs EP 2 and TP 2 x EP 2. It prints one markdown
table (exit code, first and last loss, tokens/s, MFU, peak memory measured against the planner's, the
experts' kernel), then runs bench/gpu_moe_stack.py, train.py beside the bare model (DDP and FSDP2 at the
same shape: bench/train_vs_bare.py) and our MoE layer beside torchtitan's on the GPU, eager and compiled.
It exits 1 if any path fails or its loss does not fall. Paths whose library is missing (DeepSpeed) and the
torchtitan comparison are skipped with one line each.

    python bench/gpu_check.py                 # from a checkout, no install: torch, Lightning, transformers,
                                              # hydra-core, omegaconf and datasets importable
    python bench/gpu_check.py --cpu-smoke     # every path at the tiny size on this CPU: checks the script
    python bench/gpu_check.py --only fsdp2_zero3 ddp_bf16 --steps 50
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled


@dataclass(frozen=True)
class GpuPath:
    name: str
    overrides: tuple[str, ...]
    gpus: int = 1
    needs: str | None = None  # a module the path imports that the GPU image may lack


PATHS = (
    GpuPath("ddp_bf16", ("hardware=gpu", "hardware.strategy=ddp", "parallel=single")),
    GpuPath("deepspeed_zero2_overlap", ("hardware=gpu", "parallel=single", "parallel.zero_stage=2",
                                        "parallel.overlap_comm=true"), needs="deepspeed"),
    GpuPath("deepspeed_zero2", ("hardware=gpu", "parallel=single", "parallel.zero_stage=2",
                                "parallel.overlap_comm=false"), needs="deepspeed"),
    GpuPath("fsdp2_zero3", ("hardware=gpu_fsdp2", "parallel.zero_stage=3")),
    GpuPath("fsdp2_zero2", ("hardware=gpu_fsdp2", "parallel.zero_stage=2")),
    GpuPath("fsdp2_compile", ("hardware=gpu_fsdp2", "model.compile=true")),
    GpuPath("fsdp2_offload_experts", ("hardware=gpu_fsdp2", "parallel.offload_experts=true")),
    GpuPath("fsdp2_ep2", ("hardware=gpu_fsdp2", "parallel.ep=2"), gpus=2),
    GpuPath("fsdp2_tp2_ep2", ("hardware=gpu_fsdp2", "parallel=fsdp2_tp2", "parallel.ep=2"), gpus=2),
)
# our MoE layer beside torchtitan's: Mixtral 8x7B's layer and a fine-grained one, 16,384 tokens (issue O)
LAYER_SHAPES = ("--hidden 4096 --width 14336 --experts 8 --top-k 2 --tokens 16384".split(),
                "--hidden 2048 --width 1408 --experts 64 --top-k 6 --tokens 16384".split())
LAYER_SMOKE = ("--hidden 64 --width 128 --tokens 256 --steps 3 --repeats 1".split(),)
CPU_HARDWARE = {"hardware=gpu": "hardware=cpu_deepspeed", "hardware=gpu_fsdp2": "hardware=cpu_fsdp2"}


def size_overrides(args) -> tuple[str, ...]:
    """What every path shares: the model and sequence, a short run, and nothing written but the metrics."""
    common = (f"trainer.max_steps={args.steps}", "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
              "trainer.limit_val_batches=0", "trainer.save_checkpoints=false", "optimizer.warmup_steps=3",
              "resume=false", f"trainer.gc_every_n_steps={args.gc_every}")
    if args.cpu_smoke:
        return (*common, "model=tiny", "data.seq_len=128", "trainer.micro_batch_size=2")
    return (*common, "model=moe_1b", "data.seq_len=2048", f"trainer.micro_batch_size={args.micro_batch}")


def path_overrides(path: GpuPath, args) -> list[str]:
    overrides = list(path.overrides)
    if args.cpu_smoke:  # the same backend on the CPU (DDP over gloo is hardware=cpu's own)
        if path.name == "ddp_bf16":
            overrides = ["hardware=cpu", "parallel=single"]
        overrides = [CPU_HARDWARE.get(o, o) for o in overrides]
        overrides.append("trainer.precision=bf16-mixed")
    return [*overrides, f"trainer.devices={path.gpus}", *size_overrides(args)]


def planned_tensor_gib(overrides: list[str]) -> float | None:
    """The planner's per-device peak for these overrides, less its fixed costs (CUDA context, NCCL
    buffers): what torch.cuda.max_memory_allocated measures."""
    from moe.tools.plan import make_plan
    from moe.train.preflight import compose_config
    from moe.train.run import settle

    try:
        cfg, _ = compose_config(overrides, str(REPO / "conf"), "train")
        settled = settle(cfg)
        memory = make_plan(settled.config, settled.dims).memory
    except Exception as err:  # the run itself reports a bad config; the table shows "-"
        print(f"  (no plan for {' '.join(overrides)}: {err})")
        return None
    return memory.total - memory.fixed


def train(path: GpuPath, args, out: Path) -> dict:
    """Run train.py for one path; its row's figures from metrics.csv and summary.json."""
    import csv

    overrides = path_overrides(path, args)
    run_dir = out / path.name
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with (out / f"{path.name}.log").open("w") as log:
        try:
            command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
            rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    row = {"path": path.name, "rc": rc, "seconds": time.perf_counter() - start,
           "planned_gib": planned_tensor_gib(overrides), "log": str(out / f"{path.name}.log")}
    metrics = run_dir / "metrics.csv"
    if metrics.exists():
        with metrics.open(newline="") as f:
            losses = [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]
        row.update(first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None)
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        row.update(tokens_per_s=s.get("tokens_per_s"), mfu=s.get("mfu"), kernel=s.get("expert_kernel"),
                   peak_gib=(s["peak_memory_mib"] / 1024 if s.get("peak_memory_mib") else None))
    return row


def passed(row: dict) -> bool:
    first, last = row.get("first_loss"), row.get("last_loss")
    return row["rc"] == 0 and first is not None and last is not None and last < first


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = ("path", "exit", "first loss", "last loss", "tokens/s", "MFU", "peak GiB measured / planned",
           "experts", "ok")


def print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|")
    for r in rows:
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        cells = [r["path"], str(r["rc"]), fmt(r.get("first_loss"), ".3f"), fmt(r.get("last_loss"), ".3f"),
                 fmt(r.get("tokens_per_s"), ",.0f"), fmt(mfu, ".1f") + "%",
                 f"{fmt(r.get('peak_gib'), '.1f')} / {fmt(r.get('planned_gib'), '.1f')}",
                 r.get("kernel") or "-", "yes" if passed(r) else "NO"]
        print("| " + " | ".join(cells) + " |")


def run_bench(argv: list[str], timeout: int) -> int:
    print(f"\n$ python {' '.join(argv)}", flush=True)
    try:
        return subprocess.run([sys.executable, *argv], cwd=REPO, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout} s")
        return 124


def environment_line(cpu_smoke: bool) -> str:
    import lightning
    import torch

    card = "CPU (smoke)" if cpu_smoke else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    cuda = "" if cpu_smoke else f", CUDA {torch.version.cuda}"
    return (f"{card}; torch {torch.__version__}{cuda}, Lightning {lightning.__version__}, "
            f"Python {platform.python_version()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences of 2048 tokens per GPU")
    parser.add_argument("--only", nargs="+", choices=[p.name for p in PATHS], help="these paths only")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a path may take before it fails")
    parser.add_argument("--gc-every", type=int, default=0,
                        help="trainer.gc_every_n_steps: Python's collector between steps only (0: automatic)")
    parser.add_argument("--out", type=Path, default=None, help="runs and logs (default: a temp dir)")
    parser.add_argument("--no-bench", action="store_true", help="the paths only, not the GPU benches")
    parser.add_argument("--cpu-smoke", action="store_true", help="every path at the tiny size on this CPU")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if not gpus and not args.cpu_smoke:
        print("error: make gpu-check trains on CUDA GPUs and torch sees none here. Fix: run it on a GPU "
              "machine, or pass --cpu-smoke (make gpu-check ARGS=--cpu-smoke) to check the script here.",
              file=sys.stderr)
        return 2
    available = 2 if args.cpu_smoke else gpus
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    print(environment_line(args.cpu_smoke))
    rows = []
    for path in PATHS:
        if args.only and path.name not in args.only:
            continue
        if path.gpus > available:
            print(f"skipped {path.name}: needs {path.gpus} GPUs, this machine has {available}")
            continue
        if path.needs and importlib.util.find_spec(path.needs) is None:
            print(f"skipped {path.name}: {path.needs} is not importable here (pip install deepspeed)")
            continue
        print(f"training {path.name} ...", flush=True)
        rows.append(train(path, args, out))
        if not passed(rows[-1]):
            print(f"  {path.name} failed: exit {rows[-1]['rc']}, log {rows[-1]['log']}")
        shutil.rmtree(out / path.name / "checkpoints", ignore_errors=True)
    print()
    print_table(rows)
    failed = [r["path"] for r in rows if not passed(r)]
    if not args.no_bench:
        smoke = ["--cpu-smoke"] if args.cpu_smoke else []
        run_bench(["bench/gpu_moe_stack.py", *smoke], args.timeout)
        steps = ["--steps", "3" if args.cpu_smoke else "10"]
        for backend in ("ddp", "fsdp2"):
            device = [] if args.cpu_smoke else ["--gpu"]
            run_bench(["bench/train_vs_bare.py", *steps, *device, "--backend", backend], args.timeout)
        if importlib.util.find_spec("torchtitan") is None:
            print("\nskipped our MoE layer beside torchtitan's: torchtitan is not importable here "
                  "(bash ../shared/gpu/wheels.sh fills .whl/ with it)")
        else:
            device = "cpu" if args.cpu_smoke else "cuda"
            for shape in LAYER_SMOKE if args.cpu_smoke else LAYER_SHAPES:
                for compiled in ([], ["--compile"]):  # eager, then both compiled as model.compile=true
                    run_bench(["bench/vs_torchtitan.py", "--device", device, *shape, *compiled], args.timeout)
    print(f"\nruns and logs: {out}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (exit non-zero, or the loss did not fall)")
        return 1
    print(f"all {len(rows)} paths trained and their loss fell")
    return 0


if __name__ == "__main__":
    sys.exit(main())
