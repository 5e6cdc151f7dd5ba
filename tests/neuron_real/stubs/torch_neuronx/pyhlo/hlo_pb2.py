# Stub protobuf module: names appear in NxD type annotations (evaluated at import time).
from _neuron_stub import unavailable_class as _uc

HloModuleProto = _uc("torch_neuronx.pyhlo.hlo_pb2.HloModuleProto")
HloComputationProto = _uc("torch_neuronx.pyhlo.hlo_pb2.HloComputationProto")
HloInstructionProto = _uc("torch_neuronx.pyhlo.hlo_pb2.HloInstructionProto")
HloInputOutputAliasProto = _uc("torch_neuronx.pyhlo.hlo_pb2.HloInputOutputAliasProto")
