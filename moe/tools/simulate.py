"""`python train.py <config> simulate=true`: one rank's real training step at full size, on this CPU.

The run's own code builds the model, shards the experts over a fake process group of the
configured world size (torch's "fake" backend: collectives return at once), applies activation
checkpointing, and runs a forward, the loss, a backward and an optimizer step, twice (the first
step creates the optimizer state), with every tensor a FakeTensor: shapes and dtypes are real,
storage is never allocated. torch's MemTracker (torch.distributed._tools.mem_tracker) counts the
bytes each live tensor would hold on the device, by kind. torchtitan's memory estimator
(scripts/estimate/estimation.py, up to commit 4a950ea) is the model for this sequence.

What it assumes: routing is balanced but for the simulated rank, which holds the hottest expert at
`routing_skew` times its share and receives its extra rows under dropless expert parallelism (no data
exists to route; moe.model.sync, as the planner assumes), and the DeepSpeed ZeRO optimizer is its fp32
master partition plus two moments and the partition's fp32 gradient (deepspeed 0.19.8
runtime/zero/stage_1_and_2.py: fp32 partitions :364, the partition's fp32 gradient set at :3126 after
the half gradients are freed at :3128, stepped at :3139), and its reduce bucket, which the engine would
allocate, is added as the planner counts it
(BackendSpec.comm_buffer_bytes). What no tensor here holds, the runtime's context, NCCL's buffers and
the allocator's reserve, is added as `hardware.fixed_memory_gib` (a "Fixed" entry). Not counted: DDP's
gradient buckets.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe.backends.registry import spec_of
from moe.config.derived import precision, precision_of
from moe.config.specs import BackendSpec
from moe.model.sync import assumed_skew
from moe.outputs import atomic_path
from moe.parallel.dims import ParallelDims
from moe.tools.plan import GIB, make_plan

SIMULATION_FILE = "simulation.json"
COMM = "Comm"  # the breakdown's entry for communication buffers added from the plan
HOST = "Host"  # the breakdown's entry for what parallel.offload_experts keeps in host memory
FIXED = "Fixed"  # the breakdown's entry for hardware.fixed_memory_gib, added from the plan


@dataclass
class Simulation:
    """One rank's simulated step: what simulation.json holds (GiB per device)."""

    world_size: int
    rank: int
    params_local: int
    params_total: int
    peak_memory_gib: float
    planned_peak_memory_gib: float
    breakdown_gib: dict  # MemTracker's peak by kind: Parameter, Gradient, Activation, Optstate, Temp...
    planned_gib: dict  # the planner's parameters, gradients, optimizer, activations
    precision: str
    micro_batch_size: int
    seq_len: int
    seconds: float

    @property
    def planner_error(self) -> float:
        """(planned - simulated) / simulated."""
        return (self.planned_peak_memory_gib - self.peak_memory_gib) / self.peak_memory_gib

    def render(self) -> str:
        kinds = sorted(set(self.breakdown_gib) | {"Total"}, key=lambda k: (k == "Total", k))
        lines = [f"simulation: rank {self.rank} of {self.world_size}, micro-batch {self.micro_batch_size} x "
                 f"{self.seq_len} tokens, {self.precision} ({self.seconds:.0f} s on this CPU, fake tensors)",
                 f"parameters   {self.params_local / 1e9:.3f}B on this rank of "
                 f"{self.params_total / 1e9:.3f}B",
                 "peak memory per device (GiB)"]
        lines += [f"  {kind:<11}{self.breakdown_gib.get(kind, 0.0):>9.2f}" for kind in kinds]
        lines.append(f"  planner    {self.planned_peak_memory_gib:>9.2f}  ({100 * self.planner_error:+.1f}% "
                     "against the simulation)")
        if COMM in self.breakdown_gib:
            lines.append(f"  ({COMM}: DeepSpeed's reduce bucket as the planner counts it; its engine does "
                         "not run here)")
        return "\n".join(lines)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters are built in the dtype the backend keeps them in (fake ones cannot be cast later)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _param_dtype_and_autocast(trainer, hardware) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype of the weights on the device, autocast dtype or None), as the backend trains."""
    run = precision(trainer, hardware)
    weights = run.half if run.mixed and spec_of(hardware).half_weights_when_mixed else run.param_dtype
    autocast = run.autocast_dtype
    return getattr(torch, weights), None if autocast is None else getattr(torch, autocast)


def _local_shard_optimizer(optimizer, model) -> _Optimizer:
    """The run's optimizer (its groups, its fused AdamW) over each DTensor parameter's local shard, which is
    what its step computes on: torch's MemTracker, fed DTensor sharding propagation's fake tensors during
    an optimizer step, counts global-size tensors that never exist (measured: 17x the moments of a
    2-layer FSDP2 model), so the simulation steps the local shards the DTensor step would."""
    views: dict[int, tuple] = {}
    for group in optimizer.param_groups:
        group["params"] = [views.setdefault(id(p), (p, torch.nn.Parameter(p._local_tensor)))[1]
                           for p in group["params"]]
    return _Optimizer(optimizer, model, local_views=list(views.values()))


def _zero_shards(dims: ParallelDims) -> tuple[int, int]:
    """(ranks the dense optimizer state is split over, ranks the expert state is split over)."""
    if dims.zero_stage < 1:
        return 1, 1
    return dims.dp, dims.expert_dp


def _forget_earlier_worlds_meshes() -> None:
    """Clear DTensor's sharding-propagation cache. It matches meshes by their ranks, layout and dim names,
    not by their process groups (DeviceMesh.__eq__), so after an earlier world in this process (a multirun of
    simulations) a cached output spec could carry that world's mesh, and a collective a group name this world
    never registered."""
    from torch.distributed.tensor import DTensor, debug

    if hasattr(debug, "_clear_sharding_prop_cache"):  # torch >= 2.10: the Python and the C++ fast-path cache
        debug._clear_sharding_prop_cache()
    else:  # torch 2.9: the Python cache only (a thread-local lru_cache)
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_clear()


def simulate(cfg, dims: ParallelDims, run_dir: str | Path | None) -> Simulation:
    """Run the simulated step of rank `cfg.simulate_rank`; write <run_dir>/simulation.json."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moe.backends import backend_class
    from moe.model import MoETransformer
    from moe.module.optim import build_optimizer
    from moe.parallel.apply import moe_layers
    from moe.parallel.parallelize import parallelize
    from moe.parallel.pipeline import StageParts

    rank, start, spec = cfg.simulate_rank, time.perf_counter(), spec_of(cfg.hardware)
    param_dtype, autocast = _param_dtype_and_autocast(cfg.trainer, cfg.hardware)
    _forget_earlier_worlds_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world)
    try:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # meta parameters become fake ones
        # the backend's parallelize steps (moe.parallel.parallelize) on the fake ranks, storage fake
        backend = backend_class(cfg.hardware)
        steps = backend.simulated_plan(cfg.moe_opt, cfg.parallel, cfg.hardware, cfg.trainer, dims, fake_mode)
        pipeline = None
        if dims.pp_enabled:  # this rank's stages, built on meta, parallelised and scheduled as training does
            with _default_dtype(param_dtype):
                pipeline = _pipeline(cfg.model, cfg.moe_opt, cfg.parallel, cfg.trainer, cfg.hardware,
                                     cfg.seed, dims, steps)
            model, root = StageParts(pipeline.parts), pipeline.parts[0]
        else:
            with torch.device("meta"), _default_dtype(param_dtype):
                model = root = MoETransformer(cfg.model, cfg.moe_opt, init_seed=cfg.seed)
            parallelize(model, cfg.model, cfg.parallel, dims.tp, steps)  # the backend's, on fake ranks
        for layer in moe_layers(model):  # what a GPU runs in half precision; fake kernels exist for bf16 only
            layer.experts.use_grouped_mm = (autocast or param_dtype) == torch.bfloat16
        params_local = sum(_local_numel(p) for p in model.parameters())

        with fake_mode:
            optimizer = _optimizer(cfg.optimizer, spec, dims, model, param_dtype, build_optimizer)
            rows = cfg.trainer.micro_batch_size
            if pipeline is not None:  # the schedule's micro-batch: the rank's step batch cut in n pieces
                rows = rows * cfg.trainer.accumulate_grad_batches // pipeline.n_microbatches
            tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len))
        # FSDP2's tracker follows one forward per module a step: a pipeline runs one per micro-batch
        fsdp_tracker = spec.sharded_backward and pipeline is None  # FSDP2 units: its own tracker
        tracker = (_device_peak_tracker(root, optimizer.optimizer) if fsdp_tracker else
                   _device_peak_tracker(modules=pipeline is None))
        if fsdp_tracker:
            tracker.track_inputs((tokens,))
        else:
            masters = [part for part, _ in optimizer.partitions or []]  # DeepSpeed's fp32 master partitions
            tracker.track_external(model, optimizer.optimizer, tokens, *masters)  # made outside the tracker
        with fake_mode, tracker, assumed_skew(cfg.routing_skew):
            for step in range(2):  # the first step creates the optimizer state; the second has it all
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    if pipeline is not None:
                        _pipeline_step(pipeline, dims.pp_rank(rank), tokens)
                    else:
                        out = model(tokens, labels_BS=tokens)  # as LitMoE.micro_batch_loss: chunked head + CE
                        out.loss.backward()
                optimizer.step()
                if step == 0:
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
        offloaded = _offloaded_states(model, optimizer, fsdp_tracker) if cfg.parallel.offload_experts else {}
    finally:
        dist.destroy_process_group()
        dims.forget_world()

    device_peak = max(peak.values(), key=lambda kinds: kinds["Total"])
    breakdown = {getattr(k, "value", str(k)): v / GIB for k, v in device_peak.items() if v}
    if offloaded:  # what CPUOffloadPolicy keeps in host memory (here every tensor is on the one CPU)
        for kinds, gib in offloaded.items():
            for kind in kinds:  # FSDP2 sets the reduced gradient itself: a tracker may see it as Temp
                moved = min(gib, breakdown.get(kind, 0.0))
                breakdown[kind] = breakdown.get(kind, 0.0) - moved
                breakdown[HOST] = breakdown.get(HOST, 0.0) + moved
                gib -= moved
        breakdown["Total"] -= breakdown[HOST]
    plan = make_plan(cfg, dims)
    if plan.memory.fixed:  # no runtime here: its context and communication buffers are added as planned
        breakdown[FIXED] = plan.memory.fixed
        breakdown["Total"] += plan.memory.fixed
    # DeepSpeed's engine does not run here: its buckets are added as planned (FSDP2's gathered weights
    # are real tensors of the simulated step, counted by the tracker)
    if plan.memory.comm and not spec.simulated_model_parallel:
        breakdown[COMM] = plan.memory.comm
        breakdown["Total"] += plan.memory.comm
    result = Simulation(
        world_size=dims.world, rank=rank, params_local=params_local,
        params_total=plan.params_total, peak_memory_gib=breakdown["Total"],
        planned_peak_memory_gib=plan.memory.total,
        breakdown_gib=breakdown,
        planned_gib={"parameters": plan.memory.params, "gradients": plan.memory.grads,
                     "optimizer": plan.memory.optimizer, "activations": plan.memory.activations,
                     "step": plan.memory.step, "comm": plan.memory.comm},
        precision=precision_of(cfg.trainer, cfg.hardware),
        micro_batch_size=cfg.trainer.micro_batch_size, seq_len=cfg.data.seq_len,
        seconds=time.perf_counter() - start)
    if run_dir is not None:
        path = Path(run_dir) / SIMULATION_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        record = asdict(result) | {"planner_error": result.planner_error}
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(record, indent=2) + "\n")
    return result


