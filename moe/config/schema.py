"""Typed schema of `train.py`'s config, one dataclass per Hydra group, registered as `train_schema`.

`conf/train.yaml` puts `train_schema` first in its defaults, so every group preset is
merged into a typed node: an unknown key or a wrong type fails when Hydra composes the
config, before anything is built. Value and cross-field rules live in `moe.config.validate`.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional, TypeVar

from hydra.core.config_store import ConfigStore

from moe.config.choices import (
    BUNDLED_EVAL_TASKS,
    AcPolicy,
    Attention,
    AuxLossGroup,
    DataFormat,
    DataKind,
    DropPolicy,
    ExpertActivation,
    LoadBalancingType,
    NeuronPrecision,
    PositionEncoding,
    QKNorm,
    RopeType,
    RouterDtype,
    ScoreFunction,
    SpikeAction,
)
from moe.errors import ConfigError

S = TypeVar("S", bound="Section")

# The chat format of no_robots (the KARAKURI LM 8x7B Chat recipe); the default of data.chat_template,
# data_prep's chat_template and infer's.
DEFAULT_CHAT_TEMPLATE = "<|user|>\n{prompt}\n<|assistant|>\n{completion}"
# chat_template's value that selects the tokenizer's own Jinja template (moe/data/tokenizer_chat.py)
TOKENIZER_TEMPLATE = "tokenizer"


class Section:
    """Base of the schema's dataclasses. Hydra composes into them as plain dataclasses; once the run has
    settled its config, `freeze` (below) freezes the instances it trains with, and assigning to one then
    raises as on a frozen dataclass (a change is a new object: moe.config.settled.replaced)."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r} of {type(self).__name__}: the run's config is settled and "
                "read-only (make a changed copy with moe.config.settled.replaced)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r} of {type(self).__name__}")
        object.__delattr__(self, name)


def freeze(section: S, path: str = "") -> S:
    """`section` and the sections it holds, read-only from now on; each choice key holds one of its type's
    values (validation has said so with its own words for a composed config; this holds for any other)."""
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if isinstance(value, Section):
            freeze(value, f"{path}{item.name}.")
    for name, choices in choice_fields(type(section)).items():
        value = getattr(section, name)
        if value not in choices:
            raise ConfigError(f"{path}{name}", value, f"use one of {', '.join(choices)}",
                              problem="is not one of the values its type allows")
    object.__setattr__(section, "_frozen", True)
    return section


@functools.cache
def choice_fields(schema: type) -> dict[str, tuple[str, ...]]:
    """The fields of `schema` declared `Annotated[str, Literal[...]]` (moe.config.choices), with their
    values."""
    fields = {}
    for name, hint in typing.get_type_hints(schema, include_extras=True).items():
        if typing.get_origin(hint) is typing.Annotated:
            kind = hint.__metadata__[0]
            if typing.get_origin(kind) is typing.Literal:
                fields[name] = typing.get_args(kind)
    return fields


