"""The rest of a train.py run: trainer counts, data, optimizer and schedule, the spike guard, loggers and
callbacks, waits, the planner's inputs, simulation, seeds, and the config as a whole (known keys,
finite numbers)."""
from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from moe.backends.registry import SPECS
from moe.config.choices import (
    AC_POLICIES,
    DATA_FORMATS,
    DATA_KINDS,
    SPIKE_ACTIONS,
)
from moe.config.derived import precision_of
from moe.config.rules.architecture import validate_model
from moe.config.rules.entries import check_chat_template
from moe.config.rules.refusals import check_seed, finite_number, need, one_of
from moe.config.schema import MIXTURE_CHUNK, source_label
from moe.errors import ConfigError, did_you_mean


def check_trainer_counts(trainer) -> None:
    t = trainer
    for key in ("devices", "num_nodes", "micro_batch_size", "accumulate_grad_batches"):
        value = getattr(t, key)
        need(value >= 1, f"trainer.{key}", value, f"set trainer.{key} to 1 or more", "must be at least 1")
    need(t.max_steps > 0, "trainer.max_steps", t.max_steps, "set trainer.max_steps to a positive number",
         "must be positive")
    for key in ("log_every_n_steps", "val_check_interval", "checkpoint_every_n_steps",
                "keep_last_checkpoints"):
        value = getattr(t, key)
        need(value >= 1, f"trainer.{key}", value, f"set trainer.{key} to 1 or more", "must be at least 1")
    need(t.limit_val_batches >= 0, "trainer.limit_val_batches", t.limit_val_batches,
         "use 0 (no validation) or more batches", "must not be negative")
    need(t.gc_every_n_steps >= 0, "trainer.gc_every_n_steps", t.gc_every_n_steps,
         "use 0 (Python's automatic collection) or a step count such as 50", "must not be negative")


def check_activation_checkpointing(parallel) -> None:
    p = parallel
    one_of("parallel.activation_checkpointing", p.activation_checkpointing, AC_POLICIES, "policy")
    need(p.activation_checkpointing_every_n >= 1, "parallel.activation_checkpointing_every_n",
         p.activation_checkpointing_every_n, "use 1 or more", "must be at least 1")


def check_model(model, moe_opt) -> None:
    validate_model(model, moe_opt)


def check_fp8_experts(model, moe_opt, trainer, hardware) -> None:
    """moe_opt.fp8_experts: bf16 around the FP8 GEMMs (their output is bf16), and the GEMMs' K and N (the
    hidden and expert widths) in multiples of 16, as torch._scaled_grouped_mm needs (moe/model/fp8.py)."""
    if not moe_opt.fp8_experts:
        return
    precision = precision_of(trainer, hardware)
    need(precision in ("bf16-mixed", "bf16-true"), "trainer.precision", precision,
         "use trainer.precision=bf16-mixed (or bf16-true) with moe_opt.fp8_experts=true, or set it false",
         "does not go with moe_opt.fp8_experts: the FP8 expert GEMMs write bf16")
    for field in ("hidden_size", "intermediate_size"):
        size = getattr(model, field)
        need(size % 16 == 0, f"model.{field}", size,
             f"use a multiple of 16 (e.g. {(size + 15) // 16 * 16}), or set moe_opt.fp8_experts=false",
             "is not a multiple of 16, as the FP8 grouped GEMM needs for its operands' K and N")


def check_seq_len(model, data) -> None:
    m, seq_len = model, data.seq_len
    need(seq_len >= 1, "data.seq_len", seq_len, "use a positive sequence length such as 2048",
         "must be positive")
    need(seq_len <= m.max_position_embeddings, "data.seq_len", seq_len,
         f"use data.seq_len <= {m.max_position_embeddings}, or raise model.max_position_embeddings",
         f"exceeds model.max_position_embeddings={m.max_position_embeddings}")


def check_data(data) -> None:
    d = data
    one_of("data.kind", d.kind, DATA_KINDS, "data kind")
    one_of("data.format", d.format, DATA_FORMATS, "data format")
    finite_number("data.val_fraction", d.val_fraction, "use a fraction in [0, 1), e.g. 0.05")
    need(0 <= d.val_fraction < 1, "data.val_fraction", d.val_fraction, "use a fraction in [0, 1), e.g. 0.05",
          "is outside [0, 1)")
    need(d.num_workers >= 0, "data.num_workers", d.num_workers,
         "use 0 (load in the training process) or more", "must not be negative")
    if d.format == "chat":
        check_chat_template("data.chat_template", d.chat_template)
    if d.sources is not None:
        check_sources(d)
    if d.streaming:
        check_streaming(d)


