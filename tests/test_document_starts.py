"""data.document_mask on rows rendered by the tokenizer's own chat template (Llama 3.1's, which closes every
turn with its EOS, <|eot_id|>): data_prep records where each row starts (the `doc_starts` column), online
and streaming packing give the same starts, a conversation packed beside another gets what it gets alone,
and dirs without the column are read from their EOS tokens or refused."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from test_data_chat_templates import CHAT, make_tokenizer, prep_rows, write_rows
from test_documents import DROPLESS

from moe.config import DataConfig, ModelConfig
from moe.config.schema import DataSource
from moe.data import MoEDataModule, load_prepared, prepare
from moe.data.datamodule import online_prep_config
from moe.data.packing import starts_after_eos
from moe.data.streaming import BlockSource
from moe.errors import UserError
from moe.model import MoETransformer
from moe.model.documents import Documents

SHORT = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "It is sunny."}]}
BOS = "<|begin_of_text|>"  # the Llama 3.1 template's first token of every conversation, and only there


def data_module(cfg: DataConfig) -> MoEDataModule:
    dm = MoEDataModule(cfg, micro_batch_size=1, accumulate_grad_batches=1, max_steps=1, seed=0,
                       limit_val_batches=1)
    dm.setup("fit")
    return dm


def prepared_cfg(path, **kw) -> DataConfig:
    settings = {"kind": "prepared", "path": str(path), "document_mask": True, "shuffle": False}
    return DataConfig(**(settings | kw))


@pytest.fixture
def llama(tmp_path):
    return make_tokenizer(tmp_path, "llama3_1")


def one_block_of_two(tmp_path, tok_dir):
    """The block [CHAT | SHORT] exactly (seq_len + 1 = both conversations' tokens), every token trained."""
    (tmp_path / "count").mkdir()
    kw = dict(packing="concat", assistant_only_loss=False)
    counted = prep_rows(tmp_path / "count", tok_dir, [CHAT, SHORT], seq_len=8, **kw)
    tokens = json.loads((counted / "meta.json").read_text())["splits"]["train"]["tokens_in"]
    return prep_rows(tmp_path, tok_dir, [CHAT, SHORT], seq_len=tokens - 1, **kw)


def bos_id(out) -> int:
    added = json.loads((out / "tokenizer" / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in added if t["content"] == BOS)


def test_two_template_conversations_in_one_block_are_two_documents(tmp_path, llama):
    """Every turn of CHAT ends in the EOS, yet the block holds two documents: CHAT's tokens are document 0,
    SHORT's (from its <|begin_of_text|>) document 1, and only the label that is SHORT's first token is
    hidden (not the labels after CHAT's inner EOS tokens); the tiny model's logits and loss on the block
    equal each conversation's run alone (fp32, 1e-6)."""
    out = one_block_of_two(tmp_path, llama)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["columns"] == ["input_ids", "doc_starts"]
    dm = data_module(prepared_cfg(out))
    batch = next(iter(dm.train_dataloader()))
    ids, labels = batch["input_ids"], batch["labels"]
    eos = meta["tokenizer"]["eos_id"]
    n_a = int(torch.nonzero(ids[0] == bos_id(out))[1])  # SHORT starts at the second <|begin_of_text|>
    assert int((ids[0, :n_a] == eos).sum()) == 5  # each of CHAT's five turns ends in the EOS
    assert batch["document_ids"][0].tolist() == [0] * n_a + [1] * (ids.shape[1] - n_a)
    plain = data_module(prepared_cfg(out, document_mask=False))
    unmasked = next(iter(plain.train_dataloader()))["labels"]
    assert (unmasked != -100).all()
    assert torch.nonzero(labels[0] == -100)[:, 0].tolist() == [n_a - 1]  # the label that is SHORT's BOS
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=24, num_layers=2,
                                       num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                                       max_position_embeddings=256), DROPLESS).eval()
    docs = Documents(batch["document_ids"], use_flex=False)
    with torch.no_grad():
        alone = torch.cat([model(ids[:, :n_a]).logits_BSV, model(ids[:, n_a:]).logits_BSV], dim=1)
        torch.testing.assert_close(model(ids, documents=docs).logits_BSV, alone, rtol=0, atol=1e-6)
        loss_a = model(ids[:, :n_a], labels_BS=labels[:, :n_a]).lm_loss * (n_a - 1)
        loss_b = model(ids[:, n_a:], labels_BS=labels[:, n_a:]).lm_loss * (ids.shape[1] - n_a)
        packed = model(ids, labels_BS=labels, documents=docs).lm_loss
        plain = model(ids).logits_BSV  # without the mask SHORT's tokens see CHAT's: the mask makes them equal
    assert (plain[:, n_a:] - alone[:, n_a:]).abs().max() > 1e-3
    torch.testing.assert_close(packed, (loss_a + loss_b) / (ids.shape[1] - 1), rtol=0, atol=1e-6)