@dataclass
class ModelConfig(Section):
    """Decoder architecture. Defaults are the tiny CPU model."""

    name: str = "tiny"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256  # expert (and dense) SwiGLU width
    dense_intermediate_size: Optional[int] = None  # dense FFN width; null = intermediate_size
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # null = hidden_size // num_heads
    max_position_embeddings: int = 512
    position_encoding: Annotated[str, PositionEncoding] = "rope"
    rope_theta: float = 1.0e6
    # RoPE scaling, as transformers' rope_parameters (moe/model/rope.py): default (plain) | linear | llama3
    # | yarn. The keys below are read by the types that name them; null = transformers' default for the type
    rope_type: Annotated[str, RopeType] = "default"
    rope_factor: float = 1.0  # linear, llama3, yarn: the context extension factor (>= 1)
    rope_original_max_position_embeddings: Optional[int] = None  # llama3, yarn (required): trained context
    rope_beta_fast: Optional[float] = None  # yarn: null = 32
    rope_beta_slow: Optional[float] = None  # yarn: null = 1
    rope_mscale: Optional[float] = None  # yarn: with rope_mscale_all_dim, cos/sin times mscale ratio
    rope_mscale_all_dim: Optional[float] = None  # yarn: also MLA's softmax scale times mscale(factor, it)^2
    rope_attention_factor: Optional[float] = None  # yarn: cos/sin times this; null = from factor and mscales
    rope_truncate: Optional[bool] = None  # yarn: round the ramp's ends to whole dims; null = true
    rope_low_freq_factor: Optional[float] = None  # llama3 (required): Llama 3.1: 1
    rope_high_freq_factor: Optional[float] = None  # llama3 (required): Llama 3.1: 4
    # GQA: RoPE rotates the first int(head_dim * this) dims of each head, the rest pass through (GLM-4.5:
    # 0.5); 1.0 = every dim
    partial_rotary_factor: float = 1.0
    sliding_window: Optional[int] = None
    # each layer's attention, as transformers' `layer_types`: sliding_attention (the window above) or
    # full_attention; null = every layer as sliding_window says (gpt-oss alternates them, sliding first)
    attention_layer_types: Optional[list[str]] = None
    qkv_bias: bool = False  # bias on the q, k and v projections (Qwen2-MoE, gpt-oss)
    o_bias: bool = False  # bias on the attention output projection (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    rms_norm_eps: float = 1.0e-5
    tie_word_embeddings: bool = False
    init_range: float = 0.02
    num_experts: int = 8
    top_k: int = 2
    moe_layer_frequency: int = 1  # an MoE block every N layers, dense SwiGLU otherwise
    first_k_dense_replace: int = 0  # the first k layers dense whatever the frequency (DeepSeek-V3: 3)
    # these layers (0-based) dense too, whatever the two rules above (Qwen's mlp_only_layers); null = none
    dense_layers: Optional[list[int]] = None
    shared_expert_intermediate_size: int = 0  # 0 = no always-on shared expert
    # the shared expert's output times sigmoid(gate(x)), gate a Linear(hidden, 1) (Qwen2-MoE's
    # shared_expert_gate)
    shared_expert_gate: bool = False
    # GQA only: RMSNorm of the queries and keys before RoPE; none | per_head: over each head's head_dim, one
    # weight for every head (Qwen3-MoE) | full: over the whole q and the whole k projection (OLMoE)
    qk_norm: Annotated[str, QKNorm] = "none"
    # a trained bias on the router's logits (gpt-oss); not moe_opt.enable_expert_bias's balancing bias
    router_bias: bool = False
    expert_proj_bias: bool = False  # a bias on every routed expert's gate_up and down projections (gpt-oss)
    # swiglu: silu(gate) * up | clamped_swiglu (gpt-oss): gate clamped above at swiglu_limit, up to
    # [-swiglu_limit, swiglu_limit], then gate * sigmoid(swiglu_alpha * gate) * (up + 1)
    expert_activation: Annotated[str, ExpertActivation] = "swiglu"
    swiglu_alpha: float = 1.702  # clamped_swiglu only
    swiglu_limit: float = 7.0  # clamped_swiglu only
    # gqa: grouped-query attention (Mixtral) | mla: multi-head latent attention (DeepSeek-V2/V3,
    # moe/model/mla.py), which reads the five keys below (null = unset; each required by mla but
    # q_lora_rank, whose null means one q_proj instead of a query latent) and ignores num_kv_heads/head_dim
    attention: Annotated[str, Attention] = "gqa"
    q_lora_rank: Optional[int] = None  # DeepSeek-V3: 1536
    kv_lora_rank: Optional[int] = None  # the key/value latent per token; DeepSeek-V3: 512
    qk_nope_head_dim: Optional[int] = None  # key/query dims without position; DeepSeek-V3: 128
    qk_rope_head_dim: Optional[int] = None  # the decoupled RoPE dims, one key head shared; DeepSeek-V3: 64
    v_head_dim: Optional[int] = None  # DeepSeek-V3: 128
    # multi-token prediction (DeepSeek-V3's num_nextn_predict_layers, Megatron's --mtp-num-layers): depth k of
    # this many predicts token i+k+1 from depth k-1's representation and token i+k's embedding, through one
    # more block (moe/model/mtp.py); 0 = none. Trained only: generation and the exports' logits skip it
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.1  # lambda: loss = LM + router terms + lambda * mean over depths of their CE
    compile: bool = False  # torch.compile the blocks and the MoE layers' regions (apply_compile)
    # the Hugging Face family an export writes (its model_type: moe.hf.families.CONVERTERS); null: by the
    # attention (gqa: mixtral, mla: deepseek_v3). An import sets it to the checkpoint's family.
    hf_family: Optional[str] = None
    init_from_hf: Optional[str] = None  # a Hugging Face directory of a family moe.hf reads, to start from
    upcycle_from_hf: Optional[str] = None  # dense Mistral/Llama directory: every expert a copy of its MLP
    upcycle_granularity: int = 1  # > 1: fine-grained upcycling, each expert a 1/g slice of the dense MLP