def _pipeline(model, moe_opt, parallel, trainer, hardware, seed: int, dims: ParallelDims, steps):
    """This rank's pipeline, built as training builds it (moe.parallel.pipeline.build_pipeline: its stages,
    each parallelised by the backend's `steps` on the fake ranks, and the schedule over the mesh's pp dim)."""
    from moe.parallel.parallelize import parallelize
    from moe.parallel.pipeline import build_pipeline

    return build_pipeline(model, moe_opt, parallel, trainer, hardware, seed, dims, dims.meshes("cpu"),
                          lambda part: parallelize(part, model, parallel, dims.tp, steps),
                          torch.device("cpu"))


def _pipeline_step(pipeline, pp_rank: int, tokens: torch.Tensor) -> None:
    """One step of this rank's actions in the schedule's own order (its pipeline_order: forwards, full or
    input backwards; weight passes are left in the input ones), every activation kept until its backward;
    a stage's inputs from its neighbours are fake tensors of their static shape. FSDP2 accumulates without
    reducing until the end, then reduces, as PipelineStage does (stage.py:844-847, perform_reduce_grad)."""
    schedule = pipeline.schedule
    stages = {stage.stage_index: stage for stage in getattr(schedule, "_stages", None) or [schedule._stage]}
    kept = {}
    for stage_index, kind, micro_batch in _rank_actions(schedule, pp_rank, pipeline.n_microbatches):
        stage = stages[stage_index]
        if kind == "F":
            part = stage.submod
            x = tokens if part.first else _received(stage)
            kept[(stage_index, micro_batch)] = part(x, labels_BS=tokens)
        elif kind in ("B", "I"):
            out = kept.pop((stage_index, micro_batch))
            stage.submod.set_is_last_backward(False)
            stage.submod.set_reshard_after_backward(False)
            stage.submod.set_requires_gradient_sync(False)
            if stage.submod.last:
                (out * stage.submod.loss_scale).backward()
            else:
                out.backward(torch.ones_like(out))
    for stage in stages.values():
        stage.perform_reduce_grad(1)


