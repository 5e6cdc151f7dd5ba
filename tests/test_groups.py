"""EP and expert-DP rank layout: contiguous EP groups, strided expert-DP groups, as DeepSpeed makes them."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import on_gloo_ranks

from moe.parallel.dims import ParallelDims


def data_parallel_dims(world: int, ep: int, tp: int = 1, pp: int = 1) -> ParallelDims:
    """ParallelDims of `world` devices (tp = pp = 1 unless given), ep experts-parallel, 8 experts a rank."""
    return ParallelDims(world=world, tp=tp, pp=pp, ep=ep, dp=world // (tp * pp), sequence_parallel=False,
                        zero_stage=0, devices_per_node=8, micro_batch_size=1, accumulate_grad_batches=1,
                        seq_len=8, num_layers=pp, num_experts=8 * ep)


def expert_group_ranks(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    dims = data_parallel_dims(world, ep)
    return dims.group("EP").ranks, dims.group("expert-DP").ranks


def test_16_ranks_ep8_gives_two_ep_groups_and_expert_dp_2():
    ep_groups, expert_dp_groups = expert_group_ranks(16, 8)
    assert ep_groups == [list(range(0, 8)), list(range(8, 16))]
    assert expert_dp_groups == [[i, i + 8] for i in range(8)]  # [0, 8], [1, 9], ..., [7, 15]


@pytest.mark.parametrize("world, ep, want_ep, want_dp", [
    (2, 2, [[0, 1]], [[0], [1]]),
    (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (4, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
])
def test_small_layouts(world, ep, want_ep, want_dp):
    assert expert_group_ranks(world, ep) == (want_ep, want_dp)


def test_rank_groups_follow_nxd_order():
    """[PP, DP, TP] for dense, [PP, DP_exp, EP, TP] for experts: 2 x 4 x 2 world of 16."""
    dims = data_parallel_dims(16, ep=2, tp=2, pp=2)
    groups = {g.name: g for g in dims.rank_groups()}
    assert groups["DP"].ranks[0] == [0, 2, 4, 6] and groups["DP"].count == 4
    assert groups["EP"].ranks[0] == [0, 2] and groups["EP"].count == 8
    assert groups["expert-DP"].ranks[0] == [0, 4] and groups["expert-DP"].size == 2
    assert groups["PP"].ranks[0] == [0, 8]
    rank = 13  # pp 1, dp 2, tp 1: its DP group is the second PP stage's, its EP group the second of that
    assert (dims.pp_rank(rank), dims.dp_rank(rank), dims.tp_rank(rank)) == (1, 2, 1)
    assert (dims.ep_rank(rank), dims.expert_dp_rank(rank)) == (0, 1)
    assert rank in next(g for g in groups["EP"].ranks if 13 in g) and [9, 11] in groups["EP"].ranks


def test_every_rank_in_exactly_one_group_of_each_kind():
    ep_groups, expert_dp_groups = expert_group_ranks(64, 8)
    for groups in (ep_groups, expert_dp_groups):
        assert sorted(r for g in groups for r in g) == list(range(64))


class _RecordingComm:
    """Stands in for deepspeed.comm as seen by one rank: new_group returns the rank tuple."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank, self.calls = world, rank, []

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return self.world

    def get_rank(self, group=None):
        return self.rank

    def new_group(self, ranks):
        self.calls.append(list(ranks))
        return tuple(ranks)


@pytest.mark.parametrize("world, ep", [(16, 8), (4, 2), (8, 2), (2, 2)])
def test_same_layout_and_creation_order_as_deepspeed(monkeypatch, world, ep):
    """DeepSpeed's own `_create_expert_and_data_parallel` (run against a recording comm) agrees."""
    from deepspeed.utils import groups

    ep_groups, expert_dp_groups = expert_group_ranks(world, ep)
    monkeypatch.setattr(groups, "log_dist", lambda *a, **k: None)
    for rank in range(world):
        comm = _RecordingComm(world, rank)
        monkeypatch.setattr(groups, "dist", comm)
        for table in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                      "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
            monkeypatch.setattr(groups, table, {})
        groups._create_expert_and_data_parallel(ep)
        name = f"ep_size_{ep}"
        assert list(groups._EXPERT_PARALLEL_GROUP[name]) == next(g for g in ep_groups if rank in g)
        mine = next(g for g in expert_dp_groups if rank in g)
        assert list(groups._EXPERT_DATA_PARALLEL_GROUP[name]) == mine
        assert comm.calls == expert_dp_groups + ep_groups  # ParallelDims.expert_groups's order too


def _expert_group_ranks(rank: int):
    groups = data_parallel_dims(4, 2).expert_groups()
    return dist.get_process_group_ranks(groups.ep), dist.get_process_group_ranks(groups.expert_dp)


@pytest.mark.slow
def test_expert_groups_on_four_processes():
    out = on_gloo_ranks(4, _expert_group_ranks)
    assert out == {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])}