@dataclass
class MoEOptConfig(Section):
    """Routing behaviour; names follow Megatron-Core's MoE options."""

    name: str = "default"
    capacity_factor: Optional[float] = 1.25  # null = dropless
    eval_capacity_factor: Optional[float] = None  # null = dropless at eval: the logits the HF export gives
    min_capacity: int = 4
    # probs (lowest probability dropped first) | position (latest tokens)
    drop_policy: Annotated[str, DropPolicy] = "probs"
    aux_loss_coeff: float = 0.01  # Switch load-balance loss; raise to 0.1 if routing oscillates
    z_loss_coeff: float = 0.001  # ST-MoE router z-loss
    jitter_eps: float = 0.0  # multiplicative router-input noise U(1-eps, 1+eps), training only
    router_dtype: Annotated[str, RouterDtype] = "fp32"  # fp32 recommended
    normalize_top_k: Optional[bool] = None  # null: renormalise when top_k >= 2, raw prob for top-1
    # renormalise over the assignments a capacity kept (NxD, DeepSpeed): a token that lost one of its
    # experts gives the others its weight; false: the weights are normalised before drops (Megatron)
    normalize_after_drop: bool = False
    # each expert row times its routing weight inside the SwiGLU, before the down projection (Megatron-Core's
    # weighted SwiGLU), and a token's k outputs summed in their dtype; false: weighted in fp32 at the combine
    weights_in_activation: bool = False
    # the experts' grouped GEMMs (forward and both of the backward) with float8 e4m3 operands, rowwise scales
    # (torchao's recipe, moe/model/fp8.py): CUDA compute capability 9.0+; emulated elsewhere (CPU smoke runs)
    fp8_experts: bool = False
    # load-balance statistics (f_i, P_i) over: ep = the expert-parallel group (this rank's tokens
    # when ep=1) | dp = every data-parallel rank (global-batch balancing; same loss as one process)
    aux_loss_group: Annotated[str, AuxLossGroup] = "ep"
    # aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores for top-k
    # selection only, moved by bias_update_rate * sign(mean load - load_i) after each optimizer step
    enable_expert_bias: bool = False
    bias_update_rate: float = 1.0e-3
    # aux_loss: the Switch loss over the batch (aux_loss_group's tokens) | seq_aux_loss: the same
    # loss per sequence, averaged (DeepSeek-V3's sequence-wise balance loss) | none
    load_balancing_type: Annotated[str, LoadBalancingType] = "aux_loss"
    # softmax over the experts (Mixtral) | sigmoid per expert, the chosen k renormalised (DeepSeek-V3)
    score_function: Annotated[str, ScoreFunction] = "softmax"
    # group-limited routing (DeepSeek-V3's node-limited routing): the experts in num_groups groups, the
    # group_top_k groups with the best top_k/group_top_k scores kept, top_k chosen inside them
    num_groups: Optional[int] = None
    group_top_k: Optional[int] = None
    # a group's score: the sum of its best this many scores; null = top_k/group_top_k (Megatron-Core's).
    # transformers' DeepSeek-V3 router sums 2, DeepSeek-V2's takes the best 1
    group_score_experts: Optional[int] = None
    topk_scaling_factor: Optional[float] = None  # the top-k weights times this (DeepSeek-V3: 2.5)


