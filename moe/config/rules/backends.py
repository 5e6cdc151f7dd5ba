"""What a backend cannot do, refused with what to use instead, asked of its spec: a capability it lacks
becomes one paragraph. What a backend's own library refuses beyond its spec is that backend's
(moe/backends/<name>/rules.py, found in moe.backends.registry)."""
from __future__ import annotations

from moe.backends.registry import BACKENDS, SPECS
from moe.config.choices import NEURON_PRECISIONS
from moe.config.derived import has_moe_layers, precision_of
from moe.config.rules.refusals import need, one_of
from moe.errors import ConfigError


def check_backend(hardware, trainer) -> None:
    hw, t = hardware, trainer
    one_of("hardware.strategy", hw.strategy, tuple(SPECS), "strategy")
    need(t.devices <= hw.devices_per_node, "trainer.devices", t.devices,
         f"use at most {hw.devices_per_node} devices per node and raise trainer.num_nodes instead",
         f"exceeds hardware.devices_per_node={hw.devices_per_node} ({hw.name})")
    one_of("hardware.neuron_precision", hw.neuron_precision, NEURON_PRECISIONS, "Neuron precision preset")
    spec = SPECS[hw.strategy]
    precision = precision_of(t, hw)
    if spec.precisions is None:
        need(t.precision is None, "trainer.precision", t.precision,
             "leave trainer.precision=null and pick hardware.neuron_precision "
             f"({', '.join(NEURON_PRECISIONS)})",
             f"is not used by {spec.library} (hardware={hw.name})")
    else:
        key = "trainer.precision" if t.precision else "hardware.precision"
        need(precision in spec.precisions, key, precision, f"use one of {', '.join(spec.precisions)}",
             f"is not a precision the {spec.library} backend runs")


def check_backend_degrees(parallel, hardware, spec) -> None:
    """A degree the backend would ignore is refused, so no run silently trains another layout."""
    p, hw = parallel, hardware
    capable = {"tp": spec.tensor_parallel, "pp": spec.pipeline_parallel}
    for key, able in capable.items():
        if getattr(p, key) > 1 and not able:
            others = [s.name for s in SPECS.values()
                      if (s.tensor_parallel if key == "tp" else s.pipeline_parallel)]
            raise ConfigError(f"parallel.{key}", getattr(p, key),
                              f"set parallel.{key}=1 (use parallel.ep and data parallelism), or a backend "
                              f"that has it (hardware.strategy: {', '.join(others)}; e.g. hardware=trn1)",
                              problem=f"is not implemented by {spec.library} (hardware={hw.name})")


def check_pp_schedule(parallel, spec) -> None:
    """Only the torch-native backend picks a pipeline schedule; NxD runs its own 1F1B."""
    p = parallel
    if len(spec.pp_schedules) > 1:
        return
    need(p.pp_schedule == "1F1B" and p.pp_stages_per_rank in (None, 1), "parallel.pp_schedule",
         p.pp_schedule, "leave parallel.pp_schedule=1F1B and parallel.pp_stages_per_rank=null, or use the "
         "torch-native backend (hardware=gpu_fsdp2, trn2, cpu_fsdp2) for other schedules",
         f"is not chosen on {spec.library}: neuronx-distributed runs its own 1F1B schedule")


def check_offload(parallel, model, spec) -> None:
    """parallel.offload_experts is FSDP2's CPUOffloadPolicy on the experts' units (the torch-native
    backend's)."""
    if not parallel.offload_experts:
        return
    need(spec.offload_experts, "parallel.offload_experts", True,
         "use the torch-native backend (hardware=gpu_fsdp2 or gpu_a100_fsdp2), or "
         "parallel.offload_experts=false",
         f"is FSDP2's CPUOffloadPolicy, which {spec.library} does not run (DeepSpeed's own "
         "offload is not built here)")
    need(has_moe_layers(model), "parallel.offload_experts", True, "set parallel.offload_experts=false",
         f"has no experts to offload in model={model.name}")


def check_overlap_comm(parallel, spec) -> None:
    """parallel.overlap_comm is a DeepSpeed ZeRO setting."""
    p = parallel
    if p.overlap_comm is None:
        return
    need(spec.overlap_comm, "parallel.overlap_comm", p.overlap_comm,
         "leave parallel.overlap_comm=null, or use DeepSpeed (hardware=gpu or cpu_deepspeed)",
         f"is DeepSpeed's ZeRO setting, which {spec.library} does not have")


# the rules one backend adds, by hardware.strategy (its spec says what it can do; these say what its library
# refuses, with the fix)
BACKEND_RULES = {name: registered.rules for name, registered in BACKENDS.items() if registered.rules}
