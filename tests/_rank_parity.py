"""The FSDP2 backend's layouts on gloo ranks against one process (tests/test_folded_ep.py and
tests/test_pipeline.py): the tiny model both train, their fixed batches, one process's reference (computed
once per pytest run for each config), and the comparison: every gradient of the first step (the ranks'
shards assembled into canonical tensors, elementwise) and every parameter after the second (in norm),
float32, 1e-5 relative."""
from __future__ import annotations

import functools

import torch

from tests._shards import assemble
from tests.conftest import compose_cfg

SEQ = 8  # tokens per sequence
TOL = dict(rtol=1e-5, atol=1e-7)
# A dense first layer, then MoE layers of 8 experts, top-2, a shared expert, dropless, the load-balance
# statistics over every rank
TINY_MOE = ("model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=16",
            "model.first_k_dense_replace=1", "model.dense_intermediate_size=32", "model.num_heads=4",
            "model.num_kv_heads=2", "model.shared_expert_intermediate_size=16", "moe_opt=dropless",
            "moe_opt.aux_loss_group=dp", "moe_opt.aux_loss_coeff=0.1")


def fsdp2_cfg(world: int, *extra: str):
    return compose_cfg("hardware=cpu_fsdp2", f"trainer.devices={world}", f"hardware.devices_per_node={world}",
                       f"data.seq_len={SEQ}", *TINY_MOE, *extra)


def batches(sequences: int) -> list[torch.Tensor]:
    """Two global batches (step 1, step 2) of `sequences` sequences of SEQ + 1 tokens."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (sequences, SEQ + 1), generator=gen) for _ in range(2)]


@functools.cache
def one_process(overrides: tuple[str, ...], dp: int, rows: int, micro_batches: int, init_seed: int,
                adam: tuple[tuple[str, float], ...]) -> dict:
    """One process, two AdamW steps on the same global batches: micro-batch i of a step is every
    data-parallel rank's i-th micro-batch (the load balance is over them all), each loss / micro_batches
    backward, as the step accumulates. Per step and micro-batch: `loss` and `lm_loss`."""
    from moe.model.model import MoETransformer

    cfg = fsdp2_cfg(1, *overrides)
    model = MoETransformer(cfg.model, cfg.moe_opt, init_seed=init_seed)
    opt = torch.optim.AdamW(model.parameters(), **dict(adam), foreach=False)
    per_micro = rows // micro_batches
    out = {"loss": [], "lm_loss": [], "grads": None}
    for ids in batches(dp * rows):
        loss, lm_loss = [], []
        for i in range(micro_batches):
            batch = torch.cat([ids[d * rows + i * per_micro:d * rows + (i + 1) * per_micro]
                               for d in range(dp)])
            result = model(batch[:, :-1], labels_BS=batch[:, 1:])
            (result.loss / micro_batches).backward()
            loss.append(result.loss.item())
            lm_loss.append(result.lm_loss.item())
        out["loss"].append(loss)
        out["lm_loss"].append(lm_loss)
        out["grads"] = out["grads"] or {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["params"] = {name: p.detach() for name, p in model.named_parameters()}
    return out


def assert_same_grads_and_params(ranks: dict, want: dict, world: int) -> None:
    """`ranks[r]["grads"|"params"]`: rank r's canonical pieces (tests._shards.canonical_pieces)."""
    for key in ("grads", "params"):
        shapes = {name: t.shape for name, t in want[key].items()}
        got = assemble([ranks[r][key] for r in range(world)], shapes)
        assert set(got) == set(want[key])
        for name, value in want[key].items():
            if key == "grads":
                torch.testing.assert_close(got[name], value, **TOL, msg=name)
            else:  # Adam divides by sqrt(v): elementwise, a near-zero gradient's rounding shows at lr scale
                assert (got[name] - value).norm() <= 1e-5 * value.norm(), name
