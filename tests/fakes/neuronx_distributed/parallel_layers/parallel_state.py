"""FAKE neuronx_distributed.parallel_layers.parallel_state (v2.28.0 getters and rank order).

Ranks are laid out as NxD lays them out, [PP, DP, TP] with TP fastest (parallel_state.py:620-636),
and the same divisibility is required (:572-592). Tensor and expert parallelism above 1 raise:
these fakes compute at degree 1 only.
"""
import torch.distributed as dist

_STATE: dict = {}


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                              expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1, mesh_only=False):
    assert dist.is_initialized(), "torch.distributed must be initialized first (parallel_state.py:556)"
    world = dist.get_world_size()
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    if world % (tp * pp * context_parallel_size):
        raise RuntimeError(f"world_size ({world}) is not divisible by tp ({tp}) x pp ({pp})")
    if world % (tp * pp * ep):
        raise RuntimeError(f"world_size ({world}) is not divisible by tp ({tp}) x pp ({pp}) x ep ({ep})")
    if tp > 1 or ep > 1:
        raise NotImplementedError("the neuronx_distributed fake computes at tensor and expert parallelism 1 only")
    dp = world // (tp * pp)
    rank = dist.get_rank()
    _STATE.update(tp=tp, pp=pp, ep=ep, dp=dp, rank=rank)
    dp_groups = [[s * dp * tp + d * tp + t for d in range(dp)] for s in range(pp) for t in range(tp)]
    for ranks in dp_groups:  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        if rank in ranks:
            _STATE.update(dp_group=group, dp_ranks=dp_groups)


def model_parallel_is_initialized():
    return bool(_STATE)


def destroy_model_parallel():
    _STATE.clear()


def get_tensor_model_parallel_size():
    return _STATE["tp"]


def get_tensor_model_parallel_rank():
    return 0


def get_tensor_model_parallel_group(as_list: bool = False):
    return dist.new_group([_STATE["rank"]]) if not as_list else [[r] for r in range(dist.get_world_size())]


def get_pipeline_model_parallel_size():
    return _STATE["pp"]


def get_pipeline_model_parallel_rank():
    return _STATE["rank"] // (_STATE["dp"] * _STATE["tp"])


def get_data_parallel_size():
    return _STATE["dp"]


def get_data_parallel_rank():
    return _STATE["rank"] // _STATE["tp"] % _STATE["dp"]


def get_data_parallel_group(as_list: bool = False):
    return _STATE["dp_ranks"] if as_list else _STATE["dp_group"]


def get_data_parallel_replica_groups():
    return _STATE["dp_ranks"]


def get_expert_model_parallel_size():
    return _STATE.get("ep", 1)


def get_expert_model_parallel_rank():
    return 0


def get_expert_model_parallel_group(as_list: bool = False):
    return dist.new_group([_STATE["rank"]]) if not as_list else [[r] for r in range(dist.get_world_size())]


def get_experts_for_expert_parallel_rank(expert_parallel_rank, total_number_of_experts, expert_model_parallel_size,
                                         expert_distribution=None):
    per_rank = total_number_of_experts // expert_model_parallel_size  # parallel_state.py:999-1030
    return list(range(expert_parallel_rank * per_rank, (expert_parallel_rank + 1) * per_rank))


def is_global_rank_zero():
    return _STATE.get("rank", 0) == 0
