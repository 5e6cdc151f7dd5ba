"""FAKE neuronx_distributed.parallel_layers.layers at tensor parallelism 1 (signatures of v2.28.0).

Weights are created as the real layers create them (layers.py:660-725): an empty parameter of the
local shard's shape on the given device (the CPU unless NxD's meta-device context moved it), then,
on the CPU, `init_method` on the full weight, on the meta device nothing but the tensor-parallel
attributes. The forwards are the plain layers': at degree 1 the collectives are identities.
"""
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init
from torch.nn.parameter import Parameter


def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride, num_partitions=-1, rank_ordering=None):
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        assert not hasattr(tensor, attr), f"{attr} is already set (utils.py:57-58)"
    tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = is_parallel, dim, stride
    tensor.num_partitions = num_partitions


def _make_weight(module, shape, dim, stride, init_method, device, dtype):
    module.weight = Parameter(torch.empty(*shape, device=device, dtype=dtype))
    set_tensor_model_parallel_attributes(module.weight, True, dim, stride, 1)
    if module.weight.device.type == "cpu":
        with torch.no_grad():
            init_method(module.weight)


def _default_init(weight):
    init.kaiming_uniform_(weight, a=math.sqrt(5))


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None, stride: int = 1,
                 init_method: Callable[[Any], torch.Tensor] | None = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: int | None = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, pad_alignment_size_per_rank: int = 1,
                 keep_padded_output: bool = False, tensor_model_parallel_group=None,
                 reduce_dtype: torch.dtype = torch.float32, rank_ordering: list | None = None):
        super().__init__()
        assert not (gather_output and sequence_parallel_enabled), "gather_output with SP (layers.py:794)"
        self.input_size, self.output_size, self.sequence_parallel_enabled = input_size, output_size, sequence_parallel_enabled
        _make_weight(self, (output_size, input_size), 0, stride, init_method or _default_init, device, dtype)
        self.bias = Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, input: torch.Tensor, slice_indices: torch.Tensor | None = None):
        return F.linear(input, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None, stride: int = 1,
                 init_method: Callable[..., Any] | None = None, sequence_parallel_enabled: bool = False,
                 sequence_dimension: int | None = None, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, pad: bool = False, reduce_output: bool = True,
                 tensor_model_parallel_group=None, reduce_dtype: torch.dtype = torch.float32, tile_cc: bool = False,
                 rank_ordering: list | None = None):
        super().__init__()
        assert not sequence_parallel_enabled or input_is_parallel, "SP needs input_is_parallel (layers.py:891-892)"
        self.input_size, self.output_size = input_size, output_size
        _make_weight(self, (output_size, input_size), 1, stride, init_method or _default_init, device, dtype)
        self.bias = Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, input_: torch.Tensor, slice_indices: torch.Tensor | None = None):
        return F.linear(input_, self.weight, self.bias)


class ParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, init_method: Callable[[Any], Any] = init.normal_,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 shard_across_embedding: bool = False, pad: bool = False, sequence_parallel_enabled: bool = False,
                 tensor_model_parallel_group=None, use_spmd_rank: bool = False, sequence_dimension: int | None = None,
                 tile_cc: bool = False, rank_ordering: list | None = None, collect_output: bool = True):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        _make_weight(self, (num_embeddings, embedding_dim), 1 if shard_across_embedding else 0, 1, init_method,
                     device, dtype)

    def forward(self, input_: torch.Tensor):
        return F.embedding(input_, self.weight)


class SPMDRank(nn.Module):
    """The rank, and under expert parallelism the rank's experts, as parameters (layers.py:1549-1608);
    ExpertMLPs builds one with enable_spmd_rank, which these fakes (expert parallelism 1) never do."""

    def __init__(self, world_size: int, tensor_model_parallel_size: int | None = None):
        super().__init__()
        self.world_size = world_size
        self.rank = Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)

    def get_rank(self) -> torch.Tensor:
        return self.rank

    def initialize_expert_indices(self, num_local_experts) -> torch.Tensor:
        self.local_expert_indices = Parameter(torch.zeros((1, num_local_experts), dtype=torch.int32),
                                              requires_grad=False)

    def get_local_expert_indices(self) -> torch.Tensor:
        return self.local_expert_indices
