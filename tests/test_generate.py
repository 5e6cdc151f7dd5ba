"""KV-cache generation: cache vs no cache, left padding, sampling, EOS, dropless routing."""
import pytest
import torch

from moe.config import ModelConfig, MoEOptConfig
from moe.infer.generate import generate, generation_mode, left_pad, next_token
from moe.model import MoETransformer

V = 61


pytestmark = pytest.mark.usefixtures("one_thread")


def build(seed=0, moe_opt=None, **kw) -> MoETransformer:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                num_experts=4, top_k=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    opt = moe_opt or MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)
    return MoETransformer(ModelConfig(**(base | kw)), opt).eval()


PROMPTS = [[5, 9, 3, 7, 11, 2, 8], [4, 1], [12, 30, 6, 6]]


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=4), dict(position_encoding="alibi"),
                                dict(position_encoding="alibi", sliding_window=3), dict(num_kv_heads=1)])
def test_kv_cache_gives_the_same_tokens_as_no_cache(kw):
    model = build(**kw)
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    cached = generate(model, ids, mask, max_new_tokens=12)
    full = generate(model, ids, mask, max_new_tokens=12, use_cache=False)
    assert cached.tokens == full.tokens
    assert [len(t) for t in cached.tokens] == [12, 12, 12]  # no EOS given: every row runs to the limit


def test_last_only_gives_the_last_positions_logits():
    """What each generation step picks from (the prefill computes one position's logits, not S)."""
    model = build()
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    with torch.no_grad():
        full = model(ids, attention_mask_BS=mask).logits_BSV
        last = model(ids, attention_mask_BS=mask, last_only=True).logits_BSV
    assert last.shape == (len(PROMPTS), 1, V)
    torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=3), dict(position_encoding="alibi")])
def test_left_padded_batch_matches_each_prompt_alone(kw):
    model = build(seed=1, **kw)
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    batched = generate(model, ids, mask, max_new_tokens=10)
    alone = [generate(model, torch.tensor([p]), max_new_tokens=10).tokens[0] for p in PROMPTS]
    assert batched.tokens == alone
    # the padded rows' real positions give the unpadded logits (the mask hides pads; shift is invisible)
    with torch.no_grad():
        padded = model(ids, attention_mask_BS=mask).logits_BSV
        for b, p in enumerate(PROMPTS):
            single = model(torch.tensor([p])).logits_BSV[0]
            torch.testing.assert_close(padded[b, -len(p):], single, rtol=0, atol=1e-5)
    assert batched.prompt_tokens == sum(map(len, PROMPTS))


def test_left_pad_layout():
    ids, mask = left_pad([[7, 8, 9], [5]], pad_token_id=1)
    assert ids.tolist() == [[7, 8, 9], [1, 1, 5]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], pad_token_id=0)


def test_mask_shape_is_checked_against_the_cache():
    model = build()
    cache = model.new_kv_cache()
    model(torch.tensor([[1, 2, 3]]), kv_cache=cache, attention_mask_BS=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"every position fed so far: \(1, 4\)"):
        model(torch.tensor([[4]]), kv_cache=cache, position_offset=3, attention_mask_BS=torch.ones(1, 1))


def test_eos_stops_each_row_and_pads_the_rest():
    model = build(seed=2)
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    free = generate(model, ids, mask, max_new_tokens=8).tokens
    eos = free[1][2]  # row 1 emits it as its third token
    out = generate(model, ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    for row, ref, done in zip(out.tokens, free, out.finished, strict=True):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert row == ref[:cut] and done == (eos in ref)
    assert out.tokens[1] == free[1][:3] and out.finished[1]
    # every row stopping ends the loop early
    first = [r[0] for r in free]
    stopped = generate(model, ids, mask, max_new_tokens=8, eos_token_id=first)
    assert stopped.tokens == [[t] for t in first] and all(stopped.finished)
    assert stopped.num_new_tokens == 3 and stopped.tokens_per_s > 0


def test_rows_the_caller_says_are_done_take_pads_and_all_done_ends_the_loop():
    """generate's `stopped` (lm_eval's stop strings): a row stops after the step it is reported done."""
    model = build(seed=2)
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    free = generate(model, ids, mask, max_new_tokens=8).tokens
    out = generate(model, ids, mask, max_new_tokens=8, pad_token_id=0,
                   stopped=lambda new_BN: torch.tensor([True, new_BN.shape[1] >= 2, new_BN.shape[1] >= 4]))
    assert out.num_new_tokens == 3 * 4  # the loop ends at the fourth step, when every row is done
    assert [row[:n] for row, n in zip(out.tokens, (1, 2, 4), strict=True)] == \
        [row[:n] for row, n in zip(free, (1, 2, 4), strict=True)]
    assert out.tokens[0][1:] == [0, 0, 0] and out.tokens[1][2:] == [0, 0]  # pads once done


def test_seeded_sampling_is_reproducible():
    model = build(seed=3)
    ids, mask = left_pad(PROMPTS, pad_token_id=0)

    def sample(seed, **kw):
        gen = torch.Generator().manual_seed(seed)
        return generate(model, ids, mask, max_new_tokens=16, temperature=1.5, generator=gen, **kw).tokens

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert sample(7, top_k=5, top_p=0.9) == sample(7, top_k=5, top_p=0.9)
    greedy = generate(model, ids, mask, max_new_tokens=16).tokens
    assert sample(7, top_k=1) == greedy  # top-1 sampling is greedy
    assert sample(9, top_p=1e-6) == greedy  # the smallest nucleus is the argmax


def test_next_token_filters():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits[:2]).tolist() == [1, 1]
    top2 = next_token(logits, temperature=1.0, top_k=2, generator=gen)
    assert set(top2.tolist()) == {1, 2}
    # softmax probs ~ [.03, .64, .24, .09, .01]: top_p=0.8 keeps {1, 2} (0.64 < 0.8 <= 0.88)
    nucleus = next_token(logits, temperature=1.0, top_p=0.8, generator=gen)
    assert set(nucleus.tolist()) == {1, 2}
    share = (nucleus == 1).float().mean().item()
    assert abs(share - 0.64 / 0.88) < 0.03  # renormalised within the nucleus
    cold = next_token(logits, temperature=0.05, generator=gen)
    assert (cold == 1).all()


def test_vocab_limit_never_emits_ids_past_the_tokenizer():
    model = build(seed=4)
    ids = torch.tensor([PROMPTS[0]])
    free = generate(model, ids, max_new_tokens=20).tokens[0]
    limit = sorted(set(free))[len(set(free)) // 2] + 1  # forbid some ids the model wants
    limited = generate(model, ids, max_new_tokens=20, vocab_limit=limit).tokens[0]
    assert max(limited) < limit and limited != free


def test_generation_is_dropless_even_for_a_capacity_model():
    opt = MoEOptConfig(capacity_factor=0.5, eval_capacity_factor=0.5, min_capacity=0)
    capped, free = build(seed=5, moe_opt=opt), build(seed=5)
    free.load_state_dict(capped.state_dict())
    ids, mask = left_pad(PROMPTS, pad_token_id=0)
    capped.train()
    want = generate(free, ids, mask, max_new_tokens=6).tokens
    assert generate(capped, ids, mask, max_new_tokens=6).tokens == want
    assert capped.training  # generate() restores the mode it found
    with generation_mode(capped):
        assert not capped.training and capped(ids, generating=True).routing == []  # no stats while generating
    capped.eval()
    assert len(capped(ids).routing) == 2 and capped(ids).routing[0].dropped_fraction > 0  # eval: capacity 0.5
    capped.train()
    assert len(capped(ids).routing) == 2