def test_offline_online_and_streaming_record_the_same_starts(tmp_path, llama, monkeypatch):
    """Across block boundaries: each conversation starts at its <|begin_of_text|> (and nowhere else),
    offline, online and streaming alike; the EOS tokens would have cut many more documents."""
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    rows = [CHAT, SHORT] * 3
    offline = load_prepared(prep_rows(tmp_path, llama, rows, packing="concat", seq_len=64)).splits["train"]
    index = np.arange(len(offline))
    ids, _ = offline.get(index)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    starts = offline.document_starts(index, ids, meta["tokenizer"]["eos_id"])
    assert np.array_equal(starts, ids == bos_id(tmp_path / "out"))
    assert starts.sum() == 6 < starts_after_eos(ids, meta["tokenizer"]["eos_id"])[:, 1:].sum()
    cfg = DataConfig(kind="online", path=str(tmp_path / "chat.jsonl"), format="chat", tokenizer=str(llama),
                     chat_template="tokenizer", assistant_only_loss=True, seq_len=64, val_fraction=0.0,
                     document_mask=True)
    online = data_module(cfg).prepared.splits["train"]
    assert np.array_equal(online.document_starts(index, online.get(index)[0], 0), starts)
    streamed = list(BlockSource(online_prep_config(cfg)).blocks())
    assert np.array_equal(np.concatenate([s for _, _, s in streamed]), starts)
    assert np.array_equal(np.concatenate([b for b, _, _ in streamed]), ids)


def test_a_mixture_reads_each_source_as_it_was_written(tmp_path, llama):
    """data.sources: a template source's documents from its recorded starts, a plain-text source's (no
    doc_starts column, as every dir written before) from its EOS tokens."""
    (tmp_path / "chat").mkdir()
    chat = prep_rows(tmp_path / "chat", llama, [CHAT, SHORT] * 2, packing="concat", seq_len=32)
    text = prepare({"input": write_rows(tmp_path / "t.jsonl", [{"text": "Rome is sunny. Paris is not."}] * 8),
                    "output": str(tmp_path / "text"), "tokenizer": str(llama), "eos_token": "<|eot_id|>",
                    "seq_len": 32, "val_fraction": 0.0}, progress=False)
    assert "doc_starts" not in json.loads((text / "meta.json").read_text())["columns"]
    cfg = prepared_cfg(None, sources=[DataSource(path=str(chat), weight=1.0), DataSource(path=str(text),
                                                                                        weight=1.0)])
    dm = data_module(cfg)
    train = dm.prepared.splits["train"]
    index = np.arange(len(train))
    ids, _ = train.get(index)
    eos = dm.meta["tokenizer"]["eos_id"]
    want = np.concatenate([load_prepared(chat).splits["train"].document_starts(
        index[:train.sizes[0]], ids[:train.sizes[0]], eos), starts_after_eos(ids[train.sizes[0]:], eos)])
    assert np.array_equal(train.document_starts(index, ids, eos), want)
    assert want[:train.sizes[0], 1:].sum() < starts_after_eos(ids[:train.sizes[0]], eos)[:, 1:].sum()


def strip_starts(out) -> None:
    """meta.json as data_prep wrote it before it recorded row starts."""
    meta = json.loads((out / "meta.json").read_text())
    meta["columns"] = [c for c in meta["columns"] if c != "doc_starts"]
    (out / "meta.json").write_text(json.dumps(meta))


def test_a_template_dir_without_the_column_is_refused_with_the_fix(tmp_path, llama, monkeypatch):
    """A dir of the tokenizer's template written before the starts were recorded: refused with document
    masking (naming the dir and data_prep.py; an online cache entry: deleting it), read as before without
    it."""
    out = prep_rows(tmp_path, llama, [CHAT, SHORT], packing="concat", seq_len=32)
    strip_starts(out)
    with pytest.raises(UserError) as err:
        data_module(prepared_cfg(out))
    assert err.value.field == "data.path" and err.value.value == str(out)
    assert "doc_starts" in err.value.problem and "data_prep.py" in err.value.fix
    assert len(data_module(prepared_cfg(out, document_mask=False)).prepared.splits["train"]) > 0
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(kind="online", path=str(tmp_path / "chat.jsonl"), format="chat", tokenizer=str(llama),
                     chat_template="tokenizer", seq_len=32, val_fraction=0.0)
    strip_starts(data_module(cfg).dir)
    with pytest.raises(UserError) as err:
        data_module(dataclasses.replace(cfg, document_mask=True))
    assert err.value.field == "MOE_DATA_CACHE" and "delete" in err.value.fix


def test_the_starts_are_byte_identical_whatever_num_proc(tmp_path, llama):
    """data_prep's output, doc_starts included, does not depend on num_proc or batch_size (the starts are
    recorded while packing, after the workers' tokenization)."""
    from test_data_prep import _tree

    rows = [CHAT, SHORT] * 3
    one = prep_rows(tmp_path, llama, rows, packing="concat", seq_len=32, val_fraction=0.3,
                    output=str(tmp_path / "one"))
    two = prep_rows(tmp_path, llama, rows, packing="concat", seq_len=32, val_fraction=0.3,
                    output=str(tmp_path / "two"), num_proc=2, batch_size=1)
    assert "doc_starts" in json.loads((one / "meta.json").read_text())["columns"]
    assert _tree(one) == _tree(two)
