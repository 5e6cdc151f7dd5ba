"""The arguments of `neuronx_distributed.trainer.neuronx_distributed_config`, from our groups.

Signature at neuronx-distributed v2.28.0 (src/neuronx_distributed/trainer/trainer.py:32-47):
tensor/pipeline/expert/context parallel sizes, pipeline_config (NxDPPModel's keyword arguments,
trainer.py:172-177), optimizer_config, activation_checkpoint_config (a list of module classes;
the string "full" only works for Hugging Face, NxDT or pipelined models, trainer.py:202-233),
sequence_parallel, model_init_config and mixed_precision_config.
"""
from __future__ import annotations

from moe.backends.neuron.env import NEURON_PRECISION
from moe.config.derived import neuron_precision
from moe.config.schema import HardwareConfig, ModelConfig, OptimizerConfig, ParallelConfig
from moe.parallel.dims import ParallelDims

# parallel.activation_checkpointing -> the classes NxD wraps: full = every block, moe_only = the
# MoE layers, selective = core attention + MoE (NxD's Mixtral "selective" is (CoreAttention, MoE),
# run_mixtral_pretrain_ptl.py:182; our apply_ac means the same). every_n is refused on trn1.
CHECKPOINT_CLASSES = {"none": (), "full": ("StageBlock",), "moe_only": ("NxDMoELayer",),
                      "selective": ("CoreAttention", "NxDMoELayer")}


def checkpoint_classes(policy: str) -> list[type] | None:
    from moe.backends.neuron.causal_lm import StageBlock
    from moe.backends.neuron.nxd_moe_layer import NxDMoELayer
    from moe.model.model import CoreAttention

    known = {"StageBlock": StageBlock, "NxDMoELayer": NxDMoELayer, "CoreAttention": CoreAttention}
    return [known[name] for name in CHECKPOINT_CLASSES[policy]] or None


def nxd_config_kwargs(hardware: HardwareConfig, model: ModelConfig, optimizer: OptimizerConfig,
                      parallel: ParallelConfig, dims: ParallelDims, param_init_fn) -> dict:
    """Everything neuronx_distributed_config takes, for a validated config's sections and its ParallelDims."""
    from neuronx_distributed.parallel_layers import mappings

    from moe.backends.neuron.causal_lm import StageBlock, nxd_lm_loss

    zero1 = dims.zero_stage == 1
    master = NEURON_PRECISION[neuron_precision(hardware, model)]["master_weights"] and zero1
    pipeline_config = None
    if dims.pp_enabled:  # NxDPPModel's arguments (src/neuronx_distributed/pipeline/model.py:75-114)
        pipeline_config = {
            "transformer_layer_cls": StageBlock,
            "num_microbatches": parallel.pipeline_microbatches or dims.accumulate_grad_batches,
            "output_loss_value_spec": (True, False),  # NxDCausalLM returns (loss, lm_loss)
            "input_names": ["input_ids", "labels"],
            "auto_partition": True,
            "leaf_module_cls": ["RMSNorm"],
            # the sequence-parallel scatter is not in NxD's own auto-wrapped functions
            # (parallel_layers/__init__.py:31-37); NxD's Mixtral example and NxDT add the module
            # (run_mixtral_pretrain_ptl.py:155-173, NxDT lightning_modules/model/base.py:146-157)
            "autowrap_modules": [mappings],
            "autowrap_functions": [nxd_lm_loss],
            "use_zero1_optimizer": zero1,
            "use_optimizer_wrapper": True,
            "return_loss_on_cpu": False,  # a host copy per step would stall the device
        }
    return {
        "tensor_parallel_size": dims.tp,
        "pipeline_parallel_size": dims.pp,
        "expert_parallel_size": dims.ep,
        "pipeline_config": pipeline_config,
        "optimizer_config": {"zero_one_enabled": zero1, "grad_clipping": optimizer.grad_clip > 0,
                             "max_grad_norm": float(optimizer.grad_clip or 1.0)},
        "activation_checkpoint_config": checkpoint_classes(parallel.activation_checkpointing),
        "sequence_parallel": dims.sequence_parallel,
        "model_init_config": {"meta_device_init": True, "param_init_fn": param_init_fn,
                              "sequential_move_factor": 11},
        "mixed_precision_config": {"use_master_weights": master, "use_fp32_grad_acc": master,
                                   "use_master_weights_in_ckpt": master},
    }
