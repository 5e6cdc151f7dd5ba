"""Multi-token prediction (model.mtp_layers, moe/model/mtp.py): the loss is the paper's equations computed
from the model's own weights; without depths nothing changes; a DeepSeek-V3 directory with its MTP layer
imports, trains, exports and re-imports tensor for tensor (moe/hf/mtp.py), and transformers loads the export
cleanly; what cannot run it is refused."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moe.config import ModelConfig, MoEOptConfig
from moe.config.size import param_breakdown
from moe.model import MoETransformer

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(mtp_layers: int, **kw) -> MoETransformer:
    """Two layers (a dense first one), MoE depths (is_moe_layer), non-trivial norms everywhere."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, top_k=2, first_k_dense_replace=1, mtp_layers=mtp_layers,
                      mtp_loss_weight=0.3, **kw)
    model = MoETransformer(cfg, MoEOptConfig(capacity_factor=None), init_seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) + 0.5)
    return model


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
LABELS = torch.cat([IDS[:, 1:], torch.full((2, 1), -100)], dim=1)  # as the data module gives them
LABELS[0, 3] = -100  # a masked label inside the sequence


def rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_the_mtp_loss_is_the_papers_equations_on_the_models_own_weights():
    """DeepSeek-V3 section 2.2, written out: h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)], h^k =
    the depth's norm of TRM_k(h'), logits from the shared head, CE against t_{i+k+1} over the positions that
    have one; L_MTP the mean over the D depths (the model weighs it by mtp_loss_weight). Two depths, so the
    second reads the first's output; each depth's block is an MoE layer whose router terms join the loss."""
    model = tiny(2).train()
    out = model(IDS, labels_BS=LABELS)
    eps, (B, S) = model.model_config.rms_norm_eps, IDS.shape
    with torch.no_grad():
        x = model.embed_tokens(IDS)
        for block in model.layers:
            x, _ = block(x)
        h = rms(x, model.norm.weight, eps)  # h^0: the main model's output, as its head reads it
        emb, head = model.embed_tokens.weight, model.lm_head.weight
        want, router = [], []
        for k, depth in enumerate(model.mtp, start=1):
            tokens = [[IDS[b, i + k] if i + k < S else 0 for i in range(S)] for b in range(B)]
            e = emb[torch.tensor(tokens)]
            joined = torch.cat([rms(e, depth.enorm.weight, eps), rms(h, depth.hnorm.weight, eps)], dim=-1)
            y, stats = depth.block(joined @ depth.eh_proj.weight.T)
            router.append(0.01 * stats.aux_loss + 0.001 * stats.z_loss)
            h = rms(y, depth.norm.weight, eps)
            terms = [F.cross_entropy(h[b, i] @ head.T, LABELS[b, i + k])
                     for b in range(B) for i in range(S - k) if LABELS[b, i + k] != -100]
            want.append(torch.stack(terms).mean())
        want = torch.stack(want).mean()
    assert torch.isfinite(out.mtp_loss)
    assert abs(out.mtp_loss.item() - want.item()) <= 1e-6 * want.item()
    assert len(out.routing) == 3  # layer 1, then the two depths' blocks (layers 2 and 3)
    main_router = sum(0.01 * s.aux_loss + 0.001 * s.z_loss for s in out.routing[:1])
    torch.testing.assert_close(out.router_loss, main_router + sum(router), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.loss, out.lm_loss + out.router_loss + 0.3 * out.mtp_loss, rtol=0, atol=0)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())
    with torch.no_grad():  # generation skips the depths
        assert model(IDS, generating=True).mtp_loss is None


