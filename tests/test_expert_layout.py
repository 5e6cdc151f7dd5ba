"""The routed experts' weight layout is declared once (moe.model.expert_layout): storing [E, in, out] or
[E, out, in] changes nothing a user sees (losses, gradients, HF exports, old checkpoints), and no other
file restates it."""
from __future__ import annotations

import dataclasses
import io
import re
import tokenize

import pytest
import torch
from conftest import REPO

from moe.checkpoint.formats import PORTABLE
from moe.checkpoint.io import atomic_torch_save
from moe.config import ModelConfig, MoEOptConfig
from moe.hf import from_hf, to_hf
from moe.infer.generate import generate
from moe.model import MoETransformer
from moe.model.expert_layout import (
    EXPERT_LAYOUT,
    IN_OUT,
    LAYOUT_KEY,
    OUT_IN,
    kernel_order,
    memory_order,
    storing,
    upgraded_checkpoint,
    upgraded_state,
)
from moe.model.moe import Experts, arrange_for_generation, grouped_mm_works

CFG = ModelConfig(vocab_size=67, hidden_size=32, intermediate_size=20, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=64, top_k=2, num_experts=4, rms_norm_eps=1e-6)
# dropless and renormalised: exportable to Mixtral
OPT = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True)
IDS = torch.randint(0, 67, (2, 11), generator=torch.Generator().manual_seed(0))


def tiny(layout, seed=0) -> MoETransformer:
    torch.manual_seed(seed)
    with storing(layout):
        return MoETransformer(CFG, OPT)


def as_in_out_order(state: dict) -> dict:
    """A state dict of an OUT_IN model in IN_OUT order, to compare the two."""
    return {k: OUT_IN.as_in_out(v) if EXPERT_LAYOUT.is_expert_tensor(k) else v for k, v in state.items()}


def test_models_store_the_layout_they_were_built_under_and_start_from_the_same_values():
    in_out, out_in = tiny(IN_OUT), tiny(OUT_IN)
    experts = out_in.layers[0].ffn.experts
    assert experts.layout == OUT_IN
    assert experts.gate_up.shape == (4, 40, 32) and experts.down.shape == (4, 32, 20)
    assert in_out.layers[0].ffn.experts.gate_up.shape == (4, 32, 40)
    pairs = zip(in_out.state_dict().items(), as_in_out_order(out_in.state_dict()).values(), strict=True)
    for (name, a), b in pairs:
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not (grouped_mm_works(torch.device("cpu"), torch.float32, IN_OUT)
         and grouped_mm_works(torch.device("cpu"), torch.float32, OUT_IN)),
    reason="no fp32 grouped_mm on this CPU build"))]


@pytest.mark.parametrize("grouped_mm", KERNELS, ids=["loop", "grouped_mm"])
def test_loss_and_gradients_do_not_depend_on_the_layout(grouped_mm):
    results = []
    for layout in (IN_OUT, OUT_IN):
        model = tiny(layout).train()
        for m in model.modules():
            if isinstance(m, Experts):
                m.use_grouped_mm = grouped_mm
        loss = model(IDS, labels_BS=IDS).loss
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}, model))
    (loss_a, grads_a, a), (loss_b, grads_b, b) = results
    kernel = "grouped_mm" if grouped_mm else "loop"
    assert {m.kernel for m in b.modules() if isinstance(m, Experts)} == {kernel}
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    for name, grad in as_in_out_order(grads_b).items():
        torch.testing.assert_close(grad, grads_a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_hf_round_trip_gives_the_same_tensors_under_either_layout():
    exports = [to_hf(tiny(layout)).state_dict() for layout in (IN_OUT, OUT_IN)]
    assert exports[0].keys() == exports[1].keys()
    for key, value in exports[0].items():
        torch.testing.assert_close(exports[1][key], value, rtol=0, atol=0, msg=key)
    hf = to_hf(tiny(IN_OUT))
    with storing(OUT_IN):
        back = from_hf(hf)
    assert back.layers[0].ffn.experts.layout == OUT_IN
    in_out = tiny(IN_OUT).state_dict()
    for (name, a), b in zip(in_out.items(), as_in_out_order(back.state_dict()).values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    for key, value in to_hf(back).state_dict().items():
        torch.testing.assert_close(value, exports[0][key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "written-before-the-record"])
def test_an_in_out_checkpoint_loads_into_out_in(tmp_path, recorded):
    """A checkpoint written while [E, in, out] was stored (recorded, or written before the record existed:
    every one of those is [E, in, out]) loads where [E, out, in] is stored, the same logits."""
    in_out = tiny(IN_OUT).eval()
    ckpt = {"state_dict": {f"model.{k}": v for k, v in in_out.state_dict().items()}, "global_step": 3}
    path = tmp_path / "step-3.ckpt"
    if recorded:
        with storing(IN_OUT):
            PORTABLE.write(ckpt, path)
        assert torch.load(path, weights_only=True)[LAYOUT_KEY] == ["expert", "in", "out"]
    else:
        atomic_torch_save(ckpt, path)
    with storing(OUT_IN):
        read = PORTABLE.read(path)
        out_in = tiny(OUT_IN, seed=1).eval()
    assert read[LAYOUT_KEY] == ["expert", "out", "in"]
    out_in.load_state_dict({k.removeprefix("model."): v for k, v in read["state_dict"].items()})
    with torch.no_grad():
        torch.testing.assert_close(out_in(IDS).logits_BSV, in_out(IDS).logits_BSV, rtol=0, atol=1e-6)


def test_a_portable_checkpoints_adam_moments_turn_with_its_experts():
    """Torch's optimizer state is keyed by number: its 3-D moments are the stacked experts' (the only 3-D
    weights), so they turn with them; the step count and 2-D moments stay."""
    w = torch.randn(4, 32, 40)
    ckpt = {"state_dict": {"model.layers.0.ffn.experts.gate_up": w, "model.norm.weight": w[0, 0]},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": w, "exp_avg_sq": w},
                                            1: {"exp_avg": w[0]}}}]}
    with storing(OUT_IN):
        up = upgraded_checkpoint(ckpt)
    moments = up["optimizer_states"][0]["state"]
    torch.testing.assert_close(moments[0]["exp_avg"], OUT_IN.from_in_out(w), rtol=0, atol=0)
    assert moments[0]["exp_avg_sq"].shape == (4, 40, 32) and moments[0]["step"].item() == 3.0
    assert moments[1]["exp_avg"].shape == (32, 40)


