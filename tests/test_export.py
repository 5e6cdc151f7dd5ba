"""Mixtral directories: export ours -> transformers loads it offline with the same logits and greedy tokens;
a transformers-saved directory -> ours generates what transformers.generate does; refusals and bad inputs."""
import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

from moe.config import ModelConfig, MoEOptConfig, TrainConfig
from moe.data.tokenizer import chat_template_jinja, save_tokenizer, train_bpe
from moe.errors import ConfigError, UserError
from moe.hf import tensor_source
from moe.hf.start import hf_start
from moe.infer.command import chat_prefix
from moe.infer.export import export_hf
from moe.infer.generate import generate, left_pad
from moe.infer.load import model_from_hf_dir
from moe.model import MoETransformer

V = 300  # tokenizer below has 290 ids; the model keeps 10 spare rows as trained models may
TEMPLATE = "<|user|>\n{prompt}\n<|assistant|>\n{completion}"
PROMPTS = [[5, 9, 3, 7, 11, 2, 8, 40, 41], [4, 1, 77], [12, 30, 6, 6, 200]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE with EOS/PAD and the chat markers, as data_prep writes one."""
    out = tmp_path_factory.mktemp("tok")
    texts = ["the cat sat on the mat", "one plus two is three", "hello world"] * 20
    specials = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"]
    tok = train_bpe(texts, 290, specials, show_progress=False)
    save_tokenizer(tok, out, eos="<|endoftext|>", pad="<|pad|>")
    return out


def ours(seed=0, opt=None, **kw) -> MoETransformer:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                num_experts=4, top_k=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = MoETransformer(ModelConfig(**(base | kw)), opt or MoEOptConfig(capacity_factor=1.25)).eval()
    with torch.no_grad():  # non-trivial norms so they are checked too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_greedy(hf, ids_BS, mask_BS, n):
    out = hf.generate(input_ids=ids_BS, attention_mask=mask_BS, max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, ids_BS.shape[1]:].tolist()


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=4, num_kv_heads=1), dict(tie_word_embeddings=True,
                                rope_theta=1e4, top_k=3, head_dim=16)])
def test_exported_dir_loads_offline_with_equal_logits_and_greedy_tokens(tmp_path, tok_dir, kw):
    model = ours(**kw)
    out = export_hf(model, tmp_path / "hf", tok_dir, chat_template=TEMPLATE)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir renamed away
    hf = MixtralForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits_BSV, rtol=0, atol=1e-4)
    ids_BS, mask_BS = left_pad(PROMPTS, pad_token_id=0)
    n = 10  # past the sliding window of 4
    assert generate(model, ids_BS, mask_BS, max_new_tokens=n).tokens == hf_greedy(hf, ids_BS, mask_BS, n)


def test_exported_tokenizer_and_chat_template(tmp_path, tok_dir):
    out = export_hf(ours(), tmp_path / "hf", tok_dir, chat_template=TEMPLATE)
    tok, src = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tok_dir)
    text = "<|user|>\nthe cat\n<|assistant|>\n"
    assert tok(text)["input_ids"] == src(text)["input_ids"] and tok.eos_token == "<|endoftext|>"
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == tok.eos_token_id and gen_cfg["pad_token_id"] == tok.pad_token_id
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    # same text training renders (moe.data.text_formats): system joins the first prompt, turns joined by "\n"
    assert rendered == chat_prefix("be brief\nhi", TEMPLATE) + "hello" + "\n" + chat_prefix("bye", TEMPLATE)
    assert chat_template_jinja("Q: {prompt} A: {completion}<|endoftext|>")  # renders any template


@pytest.mark.parametrize("kw,opt,field", [
    (dict(position_encoding="alibi"), {}, "model.position_encoding"),
    (dict(moe_layer_frequency=2), {}, "model.moe_layer_frequency"),
    (dict(shared_expert_intermediate_size=16), {}, "model.shared_expert_intermediate_size"),
    (dict(top_k=1), {}, "moe_opt.normalize_top_k"),  # Switch top-1: raw probability
])
def test_export_refuses_what_mixtral_cannot_express_and_writes_nothing(tmp_path, tok_dir, kw, opt, field):
    with pytest.raises(ConfigError) as err:
        export_hf(ours(opt=MoEOptConfig(**opt), **kw), tmp_path / "hf", tok_dir)
    assert err.value.field == field and "Fix:" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_export_replaces_only_its_own_export_and_never_a_users_dir(tmp_path, tok_dir):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    for overwrite in (False, True):  # the user's directory: refused either way, nothing removed
        with pytest.raises(UserError, match="pick a new path"):
            export_hf(ours(), tmp_path / "hf", tok_dir, overwrite=overwrite)
        assert (tmp_path / "hf" / "keep.txt").read_text() == "x"
    export_hf(ours(), tmp_path / "mine", tok_dir)
    with pytest.raises(UserError, match="overwrite=true to replace"):
        export_hf(ours(), tmp_path / "mine", tok_dir)
    (tmp_path / "mine" / "stale.txt").write_text("from the first export")
    export_hf(ours(), tmp_path / "mine", tok_dir, overwrite=True)  # its own export: replaced whole
    assert not (tmp_path / "mine" / "stale.txt").exists() and (tmp_path / "mine" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]


def test_export_refuses_a_tokenizer_larger_than_the_model(tmp_path, tok_dir):
    with pytest.raises(UserError, match="has 290 tokens but the model's vocab_size is 200"):
        export_hf(ours(vocab_size=200), tmp_path / "hf", tok_dir)


def transformers_dir(path, tok_dir, window=None, seed=0):
    """A Mixtral directory as transformers itself saves one (legacy per-expert keys on disk)."""
    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=20, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                           rms_norm_eps=1e-6,
                           rope_theta=1e4)  # both transformers 4.x and 5 accept rope_theta
    hf = MixtralForCausalLM(config).eval()
    hf.save_pretrained(path)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(path)
    return hf


@pytest.mark.parametrize("window", [None, 3])
def test_transformers_saved_dir_imports_and_generates_like_transformers(tmp_path, tok_dir, window):
    hf = transformers_dir(tmp_path / "mix", tok_dir, window)
    model = model_from_hf_dir(tmp_path / "mix")
    assert model.model_config.sliding_window == window and model.moe_opt.capacity_factor is None
    ids_BS, mask_BS = left_pad(PROMPTS, pad_token_id=0)
    n = 12
    assert generate(model, ids_BS, mask_BS, max_new_tokens=n).tokens == hf_greedy(hf, ids_BS, mask_BS, n)


def test_bad_hf_dirs_are_clear_errors(tmp_path, tok_dir):
    with pytest.raises(UserError, match="has no config.json"):
        model_from_hf_dir(tmp_path)
    transformers_dir(tmp_path / "mix", tok_dir)
    config = json.loads((tmp_path / "mix" / "config.json").read_text())
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(UserError, match="model_type='llama', not mixtral"):
        model_from_hf_dir(tmp_path / "llama")
    (tmp_path / "mix" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no model.safetensors"):
        model_from_hf_dir(tmp_path / "mix")


def train_cfg(**data):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.run_name = "ft"
    for k, v in data.items():
        cfg.data[k] = v
    return cfg


def test_init_from_hf_takes_the_architecture_and_weights_from_the_dir(tmp_path, tok_dir):
    hf = transformers_dir(tmp_path / "mix", tok_dir, window=5)
    cfg = train_cfg(tokenizer=None)
    cfg.model.init_from_hf, cfg.model.name, cfg.model.compile = str(tmp_path / "mix"), "mine", True
    start = hf_start(cfg.model, cfg.moe_opt, cfg.data)  # values: the config as composed stays as it is
    m = OmegaConf.merge(cfg.model, start.model)
    got = (m.hidden_size, m.num_layers, m.intermediate_size, m.sliding_window, m.vocab_size, m.rope_theta)
    assert got == (32, 2, 20, 5, V, 1e4) and cfg.model.hidden_size != 32
    assert m.name == "mine" and m.compile is True  # the user's own fields stay
    assert start.data == {"tokenizer": str(tmp_path / "mix")}  # unset data tokenizer -> the model's own
    assert start.note.startswith("model.init_from_hf: tokenizing data with")
    cfg.model = m
    with torch.device("meta"):  # as training builds it: each tensor read from the files as it is filled
        model = MoETransformer(cfg.model, MoEOptConfig(capacity_factor=None, eval_capacity_factor=None))
    model.materialize("cpu", tensor_source(cfg.model.init_from_hf, cfg.model))
    model.eval()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits_BSV, hf(ids).logits, rtol=0, atol=1e-4)


def test_init_from_hf_refuses_a_data_tokenizer_with_other_ids(tmp_path, tok_dir):
    transformers_dir(tmp_path / "mix", tok_dir)
    other = tmp_path / "other_tok"
    specials = ["<|endoftext|>", "<|pad|>"]
    save_tokenizer(train_bpe(["zebra quilt xylophone"] * 30, 280, specials, show_progress=False), other,
                   eos="<|endoftext|>", pad="<|pad|>")
    cfg = train_cfg(tokenizer=str(other))
    cfg.model.init_from_hf = str(tmp_path / "mix")
    with pytest.raises(UserError, match=r"data.tokenizer=.* ids that differ .*Fix: set data.tokenizer="):
        hf_start(cfg.model, cfg.moe_opt, cfg.data)
    same = train_cfg(tokenizer=str(tok_dir), format="chat")  # same ids: accepted as is
    same.model.init_from_hf = str(tmp_path / "mix")
    assert hf_start(same.model, same.moe_opt, same.data).data == {}  # data.tokenizer stays
    bad = train_cfg()
    bad.model.init_from_hf = str(tmp_path / "nowhere")
    with pytest.raises(UserError, match="model.init_from_hf=.* has no config.json"):
        hf_start(bad.model, bad.moe_opt, bad.data)
    config = json.loads((tmp_path / "mix" / "config.json").read_text())
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}  # a scaling we do not compute
    bad.model.init_from_hf = str(tmp_path / "mix")
    for key in ("rope_parameters", "rope_scaling"):  # as transformers 5 / 4.x write it
        (tmp_path / "mix" / "config.json").write_text(json.dumps(config | {key: dynamic}))
        with pytest.raises(UserError, match="model.init_from_hf=.*rope_type"):
            hf_start(bad.model, bad.moe_opt, bad.data)