def check_streaming(d) -> None:
    """Streaming packs online inputs as it reads them: one worker at most (more would each read the whole
    stream), counts that are not negative; mixtures are of prepared dirs, refused by check_sources."""
    need(d.kind == "online", "data.kind", d.kind, "use data=online data.path=FILES data.tokenizer=DIR, or "
         "set data.streaming=false", "is not online: data.streaming packs raw files as it reads them")
    need(d.num_workers in (0, 1), "data.num_workers", d.num_workers, "use data.num_workers=1 (one worker "
         "reads, tokenizes and packs the stream) or 0", "is more than one: each worker would read the whole "
         "stream with data.streaming=true")
    need(d.streaming_val_blocks >= 0, "data.streaming_val_blocks", d.streaming_val_blocks,
         "use 0 (no validation) or more, e.g. 32", "must not be negative")
    need(d.shuffle_buffer >= 1 or not d.shuffle, "data.shuffle_buffer", d.shuffle_buffer,
         "use a positive buffer such as 1024 blocks, or set data.shuffle=false",
         "must be positive to shuffle")


def check_sources(d) -> None:
    """A weighted mixture (data.sources): prepared dirs only, instead of data.path, each with a positive
    weight; their shared tokenizer and seq_len are checked where their meta.json is read
    (moe/data/mixture.py)."""
    example = "data.sources='[{path: DIR_A, weight: 0.7}, {path: DIR_B, weight: 0.3}]'"
    need(d.kind == "prepared", "data.kind", d.kind, "prepare each source with `python data_prep.py ... "
         f"output=DIR` and train with data=prepared {example}",
         "is not prepared: data.sources mixes prepared dirs only")
    need(len(d.sources) >= 1, "data.sources", [], f"list at least one prepared dir, e.g. {example}, or "
         "set data.sources=null and data.path=DIR", "is empty")
    need(not d.path, "data.path", d.path, "drop data.path (data.path=null) and list every dataset in "
         "data.sources, or drop data.sources (data.sources=null) to train on data.path alone",
         "is set together with data.sources: which one to train on is ambiguous")
    for k, source in enumerate(d.sources):
        need(bool(source.path), f"data.sources[{k}].path", source.path,
             f"give every source a data_prep.py output dir, e.g. {example}", "is required")
        finite_number(f"data.sources[{k}].weight", source.weight, "use a positive weight such as 0.3")
        need(source.weight > 0, f"data.sources[{k}].weight", source.weight,
             "use a positive weight such as 0.3 (weights need not sum to 1), or drop the source",
             "must be positive")
    total = sum(source.weight for source in d.sources)
    for k, source in enumerate(d.sources):
        need(source.weight / total * MIXTURE_CHUNK >= 1, f"data.sources[{k}].weight", source.weight,
             f"raise it to at least {total / MIXTURE_CHUNK:.3g} of the {total:g} total, or drop the source",
             f"is below 1/{MIXTURE_CHUNK} of the weights' sum: the source would never be drawn")
    names = [source_label(source) for source in d.sources]
    for k, name in enumerate(names):
        need(names.index(name) == k, f"data.sources[{k}]", name,
             "give it another name: {path: ..., weight: ..., name: OTHER}",
             f"has the same name as data.sources[{names.index(name)}]: their validation losses would be "
             "logged under one key")


def check_document_mask(data, parallel) -> None:
    """data.document_mask: a pipeline carries input_ids and labels only."""
    if not getattr(data, "document_mask", False):
        return
    need(parallel.pp == 1, "data.document_mask", True,
         "set data.document_mask=false with parallel.pp > 1, or train with parallel.pp=1",
         "is not carried through pipeline stages (they pass input_ids and labels only)")


def check_optimizer(optimizer) -> None:
    o = optimizer
    for key in ("lr", "min_lr", "eps", "weight_decay", "grad_clip"):
        finite_number(f"optimizer.{key}", getattr(o, key), f"use a finite optimizer.{key}")
    need(o.lr > 0, "optimizer.lr", o.lr, "use a positive learning rate such as 3e-4", "must be positive")
    need(0 <= o.min_lr <= o.lr, "optimizer.min_lr", o.min_lr, f"use 0 <= min_lr <= optimizer.lr={o.lr}",
         f"is outside 0..lr={o.lr}")
    need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer.betas", list(o.betas),
         "use two values in [0, 1), e.g. [0.9, 0.95]", "are not AdamW betas")
    need(o.eps > 0, "optimizer.eps", o.eps, "use a small positive epsilon such as 1e-8", "must be positive")
    need(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "use 0 or more, e.g. 0.1",
         "must not be negative")
    need(o.grad_clip >= 0, "optimizer.grad_clip", o.grad_clip,
         "use a positive max norm such as 1.0, or 0 for off", "must not be negative")


