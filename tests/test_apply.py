"""Parallelism appliers: activation checkpointing policies, expert sharding, per-block compile."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import on_gloo_ranks

from moe.config import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.model import MoETransformer
from moe.parallel.apply import CheckpointWrapper, apply_ac, apply_compile, apply_ep
from moe.parallel.expert_exchange import AllToAllDispatcher

CFG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=24, num_layers=4, num_heads=4,
                  num_kv_heads=2, num_experts=4, top_k=2, moe_layer_frequency=2)
OPT = MoEOptConfig(capacity_factor=1.0, jitter_eps=0.1)  # drops and router noise: AC must replay both
IDS = torch.randint(0, 53, (2, 16), generator=torch.Generator().manual_seed(0))


def build(policy="none", every_n=1, cfg=CFG, opt=OPT):
    torch.manual_seed(0)
    return apply_ac(MoETransformer(cfg, opt).train(), policy, every_n)


def loss_and_grads(model):
    torch.manual_seed(1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = model(IDS)
        loss = F.cross_entropy(out.logits_BSV[:, :-1].flatten(0, 1), IDS[:, 1:].flatten()) + out.aux_loss
    loss.backward()
    # the wrapper adds its child's name to parameter names (state-dict keys stay unchanged, tested below)
    grads = {n.replace("._checkpoint_wrapped_module.", "."): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, sum(saved)


@pytest.mark.parametrize("policy,every_n", [("full", 1), ("every_n", 2), ("moe_only", 1), ("selective", 1)])
def test_ac_gives_identical_loss_and_grads_and_saves_less(policy, every_n):
    ref_loss, ref_grads, ref_saved = loss_and_grads(build())
    loss, grads, saved = loss_and_grads(build(policy, every_n))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-7, msg=name)
    assert saved < ref_saved


def test_ac_policies_wrap_the_documented_modules():
    wrapped = lambda m: [isinstance(b, CheckpointWrapper) for b in m.layers]
    assert wrapped(build("full")) == [True] * 4
    assert wrapped(build("every_n", 2)) == [False, True, False, True]
    assert wrapped(build("every_n", 3)) == [False, False, True, False]
    assert wrapped(build("moe_only")) == [False, True, False, True]  # frequency 2: layers 1 and 3 are MoE
    assert wrapped(build("none")) == [False] * 4
    selective = build("selective")
    assert wrapped(selective) == [False] * 4
    # core attention everywhere and the experts' MLPs of MoE layers; routing and dispatch (the
    # all-to-all under EP) are not recomputed, so a near-tie cannot route differently on recompute
    assert all(isinstance(b.attn.core, CheckpointWrapper) and not isinstance(b.attn, CheckpointWrapper)
               and not isinstance(b.ffn, CheckpointWrapper) for b in selective.layers)
    assert all(isinstance(b.ffn.experts, CheckpointWrapper) for b in selective.layers if b.is_moe)


def test_state_dict_keys_survive_ac_both_ways():
    plain, full, selective = build(), build("full"), build("selective")
    assert list(full.state_dict()) == list(plain.state_dict()) == list(selective.state_dict())
    other = build("full")
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.5)
    other.load_state_dict(plain.state_dict())  # plain checkpoint into a wrapped model
    selective.load_state_dict(other.state_dict())
    for a, b in zip(plain.state_dict().values(), selective.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_ac_is_skipped_in_eval_and_kv_cache_decoding_still_matches():
    model = build("full", cfg=CFG, opt=MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)).eval()
    with torch.no_grad():
        full = model(IDS).logits_BSV
        cache = model.new_kv_cache()
        first = model(IDS[:, :10], kv_cache=cache).logits_BSV
        rest = model(IDS[:, 10:], kv_cache=cache, position_offset=10).logits_BSV
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-5)


FRESH_AC = """
import torch
from moe.config import ModelConfig, MoEOptConfig
from moe.model import MoETransformer
from moe.parallel.apply import apply_ac
cfg = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4,
                  num_kv_heads=2, num_experts=4, top_k=2)
model = apply_ac(MoETransformer(cfg, MoEOptConfig()).train(), "full")
model(torch.randint(0, 53, (2, 16))).logits_BSV.sum().backward()
print("grad", float(model.layers[0].ffn.router.weight.grad.abs().sum()) > 0)
"""


def test_ac_works_from_the_first_step_of_a_fresh_process():
    """The very first forward may run one-off probes (e.g. grouped_mm); AC must still recompute alike."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FRESH_AC], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "grad True" in done.stdout


def test_applying_ac_twice_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        apply_ac(build("full"), "full")
    assert err.value.field == "parallel.activation_checkpointing" and "once" in err.value.fix


def _ep_rank(rank, ref_logits, ref_state):
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)
    model = MoETransformer(CFG, opt).eval()
    model.load_state_dict(ref_state)
    apply_ep(model, dist.group.WORLD)
    for block in model.layers:
        if block.is_moe:
            assert isinstance(block.ffn.dispatcher, AllToAllDispatcher)
            assert block.ffn.dispatcher.ep == 2
            assert block.ffn.experts.gate_up.shape[0] == 2
            full = ref_state[f"layers.{block.layer_idx}.ffn.experts.gate_up"]
            assert torch.equal(block.ffn.experts.gate_up, full[2 * rank: 2 * rank + 2])
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits_BSV, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_apply_ep_shards_experts_and_keeps_logits():
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)
    torch.manual_seed(0)
    ref = MoETransformer(CFG, opt).eval()
    with torch.no_grad():
        ref_logits = ref(IDS).logits_BSV
    on_gloo_ranks(2, _ep_rank, ref_logits, ref.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "selective", "every_n"])
def test_apply_compile_keeps_names_logits_and_grads(policy):
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)
    torch.manual_seed(0)
    eager = MoETransformer(CFG, opt).train()
    torch.manual_seed(0)
    compiled = apply_compile(apply_ac(MoETransformer(CFG, opt).train(), policy, every_n=2))
    assert list(compiled.state_dict()) == list(eager.state_dict())
    losses = []
    for model in (eager, compiled):
        out = model(IDS)
        loss = F.cross_entropy(out.logits_BSV.flatten(0, 1), IDS.flatten()) + out.aux_loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(IDS).logits_BSV, eager.eval()(IDS).logits_BSV,
                                   rtol=1e-4, atol=1e-5)


def test_optimizer_state_names_match_model_keys_under_checkpointing():
    """Sharded checkpoints key the optimizer state by parameter name (torch.distributed.checkpoint's
    state-dict helpers); the wrapper's child name is one they strip, so a run saved with `full`
    checkpointing resumes under any policy."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = build("full")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, model.model_config.vocab_size, (2, 8))).logits_BSV.sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, [optimizer])
    assert set(optim_sd["state"]) == set(model_sd) == set(build().state_dict())


def test_compile_says_which_checkpointed_blocks_stay_eager():
    """model.compile=true under whole-block checkpointing compiles nothing there: the user is told so."""
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)
    model = apply_ac(MoETransformer(CFG, opt), "every_n", every_n=2)
    with pytest.warns(UserWarning, match=f"compiles nothing in the {len(model.layers) // 2} of "
                                         f"{len(model.layers)} blocks"):
        apply_compile(model)
