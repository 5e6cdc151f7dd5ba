"""DeepSpeed (hardware=gpu; hardware=cpu_deepspeed runs the same plugin on CPU over gloo).

Lightning's DeepSpeedStrategy, configured from the parallel, optimizer and trainer groups,
plus what our MoE layer needs from DeepSpeed:

- Expert parallelism: DeepSpeed's own EP / expert-DP groups (`make_expert_groups`), so the token
  all-to-all and DeepSpeed's expert-gradient all-reduce use the same EP group; expert params
  marked `allreduce=False`, `group_name="ep_size_{ep}"` and the optimizer's param groups split
  with `split_params_into_different_moe_groups_for_optimizer` (`prepare_optimizer`, called
  by LitMoE.configure_optimizers before the LR schedule is built).
- DeepSpeed treats a model as MoE only when it holds its own `deepspeed.moe.layer.MoE`;
  `_ExpertAwareEngine` also counts models whose parameters are marked as experts, which
  switches on the expert-DP gradient reduction, ZeRO's expert partitions and expert-aware
  grad norms. With ZeRO off in fp32 the step computes the global norm and clips, as on DDP
  (`steps_plainly`).
- Checkpoints: without expert parallelism one file (written by rank 0) plus each rank's ZeRO
  optimizer partition in `<file>.zero/`; with it a sharded directory (moe/checkpoint/sharded.py:
  each rank writes its own experts, no rank gathers them) with each rank's partition in
  `per_rank/`. Resuming with the same world size, ep and ZeRO stage restores the partitions
  exactly; otherwise only the weights are restored, resharded (with a warning), and the fp32
  masters are refreshed from them.
- CPU: Lightning refuses a non-CUDA accelerator; three overrides (`setup_environment`,
  `setup_distributed`, the device rank in `_setup_model_and_optimizer`) make ZeRO-0/1/2 train
  on CPU processes over gloo, for tests.

Gradient accumulation is the step's (moe.module.train_step, under Lightning's manual optimization):
Lightning writes `gradient_accumulation_steps: 1` into the DeepSpeed config, the step divides each
micro-batch's loss by their count once and marks the last one as the accumulation boundary
(`micro_batch_sync`, DeepSpeedEngine.set_gradient_accumulation_boundary), so ZeRO reduces the summed
gradients once and `engine.step()` updates once a step. `import deepspeed` happens only inside the builder.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from moe.backends.base import Backend, TrainerParts
from moe.backends.checkpoints import FormatCheckpoints
from moe.backends.deepspeed.spec import REDUCE_BUCKET_ELEMENTS
from moe.checkpoint.formats import DeepSpeed as DeepSpeedDirectory
from moe.checkpoint.formats import format_at, in_place
from moe.checkpoint.trust import load_trusted
from moe.config.derived import precision, precision_of
from moe.config.schema import HardwareConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from moe.errors import UserError
from moe.parallel.comm import set_collective_timeout
from moe.parallel.dims import ExpertGroups
from moe.parallel.expert_grads import expert_params


def steps_plainly(parallel: ParallelConfig, trainer: TrainerConfig, hardware: HardwareConfig) -> bool:
    """ZeRO off, fp32: DeepSpeed's optimizer is the torch one over whole gradients in `param.grad`, and the
    step (moe.module.train_step) computes their global norm and clips as on DDP. DeepSpeed's own fp32
    clipping would average each rank's local norm instead of taking the whole model's."""
    return parallel.zero_stage == 0 and precision(trainer, hardware).half is None


def deepspeed_config(parallel: ParallelConfig, optimizer: OptimizerConfig, trainer: TrainerConfig,
                     hardware: HardwareConfig) -> dict:
    """The DeepSpeed config dict from the (validated) parallel, optimizer, trainer and hardware groups."""
    run, on_gpu = precision(trainer, hardware), hardware.accelerator == "gpu"
    clipping = 0.0 if steps_plainly(parallel, trainer, hardware) else float(optimizer.grad_clip or 0.0)
    config = {
        "train_micro_batch_size_per_gpu": trainer.micro_batch_size,
        "gradient_clipping": clipping,
        "zero_allow_untested_optimizer": True,  # our torch AdamW, not DeepSpeed's fused Adam (no op build)
        "zero_optimization": {
            "stage": parallel.zero_stage,
            "contiguous_gradients": True,  # ZeRO-2 with MoE requires it
            "reduce_scatter": True,  # ZeRO with MoE requires it
            # overlap reduction with backward on CUDA streams (buffers kept alive across streams since 0.19's
            # record_stream calls, runtime/zero/stage_1_and_2.py:1531-1543)
            "overlap_comm": on_gpu if parallel.overlap_comm is None else bool(parallel.overlap_comm),
            "allgather_partitions": True,
            "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS,
            "allgather_bucket_size": REDUCE_BUCKET_ELEMENTS,
        },
        "steps_per_print": 10**9,  # metrics.csv is the record; keep DeepSpeed's own step log quiet
        "wall_clock_breakdown": False,
    }
    if run.half == "float16":  # fp16 needs dynamic loss scaling
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    elif run.half == "bfloat16":
        config["bf16"] = {"enabled": True}
        # gradients reduced and accumulated in fp32, as Megatron-Core (accumulate_allreduce_grads_in_fp32,
        # on with bf16) and torchtitan (FSDP2 reduce_dtype=float32) do: `communication_data_type` casts
        # each bucket before its reduction (deepspeed 0.19.8 runtime/zero/stage_1_and_2.py:1485-1511),
        # `grad_accum_dtype` keeps the micro-batches' sum in fp32 (:395-402; ZeRO-1 then runs DeepSpeed's
        # BF16_Optimizer, runtime/engine.py:2305-2310). Without ZeRO DeepSpeed refuses fp32 accumulation
        # of bf16 weights (engine.py:2313-2323): there only the reduction is fp32.
        config["communication_data_type"] = "fp32"
        if parallel.zero_stage >= 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


class DeepSpeedBackend(Backend):
    """ZeRO-1/2 and expert parallelism carved from data parallelism, through DeepSpeed's engine."""

    name = "deepspeed"

    def prepare(self) -> None:
        parallel, trainer, hardware = self.cfg.parallel, self.cfg.trainer, self.cfg.hardware
        # ZeRO or half precision: DeepSpeed computes the norm inside engine.step(), over its own partitions
        self.norm_after_step = not steps_plainly(parallel, trainer, hardware)
        try:
            import deepspeed  # noqa: F401
        except ImportError as err:
            raise UserError("hardware.strategy", "deepspeed", "pip install deepspeed -c constraints.txt "
                            "(or pip install -e '.[gpu]'), or use hardware=cpu",
                            problem="needs the deepspeed package, which is not installed") from err

    def trainer_parts(self) -> TrainerParts:
        parallel, trainer, hardware = self.cfg.parallel, self.cfg.trainer, self.cfg.hardware
        config = deepspeed_config(parallel, self.cfg.optimizer, trainer, hardware)
        self.strategy = MoEDeepSpeedStrategy(config=config, dims=self.dims,
                                             checkpoint_format=self.checkpoint_format,
                                             process_group_backend=hardware.backend,
                                             logging_level=logging.WARNING,
                                             timeout=set_collective_timeout(parallel.collective_timeout_s))
        return TrainerParts(accelerator=hardware.accelerator, strategy=self.strategy,
                            precision=precision_of(trainer, hardware), plugins=[])

    def make_expert_groups(self) -> ExpertGroups:
        """DeepSpeed's own EP / expert-DP groups, laid out as moe.parallel.dims's (consecutive EP ranks)."""
        from deepspeed.utils import groups

        name = f"ep_size_{self.dims.ep}"  # DeepSpeed's expert groups have no public API (utils/groups.py):
        if name not in groups._get_expert_parallel_group_dict():  # private: no public registry
            groups._create_expert_and_data_parallel(self.dims.ep)  # private: collective, every rank makes all
        ep = groups._get_expert_parallel_group(name)  # private: no public getter
        return ExpertGroups(ep, groups._get_expert_data_parallel_group(name))  # private: no public getter

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark expert params for DeepSpeed and give them their own ('moe') param groups, in place."""
        if self.dims.ep <= 1:
            return
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        for p in expert_params(self.strategy.lightning_module):
            p.allreduce, p.group_name = False, f"ep_size_{self.dims.ep}"
        groups = [dict(g) for g in optimizer.param_groups]
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
        optimizer.param_groups.clear()
        for group in groups:
            if group["params"]:
                optimizer.add_param_group(group)

    def micro_batch_sync(self, module, last: bool):
        """ZeRO reduces the gradients (and `engine.step()` updates) at the step's last micro-batch only: the
        engine's own switch for callers that step once after accumulating (runtime/engine.py:3467-3491 at
        0.19.8), which its backward hands to the ZeRO optimizer (:3081). Lightning writes the config's
        gradient_accumulation_steps from the Trainer's accumulate_grad_batches, 1 under manual optimization
        (lightning/pytorch/strategies/deepspeed.py:928), so the engine divides no loss itself (:3413)."""
        self.strategy.deepspeed_engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def clip_gradients(self, module, norm, max_norm: float) -> None:
        """DeepSpeed clips inside `engine.step()` (the config's gradient_clipping, by the norm it computes),
        except when it steps plainly: then the global norm, as DDP."""
        if not self.norm_after_step:
            super().clip_gradients(module, norm, max_norm)

    def logged_grad_norm(self, module, norm: torch.Tensor) -> float:
        """Under ZeRO or half precision the global grad norm DeepSpeed computed in its step (before clipping;
        NaN where it has none), else the step's."""
        if not self.norm_after_step:
            return float(norm)
        after = self.strategy.deepspeed_engine.get_global_grad_norm()
        return math.nan if after is None else float(after)

    def grad_norm(self, module) -> torch.Tensor:
        """The global norm of the gradients DeepSpeed's optimizer is about to step with, before clipping, as
        that optimizer computes it in its step (inf where it is not finite), on the CPU: the spike guard
        decides from it. Under ZeRO-1/2 and BF16_Optimizer the reduced gradients are in the optimizer's
        partitions and buffers, not in `param.grad` (ZeRO-2 frees those in the backward), so the base norm
        would miss a non-finite one there; the ZeRO optimizer's own norm of its partitions (its step's:
        deepspeed 0.19.8 runtime/zero/stage_1_and_2.py:3039, unscaled as :3071) and BF16_Optimizer's of its
        fp32 gradients (bf16_optimizer.py:389-398) are the numbers DeepSpeed clips by, the same on every rank.
        Its step computes them again (no public way to hand it ours): one more pass over this rank's share of
        the gradients and a scalar all-reduce a step, the price of deciding before the update. Its fp16/bf16
        optimizer without ZeRO and the plain torch one step from `param.grad`, reduced over the data-parallel
        ranks in the backward: the base norm."""
        from deepspeed.runtime.utils import is_invalid_grad_norm

        optimizer = self.strategy.deepspeed_engine.optimizer
        kind = _optimizer_kind(optimizer)
        if kind == "zero":
            norm = optimizer.scaled_global_norm() / optimizer.loss_scale
        elif kind == "bf16":
            from deepspeed.runtime.utils import get_global_norm_of_tensors, get_norm_with_moe_layers

            dense, experts = optimizer.get_grads_for_norm()
            norm = get_global_norm_of_tensors(input_tensors=dense, mpu=optimizer.mpu,
                                              norm_type=optimizer.norm_type)
            if optimizer.has_moe_layers:
                norm = get_norm_with_moe_layers(norm, mpu=optimizer.mpu, expert_tensors=experts,
                                                norm_type=optimizer.norm_type)
        else:
            norm = super().grad_norm(module) / (getattr(optimizer, "loss_scale", None) or 1.0)
        # DeepSpeed's norms mark a non-finite one -1 (runtime/utils.py:883 mask_nan_or_inf_with_val_inplace)
        if is_invalid_grad_norm(norm):
            return torch.tensor(float("inf"))
        return torch.as_tensor(norm, dtype=torch.float32).detach().reshape(()).cpu()

    def skip_update(self, module) -> None:
        """Leave the weights, DeepSpeed's fp32 partitions and the optimizer's moments and step counts as they
        are this step. DeepSpeed's optimizers step from their own gradient partitions and buffers, not from
        `param.grad` (the fp16/bf16 one without ZeRO takes a missing gradient as zeros:
        fp16/fused_optimizer.py:282-289, fp16/unfused_optimizer.py:218-222; AdamW moves on a zero gradient),
        and the only way they skip a step is their overflow path: a non-finite gradient where they read it
        makes `engine.step()` clear the gradients and leave everything else as it was
        (zero/stage_1_and_2.py:3027-3068, bf16_optimizer.py:402-407, fp16/fused_optimizer.py:264-275 and
        :151-161, fp16/unfused_optimizer.py:205-207 and :125-133); the engine counts it in `skipped_steps`
        (engine.py:3534-3541). So this rank writes one NaN where its optimizer reads this step's gradient.
        The plain torch optimizer (ZeRO off, fp32) skips a parameter without a gradient: the base clears
        them. With fp16's dynamic loss scaling the overflow also counts against the loss scale (one
        hysteresis step or a halving), as DeepSpeed's own overflows do."""
        optimizer = self.strategy.deepspeed_engine.optimizer
        kind = _optimizer_kind(optimizer)
        if kind == "zero":  # the step reads averaged_gradients[group]: this rank's reduced partition
            # (stage_1_and_2.py:3232 for the overflow check, :2951 for the norm); a NaN copy in place of one
            # entry, which the overflow path drops (:3059-3061), leaves DeepSpeed's gradient buffers clean
            for grads in optimizer.averaged_gradients.values():
                if grads:
                    grads[0] = torch.full_like(grads[0], float("nan"))
                    return
        elif kind == "bf16":  # the fp32 gradients its norm reads, zeroed by the overflow path (:605-610)
            dense, experts = optimizer.get_grads_for_norm()
            grads = [*dense, *(g for group in experts.values() for g in group)]
            if grads:
                grads[0].view(-1)[0] = float("nan")
                return
        elif kind == "half":  # param.grad, which its overflow check reads; set to None by its overflow path
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("nan")
                    return
        else:
            return super().skip_update(module)
        # no gradient of this step on this rank (a partition without parameters): the overflow check and the
        # norm are reduced over the data-parallel ranks, every other rank's NaN reaches this one's step


def _optimizer_kind(optimizer) -> str:
    """Which of DeepSpeed's optimizers the engine steps with (runtime/engine.py:2294-2366 at 0.19.8):
    "zero" (ZeRO-1/2, DeepSpeedZeroOptimizer), "bf16" (BF16_Optimizer: ZeRO-1 with bf16 weights and fp32
    gradient accumulation), "half" (fp16/bf16 without ZeRO: FP16_Optimizer or FP16_UnfusedOptimizer), or
    "torch" (ZeRO off in fp32: the client's optimizer itself)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "zero"
    if isinstance(optimizer, BF16_Optimizer):
        return "bf16"
    if isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return "half"
    return "torch"


def zero_partition_globals():
    """The classes DeepSpeed's ZeRO optimizer state holds besides tensors (a rank's per_rank file, which this
    backend writes): its loss scaler, its stage enum, the fragment addresses of the flat partitions. Plain
    data, reconstructed by weights-only loading without running code (moe/checkpoint/trust.py)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, ZeroStageEnum, fragment_address