def test_without_depths_the_model_its_loss_and_its_counts_are_as_before():
    """model.mtp_layers=0 (every preset's default): no mtp parameter, the loss exactly LM + router terms, the
    main model's values and LM loss bit for bit those of the same model with a depth (values are keyed by
    name), and param_breakdown counts exactly the parameters built."""
    plain, with_mtp = tiny(0), tiny(1)
    assert not any(name.startswith("mtp.") for name in plain.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(with_mtp.state_dict()[name], value), name
    out, out_mtp = plain(IDS, labels_BS=LABELS), with_mtp(IDS, labels_BS=LABELS)
    assert out.mtp_loss is None and torch.equal(out.loss, out.lm_loss + out.router_loss)
    assert torch.equal(out.lm_loss, out_mtp.lm_loss)
    for model in (plain, with_mtp):
        assert param_breakdown(model.model_config).total == sum(p.numel() for p in model.parameters())
    extra = param_breakdown(with_mtp.model_config).total - param_breakdown(plain.model_config).total
    assert extra == sum(p.numel() for p in with_mtp.mtp.parameters())


def test_the_released_deepseek_v3_counts_671b_main_and_its_mtp_layer():
    """conf/model/deepseek_v3.yaml at the released size: 671B in the main model; its MTP layer trains 11.6B
    more (its MoE block, eh_proj, norms: the embedding and head are the main model's), and the released files
    hold 684.5B (shown as 685B), those and the layer's copies of the embedding and head (2 x 0.93B), beside
    FP8 scales."""
    from tests.conftest import compose_cfg

    model = compose_cfg("model=deepseek_v3").model
    main = param_breakdown(ModelConfig(**{**model, "mtp_layers": 0})).total
    full = param_breakdown(ModelConfig(**{**model, "mtp_layers": 1})).total
    copies = 2 * model.vocab_size * model.hidden_size
    assert round(main / 1e9) == 671 and round((full - main) / 1e8) == 116
    assert round((full + copies) / 1e8) == 6845


# -- a DeepSeek-V3 directory with its MTP layer, both ways ------------------------------------------------


V = 300  # the tokenizer below has 290 ids


def deepseek_dir(path, seed=0):
    """transformers' random DeepseekV3ForCausalLM (2 layers, the first dense) saved, plus one MTP layer in the
    files as the released directory keeps its layer 61: model.layers.2.* (an MoE decoder layer, random),
    enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and LM head; config.json declaring
    num_nextn_predict_layers=1."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, kv_lora_rank=12, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=6,
        v_head_dim=10, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, num_nextn_predict_layers=1)
    hf = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.2)
    hf.save_pretrained(path)
    files = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    mtp = {k.replace("layers.1.", "layers.2."): v + 0.1 * torch.randn(v.shape, generator=gen)
           for k, v in files.items() if ".layers.1." in k}
    mtp |= {f"model.layers.2.{n}.weight": torch.rand(32, generator=gen) + 0.5
            for n in ("enorm", "hnorm", "shared_head.norm")}
    mtp["model.layers.2.eh_proj.weight"] = 0.2 * torch.randn(32, 64, generator=gen)
    mtp["model.layers.2.embed_tokens.weight"] = files["model.embed_tokens.weight"].clone()
    mtp["model.layers.2.shared_head.head.weight"] = files["lm_head.weight"].clone()
    save_file(files | mtp, path / "model.safetensors", metadata={"format": "pt"})
    return hf, files | mtp


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from moe.data.tokenizer import save_tokenizer, train_bpe

    out = tmp_path_factory.mktemp("tok")
    tok = train_bpe(["the cat sat on the mat", "one plus two is three"] * 20, 290,
                    ["<|endoftext|>", "<|pad|>"], show_progress=False)
    save_tokenizer(tok, out, eos="<|endoftext|>", pad="<|pad|>")
    return out


def test_a_deepseek_v3_directory_round_trips_with_its_mtp_layer_through_training(tmp_path, tok_dir, capsys):
    """Import: the directory's MTP layer becomes depth 0 (model.mtp_layers=1), every tensor as the files hold
    it, the same whether read whole (infer.py hf_dir=) or tensor by tensor (model.init_from_hf); no note, no
    unexpected-keys report. Trained 5 steps: the MTP loss finite and falling. Exported (infer.py export_hf=):
    num_nextn_predict_layers=1, the MTP layer's tensors under the released names, transformers loads it with
    no warning and its logits are ours; re-imported: every tensor and the loss as trained. Untrained, the
    export holds exactly the directory's tensors."""
    from moe.hf import from_hf, tensor_source
    from moe.hf.families import read_hf_config
    from moe.hf.tensors import SafetensorsDir
    from moe.infer.export import export_hf
    from tests._hf_loading import loads_cleanly, relative_error

    src = tmp_path / "src"
    hf, files = deepseek_dir(src)
    read_hf_config(src, "hf_dir")
    model = from_hf(src)
    assert "note:" not in capsys.readouterr().err
    assert model.model_config.mtp_layers == 1 and model.model_config.num_layers == 2
    sd = model.state_dict()
    for ours, key in (("mtp.0.eh_proj.weight", "eh_proj"), ("mtp.0.enorm.weight", "enorm"),
                      ("mtp.0.norm.weight", "shared_head.norm"),
                      ("mtp.0.block.ffn.router.weight", "mlp.gate")):
        assert torch.equal(sd[ours], files[f"model.layers.2.{key}.weight"]), ours
    with torch.device("meta"):
        lazy = MoETransformer(model.model_config, model.moe_opt)
    lazy.materialize("cpu", tensor_source(src, model.model_config))
    assert all(torch.equal(lazy.state_dict()[name], value) for name, value in sd.items())
    with torch.no_grad():
        assert relative_error(model.eval()(IDS).logits_BSV, hf(IDS).logits) < 1e-5

    untouched = tmp_path / "untouched"
    export_hf(model, untouched, tok_dir)
    written = SafetensorsDir(untouched)
    assert set(written.file_of) == set(files)
    assert all(torch.equal(written.get(key), value) for key, value in files.items())

    model.train()
    ids = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(2))
    batch = dict(input_ids=ids[:, :-1], labels_BS=ids[:, 1:])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mtp_losses = []
    for _ in range(5):
        out = model(batch["input_ids"], labels_BS=batch["labels_BS"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mtp_losses.append(out.mtp_loss.item())
    assert all(map(torch.isfinite, torch.tensor(mtp_losses))) and mtp_losses[-1] < mtp_losses[0]

    out_dir = tmp_path / "export"
    export_hf(model, out_dir, tok_dir)
    assert json.loads((out_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = from_hf(out_dir)
    assert back.model_config.mtp_layers == 1
    assert all(torch.equal(back.state_dict()[name], value) for name, value in model.state_dict().items())
    model.eval(), back.eval()
    with torch.no_grad():
        want = model(batch["input_ids"], labels_BS=batch["labels_BS"])
        got = back(batch["input_ids"], labels_BS=batch["labels_BS"])
        assert torch.equal(got.mtp_loss, want.mtp_loss) and torch.equal(got.lm_loss, want.lm_loss)
        theirs = loads_cleanly(type(hf), out_dir)
        assert relative_error(theirs(IDS).logits, model(IDS).logits_BSV) < 1e-5


def test_init_from_hf_trains_the_depths_the_user_asks_for_up_to_those_the_directory_holds(tmp_path):
    """model.init_from_hf takes the architecture from the directory, model.mtp_layers from the user: more
    depths than the directory holds is refused (one paragraph), fewer reads the directory without the
    others, with a note naming them."""
    from moe.errors import UserError
    from moe.hf.start import hf_start
    from tests.conftest import compose_cfg

    deepseek_dir(tmp_path)
    base = ("model=tiny_deepseek_v3", f"model.init_from_hf={tmp_path}", "moe_opt=deepseek_v3",
            "moe_opt.num_groups=null", "moe_opt.group_top_k=null")
    cfg = compose_cfg(*base, "model.mtp_layers=2")
    with pytest.raises(UserError) as err:
        hf_start(cfg.model, cfg.moe_opt, cfg.data)
    assert "holds 1 multi-token-prediction layer" in str(err.value) and "model.mtp_layers=1" in str(err.value)
    cfg = compose_cfg(*base, "model.mtp_layers=1")
    start = hf_start(cfg.model, cfg.moe_opt, cfg.data)
    assert "mtp_layers" not in start.model and start.note is None
    cfg = compose_cfg(*base)
    note = hf_start(cfg.model, cfg.moe_opt, cfg.data).note
    assert "model.layers.2.*" in note and "model.mtp_layers=1" in note


FSDP2_TWO = ("hardware=cpu_fsdp2", "trainer.devices=2", "hardware.devices_per_node=2")


@pytest.mark.parametrize("overrides, field, value, fix, problem", [
    (("model.mtp_layers=1", "parallel.pp=2", *FSDP2_TWO), "model.mtp_layers", 1, "parallel.pp=1",
     "pipeline parallelism"),
    (("model.mtp_layers=1", "parallel=fsdp2_tp2", "parallel.sequence_parallel=true", *FSDP2_TWO),
     "model.mtp_layers", 1, "parallel.sequence_parallel=false", "sequence parallelism"),
    (("model.mtp_layers=1", "hardware=trn1", "trainer.devices=2", "model.num_kv_heads=4"),
     "model.mtp_layers", 1, "model.mtp_layers=0 on trn1", "no multi-token-prediction module"),
    (("model.mtp_layers=-1",), "model.mtp_layers", -1, "use 0", "must be a whole number"),
    (("model.mtp_layers=1", "model.mtp_loss_weight=-0.1"), "model.mtp_loss_weight", -0.1, "0.1",
     "must not be negative"),
], ids=["pp2", "sequence_parallel", "trn1", "negative_depths", "negative_weight"])
def test_what_cannot_run_multi_token_prediction_is_refused_in_one_paragraph(tmp_path, overrides, field, value,
                                                                             fix, problem):
    from tests.test_bad_inputs import assert_user_error, run_train

    code, err = run_train(tmp_path / "run", *overrides, "dry_run=true")
    assert_user_error(code, err, field, value, fix, problem)