def test_upgrading_turns_expert_tensors_and_their_moments_only():
    w, moments = torch.randn(4, 32, 40), "optim.state.layers.0.ffn.experts.gate_up."
    state = {moments + "exp_avg": w, "model.layers.0.ffn.experts.gate_up": w,
             moments + "step": torch.tensor(3.0), "model.norm.weight": w[0, 0]}
    with storing(OUT_IN):
        up = upgraded_state(state, IN_OUT, lambda k: k if k.startswith("model.") else k.rsplit(".", 1)[0])
    assert up["model.layers.0.ffn.experts.gate_up"].shape == (4, 40, 32)
    torch.testing.assert_close(up[moments + "exp_avg"], OUT_IN.from_in_out(w), rtol=0, atol=0)
    assert up[moments + "step"] is state[moments + "step"]
    assert up["model.norm.weight"] is state["model.norm.weight"]
    with storing(IN_OUT):
        assert upgraded_state(state, IN_OUT) is state  # the stored layout already


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generation_arranges_the_experts_once_and_changes_no_token_nor_checkpoint(dtype):
    """On the CPU the experts run from [E, out, in] memory while generating (kernel_order): a model stored
    [E, in, out] is arranged so, one copy per model, and its tokens, logits and state dict (shapes and
    values) stay the stored layout's; the default ([E, out, in]) is not copied. (Widths of 16-byte
    multiples both ways, as torch._grouped_mm wants its strides.)"""
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, intermediate_size=24)
    default = MoETransformer(cfg, OPT).to(dtype).eval()
    weights = default.layers[0].ffn.experts.gate_up.data_ptr()
    arrange_for_generation(default)
    assert default.layers[0].ffn.experts.gate_up.data_ptr() == weights
    with storing(IN_OUT):
        model = MoETransformer(cfg, OPT).to(dtype).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = generate(model, IDS, max_new_tokens=6, arrange_experts=False).tokens
    experts = model.layers[0].ffn.experts
    layout = experts.layout
    assert memory_order(experts.gate_up, layout) == layout
    with torch.no_grad():
        logits = model(IDS).logits_BSV
    assert generate(model, IDS, max_new_tokens=6).tokens == plain
    want = kernel_order(torch.device("cpu"), dtype)
    assert want == OUT_IN
    assert memory_order(experts.gate_up, layout) == want and memory_order(experts.down, layout) == want
    weights = experts.gate_up.data_ptr()
    arrange_for_generation(model)  # already arranged: no copy
    assert experts.gate_up.data_ptr() == weights
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits_BSV, logits, rtol=0, atol=0)
    after = model.state_dict()
    for key, value in before.items():
        assert after[key].shape == value.shape
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)


# our expert tensors' names spelt out, and dims turned or cut on a line that is about experts
NAME = re.compile(r"experts\.(gate_up|down)\b")
TURN = re.compile(r"(gate_up|down|expert).*(\.transpose\(|\.permute\(|\.mT\b|\.T\b|\.chunk\(2, dim=)")
ALLOWED = {"moe/model/expert_layout.py"}


def test_no_other_file_restates_the_layout():
    found = []
    for path in sorted((REPO / "moe").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED:
            continue
        text = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING and NAME.search(tok.string):
                found.append(f"{rel}:{tok.start[0]}: names {NAME.search(tok.string).group(0)}")
        lines = enumerate(text.splitlines(), 1)
        found += [f"{rel}:{i}: {line.strip()}" for i, line in lines if TURN.search(line)]
    assert found == []
