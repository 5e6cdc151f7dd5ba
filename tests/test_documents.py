"""Document masking (data.document_mask): a packed block's documents get exactly what each gets run alone,
on every attention path; positions restart; boundaries come from EOS; the data side's batches."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moe.config import DataConfig, ModelConfig, MoEOptConfig
from moe.data import MoEDataModule
from moe.data.datamodule import block_batch
from moe.data.packing import ConcatPacker, starts_after_eos
from moe.data.sample_corpus import chat_rows
from moe.data.tokenizer import read_tokenizer
from moe.model import MoETransformer
from moe.model.documents import Documents, document_ids_from_starts, positions_in_documents

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TOK = str(REPO / "data" / "sample")
DROPLESS = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, jitter_eps=0.0)
EOS, VOCAB = 60, 61
MLA = dict(attention="mla", kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
PATHS = {"gqa": {}, "gqa-window": dict(sliding_window=3), "alibi": dict(position_encoding="alibi"),
         "alibi-window": dict(position_encoding="alibi", sliding_window=3),
         "sinks": dict(attention_sinks=True), "mla": MLA, "mla-window": dict(MLA, sliding_window=3)}


TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
            num_experts=4, top_k=2, max_position_embeddings=64)


def tiny(**kw) -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**(TINY | kw)), DROPLESS).eval()
    if kw.get("attention_sinks"):  # learned values, not the zeros they start at
        for layer in model.layers:
            layer.attn.sinks.data.normal_()
    return model


def read_as_the_loader_does(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, labels, document ids) of blocks of L + 1 whose rows end in EOS, as the data loader makes them
    (moe.data.datamodule.block_batch on the starts after each EOS)."""
    blocks = block.numpy()
    batch = block_batch(blocks, None, starts_after_eos(blocks, EOS))
    return batch["input_ids"], batch["labels"], batch["document_ids"]


def packed_pair(seed=0):
    """A = 6 tokens ending in EOS, B = 9 tokens: the block [A | B] (16 = seq_len 15 + 1)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.cat([torch.randint(0, EOS, (5,), generator=g), torch.tensor([EOS])])
    return a, torch.randint(0, EOS, (10,), generator=g)


@pytest.mark.parametrize("path", list(PATHS))
@torch.no_grad()
def test_a_packed_block_gives_each_document_what_it_gets_alone(path):
    """fp32: the logits and the summed loss of [A | B] under the document mask equal A's and B's run alone
    (1e-6), by SDPA's dense mask and by flex_attention (torch's eager reference on CPU)."""
    model = tiny(**PATHS[path])
    a, b = packed_pair()
    block = torch.cat([a, b])[None]
    ids, labels, doc_ids = read_as_the_loader_does(block)
    alone = torch.cat([model(a[None]).logits_BSV, model(b[None, :-1]).logits_BSV], dim=1)
    loss_a = model(a[None, :-1], labels_BS=a[None, 1:]).lm_loss * (len(a) - 1)
    loss_b = model(b[None, :-1], labels_BS=b[None, 1:]).lm_loss * (len(b) - 1)
    targets = len(a) - 1 + len(b) - 1
    assert int((labels != -100).sum()) == targets  # the label after A's EOS carries none
    results = {}
    for flex in (False, True):
        docs = Documents(doc_ids, use_flex=flex)
        logits = model(ids, documents=docs).logits_BSV
        torch.testing.assert_close(logits, alone, rtol=0, atol=1e-6)
        loss = model(ids, labels_BS=labels, documents=docs).lm_loss  # the mean over both documents' targets
        torch.testing.assert_close(loss, (loss_a + loss_b) / targets, rtol=0, atol=1e-6)
        results[flex] = logits
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=1e-6)
    # without the mask A's tokens still match (causal), B's do not: the mask is what makes them equal
    plain = model(ids).logits_BSV
    assert (plain[:, len(a):] - alone[:, len(a):]).abs().max() > 1e-3


@torch.no_grad()
def test_multi_token_prediction_on_a_packed_block_gives_each_document_its_own_loss():
    """model.mtp_layers with the document mask: the depth attends as the main model does and position i
    carries no loss when token i + 1 lies in the next document, so [A | B]'s MTP loss is A's and B's run
    alone, weighted by their targets (A: 4, B: 8; 1e-6)."""
    model = tiny(mtp_layers=1)
    a, b = packed_pair()
    block = torch.cat([a, b])[None]
    ids, labels, doc_ids = read_as_the_loader_does(block)
    loss_a = model(a[None, :-1], labels_BS=a[None, 1:]).mtp_loss * (len(a) - 2)
    loss_b = model(b[None, :-1], labels_BS=b[None, 1:]).mtp_loss * (len(b) - 2)
    packed = model(ids, labels_BS=labels, documents=Documents(doc_ids, use_flex=False))
    want = (loss_a + loss_b) / (len(a) - 2 + len(b) - 2)
    torch.testing.assert_close(packed.mtp_loss, want, rtol=0, atol=1e-6)


def test_boundaries_and_positions_come_from_eos():
    block = torch.tensor([[3, 4, EOS, 5, EOS, EOS, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    _, labels, docs = read_as_the_loader_does(block)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert positions_in_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    hidden = [[False, False, True, False, True, True, False, False], [False] * 8]
    assert (labels == -100).tolist() == hidden  # the target after each EOS
    allowed = Documents(docs).allowed(window=None)[0, 0]
    assert allowed[3].tolist() == [False, False, False, True, False, False, False, False]
    assert allowed[7].tolist() == [False] * 6 + [True, True]


def test_documents_from_eos_equal_the_rows_concat_packing_joined():
    """ConcatPacker's rows end in EOS: the documents read back from a block's EOS tokens are the rows
    (their lengths), across block boundaries too (a block starts mid-document at position 0)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 9, size=40)
    rows = [np.append(rng.integers(0, EOS, n - 1), EOS).astype(np.int32) for n in lengths]
    packer = ConcatPacker(block_len=17, with_mask=False)
    blocks, _, _ = packer.add(np.concatenate(rows), None, lengths)
    stream = torch.from_numpy(blocks.reshape(-1).astype(np.int64))[None]
    starts = torch.from_numpy(starts_after_eos(stream.numpy(), EOS))
    derived = np.bincount(document_ids_from_starts(starts)[0].numpy())
    recorded = lengths[:len(derived)].copy()
    recorded[-1] = derived[-1]  # the last document is cut where the blocks end
    assert derived.tolist() == recorded.tolist()