def _received(stage) -> torch.Tensor:
    """What `stage` would receive from its neighbour on a fake rank: a tensor of its static input's shape."""
    meta = stage._user_meta.inputs[0]
    return torch.randn(meta.shape, dtype=meta.dtype, requires_grad=True)


def _rank_actions(schedule, pp_rank: int, n: int) -> list[tuple[int, str, int]]:
    """(stage, "F" | "B" | "I" | "W", micro-batch) in the order this rank runs them. A looped schedule's
    own pipeline_order (what its runtime executes); a one-stage schedule's order as its _step_microbatches
    runs it (torch 2.13's _get_pipeline_order for 1F1B numbers the last stage's forwards from 1): GPipe
    every forward then every backward, 1F1B min(n, stages - stage) forwards, then one backward and one
    forward in turn, then the remaining backwards (schedules.py:1052-1120)."""
    if hasattr(schedule, "_stages"):
        return [(a.stage_index, a.computation_type.value, a.microbatch_index)
                for a in schedule.pipeline_order[pp_rank] if a is not None and a.microbatch_index is not None]
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    stage = schedule._stage.stage_index
    if isinstance(schedule, ScheduleGPipe):
        return [(stage, "F", i) for i in range(n)] + [(stage, "B", i) for i in range(n)]
    warmup = min(n, schedule._num_stages - stage)
    actions = [(stage, "F", i) for i in range(warmup)]
    for i in range(n - warmup):
        actions += [(stage, "B", i), (stage, "F", warmup + i)]
    return actions + [(stage, "B", i) for i in range(n - warmup, n)]