def check_schedule(optimizer) -> None:
    o = optimizer
    need(o.decay_steps is None or o.decay_steps >= 1, "optimizer.decay_steps", o.decay_steps,
         "use a positive step count, or null for trainer.max_steps", "must be at least 1")
    need(o.warmup_steps >= 0, "optimizer.warmup_steps", o.warmup_steps,
         "use 0 (no warm-up) or a positive step count", "must not be negative")


    # longer than the decay horizon (a short run with the default): moe.module.optim.warmup_of clamps it


def check_guard(trainer) -> None:
    """The loss-spike and NaN guard's keys in the trainer group (moe/train/guard.py)."""
    t = trainer
    one_of("trainer.spike_action", t.spike_action, SPIKE_ACTIONS, "spike action")
    finite_number("trainer.spike_factor", t.spike_factor, "use e.g. 3.0, or 0 to turn detection off")
    need(t.spike_factor == 0 or t.spike_factor > 1, "trainer.spike_factor", t.spike_factor,
         "use a multiple of the running mean above 1 (e.g. 3.0), or 0 to turn detection off",
         "would flag ordinary steps as spikes")
    need(t.spike_window >= 1, "trainer.spike_window", t.spike_window, "use 1 or more steps (e.g. 50)",
         "must be at least 1")
    need(t.spike_max_rollbacks >= 0, "trainer.spike_max_rollbacks", t.spike_max_rollbacks, "use 0 or more",
         "must not be negative")
    need(t.save_checkpoints or t.spike_action != "rollback", "trainer.spike_action", t.spike_action,
         "use trainer.spike_action=skip or warn, or trainer.save_checkpoints=true",
         "rolls back to the last checkpoint, and trainer.save_checkpoints=false writes none")
    need(t.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps", t.max_nonfinite_steps,
         "use 0 (never stop) or more (e.g. 10)", "must not be negative")


def check_in_run_eval(trainer, parallel, hardware) -> None:
    """trainer.eval_*: in-run evaluation (moe/eval/in_run.py) runs the whole model on each rank, so only where
    each rank holds all of it: the ddp strategy (one process, or DDP) without tensor, pipeline or expert
    parallelism (BackendSpec.whole_model_per_rank). Elsewhere the run's checkpoints are evaluated with
    python -m moe.eval."""
    t = trainer
    need(t.eval_every_n_steps >= 0, "trainer.eval_every_n_steps", t.eval_every_n_steps,
         "use 0 (no evaluation in the run) or a step count such as 100", "must not be negative")
    if not t.eval_every_n_steps:
        return
    need(len(t.eval_tasks) > 0, "trainer.eval_tasks", list(t.eval_tasks),
         "name at least one task, e.g. trainer.eval_tasks=[moe_tiny_mc]", "is empty")
    need(t.eval_batch_size >= 1, "trainer.eval_batch_size", t.eval_batch_size, "use 1 or more",
         "must be at least 1")
    need(t.eval_limit is None or t.eval_limit >= 1, "trainer.eval_limit", t.eval_limit,
         "use null (every document) or 1 or more", "must be at least 1")
    sharded = [f"parallel.{k}={getattr(parallel, k)}" for k in ("tp", "pp", "ep") if getattr(parallel, k) > 1]
    if not SPECS[hardware.strategy].whole_model_per_rank:
        sharded.insert(0, f"hardware.strategy={hardware.strategy}")
    need(not sharded, "trainer.eval_every_n_steps", t.eval_every_n_steps,
         "set trainer.eval_every_n_steps=0 and evaluate the run's checkpoints with python -m moe.eval "
         "ckpt=runs/<run> (docs/EVALUATION.md)",
         f"evaluates in the run only where every rank holds the whole model (the ddp strategy without tp, pp "
         f"or ep), and this run has {', '.join(sharded)}")


def check_instantiables(logger, callbacks) -> None:
    """logger.<name> and callbacks.<name>: nodes with a `_target_`, as Hydra instantiates them."""
    for group, nodes in (("logger", logger), ("callbacks", callbacks)):
        for name, node in (nodes or {}).items():
            target = node.get("_target_") if hasattr(node, "get") else None
            need(isinstance(target, str) and "." in target, f"{group}.{name}._target_", target,
                 f"give {group}.{name} a `_target_` naming a class, e.g. "
                 + ("lightning.pytorch.loggers.TensorBoardLogger" if group == "logger"
                    else "lightning.pytorch.callbacks.LearningRateMonitor"),
                 "is missing or not a dotted class path")