def test_the_bundled_sample_has_eos_only_at_row_ends():
    """Deriving boundaries from EOS is exact on the sample: no row's text encodes to an EOS (a literal
    EOS string in a text would, and would end a document there)."""
    tok, _ = read_tokenizer(SAMPLE_TOK)
    eos = tok.token_to_id("<|endoftext|>")
    texts = (REPO / "data" / "sample" / "train.txt").read_text().splitlines()
    assert len(texts) > 2000
    assert all(eos not in enc.ids for enc in tok.encode_batch(texts, add_special_tokens=False))
    assert tok.encode("a<|endoftext|>b", add_special_tokens=False).ids.count(eos) == 1


def test_batches_carry_documents_only_when_asked(tmp_path, monkeypatch):
    """document_mask=false: the batches of before (input_ids, labels); true: the same inputs, document_ids
    from their EOS, and no loss on a label after an EOS."""
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    got = {}
    for on in (False, True):
        cfg = DataConfig(kind="online", path=str(src), format="chat", tokenizer=SAMPLE_TOK, seq_len=64,
                         val_fraction=0.0, document_mask=on)
        dm = MoEDataModule(cfg, micro_batch_size=4, accumulate_grad_batches=1, max_steps=2, seed=1,
                           limit_val_batches=1)
        dm.setup("fit")
        got[on] = next(iter(dm.train_dataloader()))
    eos = dm.meta["tokenizer"]["eos_id"]
    off, on = got[False], got[True]
    assert set(off) == {"input_ids", "labels"}
    assert torch.equal(off["input_ids"], on["input_ids"])
    after_eos = off["input_ids"] == eos
    assert after_eos.any()
    assert torch.equal(on["labels"], off["labels"].masked_fill(after_eos, -100))
    starts = torch.from_numpy(starts_after_eos(on["input_ids"].numpy(), eos))
    assert torch.equal(on["document_ids"], document_ids_from_starts(starts))


def _sequence_parallel_logits(rank: int, kw: dict, ids: torch.Tensor, docs_BS: torch.Tensor):
    """On each of 2 gloo ranks: the tiny model split by TP with sequence parallelism (each rank's blocks see
    half of every sequence between attention layers), fed the whole sequence's documents."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe.parallel.apply import apply_token_shard
    from moe.parallel.placement import materialize_distributed
    from moe.parallel.tensor_parallel import apply_tp

    cfg = ModelConfig(**(TINY | kw))
    with torch.device("meta"):
        model = MoETransformer(cfg, DROPLESS, init_seed=7)
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]
    apply_tp(model, tp, sequence_parallel=True)
    apply_token_shard(model, tp.get_group(), sequence_parallel=True)
    materialize_distributed(model, "cpu", None, cfg, tp=2)
    with torch.no_grad():
        return model.eval()(ids, documents=Documents(docs_BS)).logits_BSV


@pytest.mark.slow  # two processes
def test_sequence_parallel_ranks_see_the_whole_sequence_documents():
    """Under TP 2 with sequence parallelism attention gathers the sequence before it reads the positions and
    the mask, so the documents are the whole sequence's: both ranks' logits equal one process's."""
    from conftest import on_gloo_ranks

    kw = {}
    a, b = packed_pair()
    ids = torch.cat([a, b])[None].repeat(2, 1)  # 16 tokens: 8 a rank
    docs = document_ids_from_starts(torch.from_numpy(starts_after_eos(ids.numpy(), EOS)))
    one = MoETransformer(ModelConfig(**(TINY | kw)), DROPLESS, init_seed=7).eval()
    with torch.no_grad():
        want = one(ids, documents=Documents(docs)).logits_BSV
    got = on_gloo_ranks(2, _sequence_parallel_logits, kw, ids, docs)
    for rank in (0, 1):
        torch.testing.assert_close(got[rank], want, rtol=0, atol=1e-5)