def group_scored_by(moe_opt, top_k: int) -> int | None:
    """How many of its best scores a group's score sums (moe_opt.group_score_experts, else
    top_k/group_top_k); None without groups."""
    if moe_opt.num_groups is None:
        return None
    return moe_opt.group_score_experts or top_k // moe_opt.group_top_k


def normalizes(normalize_top_k: bool | None, top_k: int) -> bool:
    """moe_opt.normalize_top_k's meaning: None renormalises the k weights to sum to 1 when top_k >= 2
    (Mixtral) and keeps the raw probability for top-1 (Switch: renormalising would make it a
    constant 1 and starve the router of gradient)."""
    return top_k >= 2 if normalize_top_k is None else bool(normalize_top_k)


@dataclass
class ParallelConfig(Section):
    """Parallel layout. dp is derived as world / (tp * pp) unless given."""

    name: str = "single"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: Optional[int] = None  # null = world // (tp * pp)
    sequence_parallel: bool = False  # only meaningful with tp > 1
    zero_stage: int = 0  # 0 none, 1 optimizer states, 2 + gradients, 3 + parameters
    hybrid_shard_degree: Optional[int] = None  # shard ZeRO state within groups of this size
    activation_checkpointing: Annotated[str, AcPolicy] = "none"
    activation_checkpointing_every_n: int = 1
    pipeline_microbatches: Optional[int] = None  # null = accumulate_grad_batches
    # fsdp2's torch.distributed.pipelining schedule (NxD runs its own 1F1B): 1F1B | GPipe (one stage per
    # rank), Interleaved1F1B | InterleavedZeroBubble | ZBVZeroBubble (pp_stages_per_rank stages each)
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: Optional[int] = None  # null = 1 for one-stage schedules, 2 for the others
    # fsdp2: the experts' weights, gradients and AdamW states in host memory (FSDP2's CPUOffloadPolicy on
    # their units; ZeRO-Infinity-style offload), copied to the device for their forward and backward
    offload_experts: bool = False
    # deepspeed: overlap ZeRO's gradient reduction with the backward on CUDA streams (null: on GPU, as
    # DeepSpeed recommends; false where gradients must not depend on stream timing, DeepSpeed issue 5545)
    overlap_comm: Optional[bool] = None
    # how long a rank waits in a collective for a peer that stalls before the run stops (exit 3, naming the
    # rank and the collective; a dead peer is seen at once): every process group of the run, once every
    # rank has joined (the start-up rendezvous waits at least 30 min, moe.parallel.comm.RENDEZVOUS_TIMEOUT)
    collective_timeout_s: float = 1800.0


@dataclass
class HardwareConfig(Section):
    """The machine; picks the Lightning strategy plugin and nothing else."""

    name: str = "cpu"
    accelerator: str = "cpu"  # cpu | gpu | neuron (XLA, trn1) | torch_neuron (TorchNeuron, trn2)
    strategy: str = "ddp"  # ddp | deepspeed | fsdp2 | neuron
    backend: str = "gloo"  # gloo | nccl | xla | neuron (TorchNeuron)
    device_name: str = "CPU"
    devices_per_node: int = 2
    default_devices: int = 1  # trainer.devices unless given (trn1: every NeuronCore of the node)
    device_memory_gib: float = 24.0
    host_memory_gib: Optional[float] = None  # per node; what parallel.offload_experts fills (null: unknown)
    # device memory a process holds outside its tensors: runtime context, communication buffers, allocator
    # reserve; the plan and the simulation add it (docs/SCALE.md)
    fixed_memory_gib: float = 0.0
    peak_tflops: float = 0.5  # dense bf16 (fp32 on cpu) peak per device, for MFU
    precision: str = "32-true"  # Lightning precision string
    allow_tf32: bool = False
    neuron_precision: Annotated[str, NeuronPrecision] = "auto"  # trn1 only; auto: mixed with MoE layers
    neuron_cc_flags: str = ""
    env: dict[str, str] = field(default_factory=dict)  # set before the accelerator starts


