from _neuron_stub import unavailable as _u

# Imported by trace/model_builder.py:35, not used further by NxD.
hlo_debug = _u("torch_neuronx.experimental.profiler.v2_x.custom_op_name.hlo_debug")
