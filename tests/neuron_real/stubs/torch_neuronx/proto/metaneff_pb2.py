# Stub protobuf module: names appear in NxD type annotations (evaluated at import time).
from _neuron_stub import unavailable_class as _uc

MetaNeff = _uc("torch_neuronx.proto.metaneff_pb2.MetaNeff")
MetaTensor = _uc("torch_neuronx.proto.metaneff_pb2.MetaTensor")