@dataclass
class OptimizerConfig(Section):
    """AdamW with linear warmup then cosine decay to min_lr."""

    name: str = "adamw"
    lr: float = 3.0e-3
    min_lr: float = 3.0e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1.0e-8
    weight_decay: float = 0.1
    no_decay_norms_and_biases: bool = True
    warmup_steps: int = 20
    decay_steps: Optional[int] = None  # null = trainer.max_steps
    grad_clip: float = 1.0  # 0 = off


# stream positions per mixture chunk (moe/data/sampler.py): each source's share of every chunk is its weight
# to within 1/MIXTURE_CHUNK
MIXTURE_CHUNK = 65536


@dataclass
class DataSource:
    """One dataset of a weighted mixture (`data.sources`): a prepared dir, its share of the training stream
    and the name its validation loss is logged under (default: the directory's name)."""

    path: Optional[str] = None  # required (a rule says so with the fix)
    weight: float = 1.0
    name: Optional[str] = None


def source_label(source) -> str:
    """A mixture source's `name`, else its directory's name: the key of its validation loss
    (val_loss/<label>)."""
    return source.name or str(source.path).rstrip("/").rsplit("/", 1)[-1]


@dataclass
class DataConfig(Section):
    """Training data: a prepared Arrow dir, online packing of raw files, or the bundled sample."""

    name: str = "sample"
    kind: Annotated[str, DataKind] = "online"
    path: Optional[str] = None  # prepared: data_prep output dir; online: raw file/glob/dir
    # prepared dirs drawn by weight (docs/DATA.md, Mixtures); null = the one source data.path
    sources: Optional[list[DataSource]] = None
    format: Annotated[str, DataFormat] = "text"  # online
    text_column: str = "text"
    tokenizer: Optional[str] = None  # tokenizer dir (tokenizer.json); prepared dirs carry their own
    seq_len: int = 128
    val_fraction: float = 0.05
    split_seed: int = 1234
    chat_template: str = DEFAULT_CHAT_TEMPLATE  # chat: {prompt} and {completion} slots, or `tokenizer`
    assistant_only_loss: bool = False
    # packed documents do not see each other: block-causal attention, positions restarting at each document,
    # no loss on the label after an EOS (moe/model/documents.py, docs/DATA.md "Document masking")
    document_mask: bool = False
    num_workers: int = 0
    shuffle: bool = True
    # online only: blocks packed lazily from the files as training reads them, nothing cached for the whole
    # corpus (moe/data/streaming.py, docs/DATA.md "Streaming"); validation is the first streaming_val_blocks
    # blocks of the corpus (val_fraction is not read), data.shuffle a seeded buffer of shuffle_buffer blocks
    streaming: bool = False
    streaming_val_blocks: int = 32
    shuffle_buffer: int = 1024