def _offloaded_states(model, optimizer, fsdp_tracker: bool) -> dict[tuple, float]:
    """GiB of what parallel.offload_experts keeps in host memory (the experts' shards, their gradients and
    their AdamW states), by the tracker kinds (FSDPMemTracker's or MemTracker's names) that hold them."""
    from moe.model.moe import Experts

    params = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    ids = {id(p) for p in params}
    views = {id(view): param for param, view in optimizer.local_views if id(param) in ids}
    states = [t for view, state in optimizer.optimizer.state.items() if id(view) in views
              for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    def nbytes(tensors) -> float:
        return sum(_local_numel(t) * t.element_size() for t in tensors) / GIB

    grads = nbytes(params) * 4 / params[0].element_size() if params else 0.0  # reduced in fp32
    if fsdp_tracker:
        return {("Sharded Param",): nbytes(params), ("OptState",): nbytes(states),
                ("Sharded Grad", "Temp"): grads}
    return {("Parameter",): nbytes(params), ("Optstate",): nbytes(states), ("Gradient", "Temp"): grads}


def _local_numel(p: torch.Tensor) -> int:
    """Elements this rank stores: a DTensor's local shard."""
    return getattr(p, "_local_tensor", p).numel()


def _device_peak_tracker(fsdp_model=None, optimizer=None, modules: bool = True):
    """torch's MemTracker (its FSDPMemTracker for an FSDP2 model: it knows sharded and gathered weights
    apart), keeping the per-device peak only: the per-module peaks (which nothing here reads) walk every
    module entered so far at every op, hours for a 56-layer model under FSDP2 + DTensor."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class DevicePeakTracker(FSDPMemTracker if fsdp_model is not None else MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    if not modules:  # a pipeline runs each stage once per micro-batch: no per-module states to follow
        class DevicePeakTracker(DevicePeakTracker):  # noqa: F811
            def _pre_fw_hook(self, module, inputs) -> None: ...
            def _post_fw_hook(self, module, inputs, outputs) -> None: ...
            def _pre_bw_hook(self, module, args) -> None: ...
            def _post_bw_hook(self, module, args) -> None: ...

    return DevicePeakTracker(fsdp_model, optimizer) if fsdp_model is not None else DevicePeakTracker()


class _Optimizer:
    """The optimizer step the backend runs, in its memory shape.

    Plain torch (DDP): the run's own AdamW over the model's parameters. DeepSpeed: its ZeRO
    optimizer keeps, per rank, an fp32 master copy of its 1/shard partition of the dense and
    expert weights, that partition's fp32 gradient and AdamW's two moments; the model's own
    (half precision) gradients are freed once reduced into the partition.
    """

    def __init__(self, optimizer, model, partitions=None, local_views=None):
        self.optimizer, self.model, self.partitions = optimizer, model, partitions
        self.local_views = local_views or []  # FSDP2: (DTensor parameter, the optimizer's view of its shard)

    def step(self) -> None:
        for param, view in self.local_views:
            view.grad = None if param.grad is None else param.grad._local_tensor
        if self.partitions is not None:
            for part, params in self.partitions:
                part.grad = torch.zeros_like(part)  # the reduced fp32 gradient partition
                for p in params:
                    p.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for param, view in self.local_views:
            param.grad = view.grad = None
        if self.partitions is None:
            self.model.zero_grad(set_to_none=True)


def _optimizer(optimizer, spec: BackendSpec, dims: ParallelDims, model, param_dtype,
               build_optimizer) -> _Optimizer:
    """The optimizer `spec`'s backend steps, built from the `optimizer` section over `model`."""
    shards = spec.optimizer_shards
    if shards == "dtensor":
        return _local_shard_optimizer(build_optimizer(model, optimizer), model)
    if shards != "zero" or (dims.zero_stage < 1 and param_dtype == torch.float32):
        return _Optimizer(build_optimizer(model, optimizer), model)
    dense_shard, expert_shard = _zero_shards(dims)
    dense = [p for p in model.parameters() if not getattr(p, "is_expert", False)]
    expert = [p for p in model.parameters() if getattr(p, "is_expert", False)]
    partitions = []
    for params, shard in ((dense, dense_shard), (expert, expert_shard)):
        if params:
            numel = -(-sum(p.numel() for p in params) // shard)
            partitions.append((torch.nn.Parameter(torch.empty(numel, dtype=torch.float32)), params))
    parts = [part for part, _ in partitions]
    adamw = torch.optim.AdamW(parts, lr=optimizer.lr, fused=True)  # as build_optimizer gives DeepSpeed
    return _Optimizer(adamw, model, partitions)