class MoEDeepSpeedStrategy(FormatCheckpoints, DeepSpeedStrategy):
    """DeepSpeedStrategy + MoE-aware engine, our checkpoint formats with per-rank ZeRO partitions, CPU."""

    strategy_name = "moe_deepspeed"
    optimizer_in_checkpoint = False  # each rank's ZeRO partition holds it (Live.per_rank)

    def __init__(self, *args, timeout=None, **kwargs):
        super().__init__(*args, timeout=timeout, **kwargs)
        self.collective_timeout = timeout  # the world group's, for the CPU set-up (setup_distributed)

    # -- CPU support (Lightning's checks assume CUDA) ----------------------------------------
    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # skips the CUDA-only accelerator check

    def setup_distributed(self) -> None:
        """On CPU: Lightning's steps (lightning/pytorch/strategies/deepspeed.py:376-399 at 2.6.6,
        _init_deepspeed_distributed) through public calls (deepspeed/comm/comm.py:844 init_distributed),
        without its check of a CUDA device index."""
        import deepspeed
        from lightning.fabric.utilities.seed import reset_seed

        if self.root_device.type == "cuda":
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        env = self.cluster_environment
        os.environ.update(MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port),
                          RANK=str(self.global_rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(self.local_rank))
        deepspeed.init_distributed(self.process_group_backend, distributed_port=env.main_port,
                                   timeout=self.collective_timeout)

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # private: the engine's class
        """deepspeed.initialize's non-pipeline path, with the MoE-aware engine and a CPU device rank."""
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig

        device_rank = self.root_device.index if self.root_device.index is not None else self.local_rank
        config_class = DeepSpeedConfig(self.config, None)
        deepspeed.set_optimizer_flags(config_class, model)
        engine = expert_aware_engine_class()(
            args=argparse.Namespace(device_rank=device_rank), model=model, optimizer=optimizer,
            model_parameters=[p for p in model.parameters() if p.requires_grad], lr_scheduler=lr_scheduler,
            dist_init_required=False, config=self.config, config_class=config_class,
        )
        return engine, engine.optimizer

    # -- checkpoints: the spec's format, with each rank's ZeRO optimizer partition beside it ------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        partition = {"optimizer": self.deepspeed_engine.optimizer.state_dict(),
                     "layout": self._layout(checkpoint.get("global_step"))}
        checkpoint = {**checkpoint, "optimizer_states": []}  # they are the per-rank partitions
        path = Path(self.broadcast(str(filepath)))
        self.checkpoint_format.save(self.checkpoint_live(per_rank=partition), checkpoint, path)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """A DeepSpeed directory (Lightning's own DeepSpeedStrategy wrote it) through DeepSpeed's engine;
        ours through its format, this rank's partition found beside it."""
        path = Path(checkpoint_path)
        found = format_at(path)
        if isinstance(found, DeepSpeedDirectory):
            return DeepSpeedStrategy.load_checkpoint(self, checkpoint_path, weights_only)
        self._loaded_from = path
        self._partition_file = found.partition_file(path, self.global_rank)
        return super().load_checkpoint(path, weights_only)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Weights (already in place from a sharded directory), then this rank's optimizer partition
        when the layout matches."""
        path = getattr(self, "_loaded_from", None)
        if path is None:
            return DeepSpeedStrategy.load_model_state_dict(self, checkpoint, strict=strict)
        if not in_place(checkpoint):
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        optimizer = self.deepspeed_engine.optimizer
        if optimizer is None or self.lightning_module.trainer.state.fn != "fit":
            return
        shard_file = self._partition_file
        shard = None
        if shard_file.exists():
            with torch.serialization.safe_globals(list(zero_partition_globals())):
                shard = load_trusted(shard_file)
        layout = self._layout(checkpoint.get("global_step"))  # a shard from another save is never mixed in
        if shard is not None and shard["layout"] == layout:
            if self.config["zero_optimization"]["stage"] > 0:  # ZeRO reads entry [dp rank] of the list
                optimizer.load_state_dict([shard["optimizer"]] * self.world_size, load_optimizer_states=True,
                                          load_from_fp32_weights=True)
            else:
                optimizer.load_state_dict(shard["optimizer"])
            return
        saved = shard["layout"] if shard else None
        rank_zero_warn(f"{path}: optimizer state not restored (saved with {saved}, running {layout}); "
                       "weights restored, Adam moments start from zero")
        if hasattr(optimizer, "refresh_fp32_params"):
            optimizer.refresh_fp32_params()

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_model_state_dict restores the partitions

    def _layout(self, global_step) -> dict:
        """What a saved optimizer partition must match to be loaded as it is."""
        return {"world_size": self.world_size, "ep": self.dims.ep,
                "zero_stage": self.config["zero_optimization"]["stage"], "global_step": global_step}



_ENGINE_CLASS = None


def expert_aware_engine_class():
    """DeepSpeedEngine that treats parameters marked `allreduce=False` as MoE experts (built once, lazily)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is not None:
        return _ENGINE_CLASS
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.engine import DeepSpeedEngine

    from moe.model.moe import MoELayer

    class _ExpertAwareEngine(DeepSpeedEngine):
        def _configure_distributed_model(self, model):  # private: where DeepSpeed decides a model is MoE
            super()._configure_distributed_model(model)  # private: (engine.py, isinstance of its own MoE)
            if not self.has_moe_layers and any(is_moe_param(p) for p in model.parameters()):
                self.has_moe_layers = True
                self.num_experts = [m.num_experts for m in model.modules() if isinstance(m, MoELayer)]

    _ENGINE_CLASS = _ExpertAwareEngine
    return _ENGINE_CLASS