@dataclass
class TrainerConfig(Section):
    """Loop length, batch arithmetic and checkpoint cadence."""

    name: str = "default"
    devices: int = "${hardware.default_devices}"  # type: ignore[assignment]  (processes per node)
    num_nodes: int = 1
    max_steps: int = 300
    micro_batch_size: int = 8
    accumulate_grad_batches: int = 1
    global_batch_size: Optional[int] = None  # null = micro * accumulation * dp; else checked
    precision: Optional[str] = None  # null = hardware.precision
    log_every_n_steps: int = 10
    val_check_interval: int = 100
    limit_val_batches: int = 8
    checkpoint_every_n_steps: int = 100
    save_checkpoints: bool = True  # false: none written, not even the final one (benchmarks, make gpu-check)
    keep_last_checkpoints: int = 2
    progress_bar: bool = True
    deterministic: bool = False
    # Python's garbage collector off while training, collected after every N optimizer steps instead, on
    # every rank at once (Megatron's --manual-gc, torchtitan's gc_freq); 0 = Python's automatic collection
    gc_every_n_steps: int = 0
    # loss-spike and NaN guard (moe/train/guard.py, docs/FAULT_TOLERANCE.md)
    skip_nonfinite: bool = True  # skip the update of a step whose loss or gradient is NaN/inf
    max_nonfinite_steps: int = 10  # stop the run after this many non-finite steps in a row; 0 = never
    spike_factor: float = 3.0  # spike: step loss > factor x mean of the last spike_window losses; 0 = off
    spike_window: int = 50
    # warn | skip (the update) | rollback (to the last checkpoint, skip since)
    spike_action: Annotated[str, SpikeAction] = "warn"
    spike_max_rollbacks: int = 3  # past this many rollbacks in a run, a spike is skipped instead
    # in-run evaluation (moe/eval/in_run.py, docs/EVALUATION.md): lm_eval tasks on the model being trained
    # after every N-th optimizer step, logged as eval/<task>/<metric>; training is the same with it; 0 = off
    eval_every_n_steps: int = 0
    eval_tasks: list[str] = field(default_factory=lambda: list(BUNDLED_EVAL_TASKS))  # bundled or task dirs'
    eval_task_dirs: list[str] = field(default_factory=list)  # directories of lm_eval task yaml (local data)
    eval_limit: Optional[int] = None  # at most this many documents a task (null: all)
    eval_batch_size: int = 8  # requests per forward


@dataclass
class TrainConfig(Section):
    """The composed `train.py` config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe_opt: MoEOptConfig = field(default_factory=MoEOptConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Lightning loggers and extra callbacks, by name, each a node with `_target_` (instantiated by Hydra).
    # metrics.csv and summary.json are always written; the run's own callbacks are always on.
    logger: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    # run dir is runs/<run_name>; the experiment's name, `<model.name>-<digest of what it trains>` (inside a
    # SLURM batch job `<job name>-<job id>-<digest>`): the same for every rank, node and relaunch
    # (moe/config/run_name.py)
    run_name: str = "${default_run_name:}"
    dry_run: bool = False
    # simulate=true: one rank's real training step at the configured size with fake tensors on this CPU
    # (moe/tools/simulate.py); writes <run dir>/simulation.json. simulate_rank: which rank.
    simulate: bool = False
    simulate_rank: int = 0
    # what dry_run and simulate plan for under dropless expert parallelism: the hottest expert's load as a
    # multiple of its balanced share, on the rank that holds it (our runs log it as max_expert_load /
    # mean_expert_load: the tiny preset's first steps reach 1.7-2.8, docs/SCALE.md); 1.0 = perfect balance
    routing_skew: float = 2.0
    resume: bool = True  # resume from <run dir>/checkpoints/last.ckpt when present
    # load checkpoint files holding more than tensors and plain containers (their unpickling runs code):
    # only files you trust (moe/checkpoint/trust.py); the product's own checkpoints never need it
    allow_pickle: bool = False
    # seconds a launch waits for the run dir's lock while another run holds it, before exit 2 (null: 120 for a
    # requeued SLURM job, SLURM_RESTART_COUNT > 0, else none); moe/train/run_lock.py
    lock_wait_s: Optional[float] = None


def register_configs() -> None:
    """Register the typed root `train_schema`, and sweeps/*.yaml as the `sweep` group (`+sweep=NAME`)."""
    from moe.config.run_name import register_run_name_resolver
    from moe.config.sweeps import register_sweeps

    register_run_name_resolver()
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    register_sweeps()


register_configs()
