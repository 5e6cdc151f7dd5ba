"""What DeepSpeed ZeRO can do (moe.config.specs.BackendSpec) and what its state and buckets cost, readable
without importing deepspeed."""
from __future__ import annotations

from dataclasses import dataclass

from moe.config.derived import precision
from moe.config.specs import BackendSpec, StateBytes

REDUCE_BUCKET_ELEMENTS = 200_000_000  # ZeRO's reduce and all-gather buckets (deepspeed/backend.py)


@dataclass(frozen=True)
class DeepSpeedSpec(BackendSpec):
    def state_bytes(self, model, parallel, hardware, trainer) -> StateBytes:
        run = precision(trainer, hardware)
        if run.mixed:  # DeepSpeed keeps half weights and grads, fp32 master + moments
            return StateBytes(2, 2, 12, f"{run.name} DeepSpeed: half weights, grads; fp32 master, moments",
                              step=4, grads_in_step=False)
        return super().state_bytes(model, parallel, hardware, trainer)

    def comm_buffer_bytes(self, model, parallel, hardware, trainer, dp: int) -> float:
        """ZeRO's gradient reduction bucket: reduce_bucket_size elements of the model dtype, twice when
        overlap_comm (on GPU) double-buffers it (deepspeed 0.19.8 stage_1_and_2.py:3256-3278)."""
        if parallel.zero_stage < 1:
            return 0.0
        model_dtype_bytes = self.state_bytes(model, parallel, hardware, trainer).param
        return REDUCE_BUCKET_ELEMENTS * model_dtype_bytes * (2 if hardware.accelerator == "gpu" else 1)


SPEC = DeepSpeedSpec(
    name="deepspeed", library="DeepSpeed", max_zero_stage=2,  # ZeRO-3 rejects DeepSpeed's native MoE
    tensor_parallel=False, pipeline_parallel=False, hybrid_shard=False,
    precisions=("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"),
    backend="moe.backends.deepspeed.backend:DeepSpeedBackend", overlap_comm=True,
    half_weights_when_mixed=True, optimizer_shards="zero",
    zero_limit="optimizer states and gradients sharded, with expert parallelism for the experts: "
               "DeepSpeed ZeRO-3 does not support MoE")
