from _neuron_stub import unavailable as _u
from _neuron_stub import unavailable_class as _uc

get_torch_dtype = _u("torch_neuronx.xla_impl.trace.get_torch_dtype")
generate_neff = _u("torch_neuronx.xla_impl.trace.generate_neff")
hlo_entry_computation = _u("torch_neuronx.xla_impl.trace.hlo_entry_computation")
get_hlo_computation_by_id = _u("torch_neuronx.xla_impl.trace.get_hlo_computation_by_id")
get_hlo_root_instruction = _u("torch_neuronx.xla_impl.trace.get_hlo_root_instruction")
HloArtifacts = _uc("torch_neuronx.xla_impl.trace.HloArtifacts")
NeffArtifacts = _uc("torch_neuronx.xla_impl.trace.NeffArtifacts")
XLA_DTYPE_TO_METANEFF_DTYPE = {}