def check_waits(lock_wait_s, parallel) -> None:
    """How long a launch waits for the run dir's lock (moe/train/run_lock.py), and a rank for a peer in a
    collective (moe.parallel.comm.set_collective_timeout)."""
    wait = lock_wait_s
    need(wait is None or wait >= 0, "lock_wait_s", wait,
         "use 0 or more seconds, or null (120 s for a requeued SLURM job, else no wait)",
         "must not be negative")
    timeout = parallel.collective_timeout_s
    need(timeout > 0, "parallel.collective_timeout_s", timeout,
         "use a positive number of seconds (production: minutes, e.g. 1800; tests: a few seconds)",
         "must be positive")


def check_planning(routing_skew, hardware) -> None:
    """What the plan and the run's figures rest on: a skew below balance or a negative fixed cost means
    nothing, a device without peak FLOPS or memory divides MFU and the memory verdict by zero."""
    skew = routing_skew
    need(skew >= 1.0, "routing_skew", skew, "use 1.0 (perfect balance) or more, e.g. the default 2.0",
         "puts the hottest expert below its balanced share")
    hw = hardware
    need(hw.fixed_memory_gib >= 0, "hardware.fixed_memory_gib", hw.fixed_memory_gib, "use 0 or more GiB",
         "is negative")
    need(hw.peak_tflops > 0, "hardware.peak_tflops", hw.peak_tflops,
         "use the device's dense peak in TFLOPS (H100 SXM bf16: 989), which MFU divides by",
         "must be positive")
    need(hw.device_memory_gib > 0, "hardware.device_memory_gib", hw.device_memory_gib,
         "use the device's memory in GiB (H100: 80)", "must be positive")


def check_simulate(simulate, simulate_rank, parallel, world: int, spec) -> None:
    """simulate=true runs the torch model's own code path for one rank (moe/tools/simulate.py)."""
    if not simulate:
        return
    p = parallel
    if (p.tp > 1 or p.pp > 1) and not spec.simulated_model_parallel:
        raise ConfigError("simulate", True,
                          "use dry_run=true for this layout's plan (make test-neuron measures trn1's at "
                          "reduced width, docs/TRAINIUM.md), or the torch-native backend for TP and PP "
                          "(hardware=gpu_fsdp2 or trn2, which simulate)",
                          f"runs the torch model's own code path; tensor/pipeline parallelism "
                          f"(tp={p.tp}, pp={p.pp}) here is neuronx-distributed's, whose process "
                          "groups need the Neuron runtime, or a process per rank in its CPU mode "
                          "(parallel_layers/parallel_state.py:797-818)")
    need(0 <= simulate_rank < world, "simulate_rank", simulate_rank, f"use a rank in 0..{world - 1}",
         f"is not a rank of the {world}-device world")


# Nodes whose keys are free-form (a logger's or a callback's constructor arguments; Hydra's own node).
FREE_FORM = ("logger", "callbacks", "hydra")


def check_seeds(seed, data) -> None:
    """train.py's seeds: the run's (model init, data order, dropout) and the validation split's."""
    check_seed("seed", seed)
    check_seed("data.split_seed", data.split_seed)


def check_known_keys(cfg) -> None:
    """Refuse keys the typed schema does not define: `+trainer.max_step=5` adds one silently otherwise."""
    from moe.config.schema import TrainConfig

    if not isinstance(cfg, DictConfig):
        return  # a TrainConfig dataclass has no other keys
    schema = OmegaConf.structured(TrainConfig)

    def walk(node, known, path: str) -> None:
        if not isinstance(node, DictConfig) or not isinstance(known, DictConfig):
            return
        if OmegaConf.get_type(known) is dict:  # a dict-typed field: any key
            return
        for key in node.keys():
            where = f"{path}.{key}" if path else str(key)
            if key not in known and where not in FREE_FORM:
                options = ", ".join(sorted(str(k) for k in known.keys()))
                guess = did_you_mean(key, known.keys())
                hint = f"did you mean {path + '.' if path else ''}{guess}? Else " if guess else ""
                fix = f"{hint}remove it or use one of the keys of {path or 'the root'}: {options}"
                raise ConfigError(where, "???" if OmegaConf.is_missing(node, key) else node[key], fix,
                                  problem="is not a key of the config schema (a `+` override adds keys "
                                          "silently; every key is in docs/CONFIG.md)")
            if where not in FREE_FORM and not where.startswith(tuple(f"{f}." for f in FREE_FORM)):
                walk(node[key], known[key], where)

    walk(cfg, schema, "")


def check_finite(cfg) -> None:
    """Every number must be finite: nan/inf pass the type check and fail mid-run (or silently)."""

    def walk(node, path: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = f"{path}.{key}" if path else str(key)
            if isinstance(value, dict | list):
                walk(value, where)
            elif isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(where, value, "give a finite number (see docs/CONFIG.md for its range)",
                                  problem="is not a finite number")

    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    walk(OmegaConf.to_container(node, resolve=False), "")  # interpolations: their targets are checked
