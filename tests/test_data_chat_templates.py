"""`chat_template: tokenizer`: chat rows rendered with the tokenizer's own Jinja template (Qwen2.5, Llama 3.1
and Mistral templates in tests/chat_templates/, on tiny byte-level BPE tokenizers built here with each
family's special tokens and the Qwen2/Llama 3 pre-tokenizer split). The loss masks equal a hand-written
reference, turn by turn; a template whose earlier turns change with what follows (Qwen3's) is refused."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_entry
from omegaconf import OmegaConf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from moe.config.schema import DataConfig
from moe.data import MoEDataModule, load_prepared, prepare
from moe.errors import UserError
from moe.model.expert_layout import recorded

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
# Qwen2's pre-tokenizer split (Llama 3's differs only in \p{N}{1,3}): "\n\n" stays one piece before a word
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
FAMILIES = {  # template file, special tokens, added (not special) tokens, tokenizer_config.json's tokens
    "qwen2_5": ("qwen2_5.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
                {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3_1": ("llama3_1.jinja", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], [],
                 {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "mistral": ("mistral.jinja", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], [],
                {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "qwen3": ("qwen3.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [],
              {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "required": ["city"],
                                                        "properties": {"city": {"type": "string"}}}}}
CHAT = {"messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Capital of France?"},
                     {"role": "assistant", "content": "Paris."},
                     {"role": "user", "content": "And of Italy?"},
                     {"role": "assistant", "content": "Rome."}]}
TOOL_CHAT = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "tool_calls": [
                              {"type": "function",
                               "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                          {"role": "tool", "content": "sunny"},
                          {"role": "assistant", "content": "It is sunny."}],
             "tools": json.dumps([TOOL])}

# Hand-written: each row as (text, trained) runs, in order, covering every token of the row.
LLAMA_SYSTEM = "<|start_header_id|>system<|end_header_id|>\n\n"
LLAMA_DATE = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
USER = "<|start_header_id|>user<|end_header_id|>\n\n"
ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"
TOOL_JSON = json.dumps(TOOL, indent=4)
REFERENCE = {
    "qwen2_5": [
        [("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
          "<|im_start|>assistant\n", 0), ("Paris.<|im_end|>", 1),
         ("\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n", 0), ("Rome.<|im_end|>", 1),
         ("\n", 0)],  # the template's newline after <|im_end|> (the EOS): not generated, no EOS appended
        [("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
          "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
          "with function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(TOOL)
          + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
          "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
          "\"arguments\": <args-json-object>}\n</tool_call>"
          "<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", 0),
         ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>', 1),
         ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
          "<|im_start|>assistant\n", 0),
         ("It is sunny.<|im_end|>", 1), ("\n", 0)]],
    "llama3_1": [
        [("<|begin_of_text|>" + LLAMA_SYSTEM + LLAMA_DATE + "You are terse.<|eot_id|>" + USER
          + "Capital of France?<|eot_id|>" + ASSISTANT, 0), ("Paris.<|eot_id|>", 1),
         (USER + "And of Italy?<|eot_id|>" + ASSISTANT, 0), ("Rome.<|eot_id|>", 1)],
        [("<|begin_of_text|>" + LLAMA_SYSTEM + "Environment: ipython\n" + LLAMA_DATE + "<|eot_id|>" + USER
          + "Given the following functions, please respond with a JSON for a function call with its proper "
          "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
          "\"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n" + TOOL_JSON
          + "\n\nWeather in Paris?<|eot_id|>" + ASSISTANT, 0),
         ('{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', 1),
         ('<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' + ASSISTANT, 0),
         ("It is sunny.<|eot_id|>", 1)]],
    "mistral": [  # no tool role: the template refuses the tool row (a bad row, skipped here)
        [("<s> [INST] You are terse.\n\nCapital of France? [/INST]", 0), (" Paris.</s>", 1),
         (" [INST] And of Italy? [/INST]", 0), (" Rome.</s>", 1)]],
}


def make_tokenizer(root: Path, family: str) -> Path:
    """A byte-level BPE with `family`'s special tokens and its real template in tokenizer_config.json."""
    template, specials, added, tokens = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    texts = [m.get("content") or "" for row in (CHAT, TOOL_CHAT) for m in row["messages"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(added)
    out = root / family
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **{k: v for k, v in tokens.items() if v}, "chat_template": (TEMPLATES / template).read_text()}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def runs(ids: np.ndarray, mask: np.ndarray, tok: Tokenizer) -> list[tuple[str, int]]:
    """A row's tokens as (decoded text, trained) runs."""
    cuts = [0, *np.flatnonzero(np.diff(mask.astype(int))) + 1, len(ids)]
    return [(tok.decode([int(t) for t in ids[a:b]], skip_special_tokens=False), int(mask[a]))
            for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prep_rows(tmp_path: Path, tok_dir: Path, rows: list[dict], **cfg) -> Path:
    cfg = {"input": write_rows(tmp_path / "chat.jsonl", rows), "output": str(tmp_path / "out"),
           "format": "chat", "chat_template": "tokenizer", "assistant_only_loss": True,
           "tokenizer": str(tok_dir),
           "packing": "pad", "seq_len": 1024, "val_fraction": 0.0, **cfg}
    return prepare(cfg, progress=False)


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_1", "mistral"])
def test_loss_masks_equal_the_hand_written_reference(tmp_path, family):
    tok_dir = make_tokenizer(tmp_path, family)
    out = prep_rows(tmp_path, tok_dir, [CHAT, TOOL_CHAT], on_bad_row="skip")
    meta = json.loads((out / "meta.json").read_text())
    train = load_prepared(out).splits["train"]
    ids, mask = train.get(np.arange(len(train)))
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    pad_id = meta["tokenizer"]["pad_id"]
    # pad packing: each row, then padding (pad ids, untrained)
    lengths = [len(row) - next(i for i, (t, m) in enumerate(zip(row[::-1], m_[::-1], strict=True))
                               if t != pad_id or m) for row, m_ in zip(ids, mask, strict=True)]
    assert sum(lengths) == meta["splits"]["train"]["tokens_in"]
    got = [runs(row[:n], m[:n], tok) for row, m, n in zip(ids, mask, lengths, strict=True)]
    assert got == REFERENCE[family]
    assert meta["rows"]["skipped"] == ({"template_error": 1} if family == "mistral" else {})
    saved = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == (TEMPLATES / FAMILIES[family][0]).read_text()  # inference renders alike
    assert saved.get("bos_token") == FAMILIES[family][3]["bos_token"]



def test_eos_is_appended_untrained_when_the_template_ends_turns_with_another_token(tmp_path):
    """A base tokenizer's EOS (<|endoftext|>) is not Qwen's end of turn: it separates rows, untrained."""
    out = prep_rows(tmp_path, make_tokenizer(tmp_path, "qwen2_5"), [CHAT], eos_token="<|endoftext|>")
    ids, mask = load_prepared(out).splits["train"].get(np.arange(1))
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    n = json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens_in"]
    assert runs(ids[0, :n], mask[0, :n], tok)[-2:] == [("Rome.<|im_end|>", 1), ("\n<|endoftext|>", 0)]


def test_online_mode_takes_the_same_key_and_gives_data_preps_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    tok_dir = make_tokenizer(tmp_path, "llama3_1")
    rows = [CHAT, TOOL_CHAT] * 3
    offline = prep_rows(tmp_path, tok_dir, rows, packing="concat", seq_len=64, val_fraction=0.0)
    cfg = DataConfig(kind="online", path=str(tmp_path / "chat.jsonl"), format="chat", tokenizer=str(tok_dir),
                     chat_template="tokenizer", assistant_only_loss=True, seq_len=64, val_fraction=0.0)
    dm = MoEDataModule(cfg, 2, 1, 4, 1234, 1)
    dm.setup("fit")
    want = load_prepared(offline).splits["train"]
    got = dm.prepared.splits["train"]
    assert len(got) == len(want) > 0
    for a, b in zip(got.get(np.arange(len(got))), want.get(np.arange(len(want))), strict=True):
        assert np.array_equal(a, b)
    # the template is part of the cache key: another template is another cache
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("Today Date", "Date")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert MoEDataModule(cfg, 2, 1, 4, 1234, 1).dir != dm.dir


def test_infer_prompts_a_model_as_training_rendered_its_first_turn(tmp_path):
    import torch
    from test_infer import icfg, tiny_model

    from moe.config import TrainConfig
    from moe.infer.command import run

    tok_dir = make_tokenizer(tmp_path, "llama3_1")
    row = {"messages": [{"role": "user", "content": "Capital of France?"},
                        {"role": "assistant", "content": "Paris."}]}
    out = prep_rows(tmp_path, tok_dir, [row], seq_len=200)
    ids, mask = load_prepared(out).splits["train"].get(np.arange(1))
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    untrained = tok.decode([int(t) for t in ids[0, :int(np.argmax(mask[0]))]], skip_special_tokens=False)
    model, cfg = tiny_model(vocab_size=320, max_position_embeddings=256), OmegaConf.structured(TrainConfig)
    cfg.model, cfg.moe_opt = OmegaConf.structured(model.model_config), OmegaConf.structured(model.moe_opt)
    cfg.data.merge_with({"kind": "prepared", "path": str(out), "format": "chat",
                         "chat_template": "tokenizer"})
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"  # as train.py writes one (test_infer.save_ckpt)
    ckpt.parent.mkdir(parents=True)
    torch.save(recorded({"epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6",
                         "state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                         "hyper_parameters": {"cfg": OmegaConf.to_container(cfg, resolve=True)}}), ckpt)
    result = run(icfg(ckpt=str(ckpt), prompt="Capital of France?", chat=True, max_new_tokens=1))
    assert result[0]["prompt"] == untrained == ("<|begin_of_text|>" + LLAMA_SYSTEM + LLAMA_DATE + "<|eot_id|>"
                                                 + USER + "Capital of France?<|eot_id|>" + ASSISTANT)
    assert result[0]["prompt_tokens"] == int(np.argmax(mask[0]))  # the same token ids, no BOS added


def test_sample_chat_preset_is_unchanged(tmp_path, monkeypatch):
    """The {prompt}/{completion} template's prepared data: the digest of the blocks, masks, tokenizer files
    and meta.json's counts and config, as prepared before the tokenizer's template existed."""
    monkeypatch.chdir(REPO)
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "data_prep" / "data" / "sample_chat.yaml"))
    out = prepare({**cfg, "output": str(tmp_path / "sample_chat")}, progress=False)
    h = hashlib.sha256()
    for split in ("train", "validation"):
        data = load_prepared(out).splits[split]
        for array in data.get(np.arange(len(data))):
            h.update(array.tobytes())
    for file in sorted((out / "tokenizer").iterdir()):
        h.update(file.name.encode() + file.read_bytes())
    meta = json.loads((out / "meta.json").read_text())
    h.update(json.dumps({k: meta[k] for k in ("tokens", "splits", "rows", "tokenizer", "config", "columns")},
                        sort_keys=True).encode())
    assert h.hexdigest() == "d4b4d6df310e9da7b0de418615910956b4c9ae69ae5bd3526b6bdf1d6d98ce9d"


def test_a_template_whose_turns_are_not_prefixes_is_one_paragraph_exit_2_and_no_output(tmp_path):
    """Qwen3's template renders the last assistant turn with an empty <think> block, so a two-turn
    conversation's first turn renders differently alone than inside the whole: its mask cannot be found."""
    tok_dir = make_tokenizer(tmp_path, "qwen3")
    src = write_rows(tmp_path / "chat.jsonl", [CHAT])
    proc = run_entry("data_prep.py", f"input={src}", f"output={tmp_path / 'out'}", "format=chat",
                     "chat_template=tokenizer", f"tokenizer={tok_dir}", "assistant_only_loss=true",
                     "seq_len=16", here=True)  # the command line's paragraph and exit code, in this process
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr[proc.stderr.find("error: "):]  # after datasets' progress lines
    assert error.startswith("error: chat_template='tokenizer' renders 1 row(s)")
    assert "Fix: use a template" in error
    assert "Traceback" not in proc.stderr and len(error.strip().splitlines()) == 1
    assert "assistant turn 1: the messages up to its end, render as '<think>" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "qwen3"]  # no output, no temp dir


def test_a_tokenizer_without_a_template_is_refused_before_reading_the_input(tmp_path):
    tok_dir = make_tokenizer(tmp_path, "qwen2_5")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        prep_rows(tmp_path, tok_dir, [CHAT])
    assert (err.value.field, err.value.value) == ("chat_template", "tokenizer")
    assert "has none" in err.value.problem and "tokenizer_config.json" in err.value.fix
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    with pytest.raises(UserError) as err:  # a trained BPE has no template either
        prep_rows(tmp_path, tok_dir, [CHAT], tokenizer=None, vocab_size=300)
    assert err.value.field == "chat_template" and "vocab_size=300" in err.value.problem


def test_rows_the_template_cannot_render_are_bad_rows_named_with_the_templates_reason(tmp_path):
    tok_dir = make_tokenizer(tmp_path, "mistral")
    no_reply = {"messages": CHAT["messages"][:2]}
    with pytest.raises(UserError) as err:
        prep_rows(tmp_path, tok_dir, [CHAT, TOOL_CHAT, no_reply])
    assert err.value.field == "input" and "row 1" in err.value.problem
    assert "template_error: the template refused it ('dict object' has no attribute 'content')" \
        in err.value.problem  # the tool call has no content, which Mistral's template writes
    out = prep_rows(tmp_path, tok_dir, [CHAT, TOOL_CHAT, no_reply], on_bad_row="skip")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["rows"]["skipped"] == {"no_assistant_reply": 1, "template_error": 1}


def test_streaming_renders_with_the_tokenizers_template_as_data_prep_does(tmp_path, monkeypatch):
    """data.streaming=true with chat_template=tokenizer: its blocks and masks are data_prep's, and the
    tokenizer it keeps carries the template (inference renders as training did)."""
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    tok_dir = make_tokenizer(tmp_path, "llama3_1")
    rows = [CHAT, TOOL_CHAT] * 3
    want = load_prepared(prep_rows(tmp_path, tok_dir, rows, packing="concat", seq_len=64)).splits["train"]
    cfg = DataConfig(kind="online", path=str(tmp_path / "chat.jsonl"), format="chat", tokenizer=str(tok_dir),
                     chat_template="tokenizer", assistant_only_loss=True, seq_len=64, streaming=True,
                     shuffle=False, streaming_val_blocks=0)
    dm = MoEDataModule(cfg, 1, 1, len(want), 1234, 0, dp_rank=0, dp_size=1)
    dm.setup("fit")
    ids, mask = want.get(np.arange(len(want)))
    labels = np.where(mask[:, 1:] == 0, -100, ids[:, 1:])
    got = list(dm.train_dataloader())
    assert np.array_equal(np.concatenate([b["labels"].numpy() for b in got]), labels)
    assert np.array_equal(np.concatenate([b["input_ids"].numpy() for b in got]), ids[:, :-1])
    saved = json.loads((dm.tokenizer_dir / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == (TEMPLATES / FAMILIES["llama3_1"][0]).read_text()
