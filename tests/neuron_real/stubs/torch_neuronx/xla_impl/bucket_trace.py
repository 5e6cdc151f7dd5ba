from _neuron_stub import unavailable as _u

create_bucket_model = _u("torch_neuronx.xla_impl.bucket_trace.create_bucket_model")
