"""infer.py: checkpoints (file, run dir, ckpt=last), prompts, chat template, sampling seeds, export/import
round trip through the CLI, fine-tuning from a Mixtral dir, and the errors users meet."""
import json
import os

import pytest
import torch
from conftest import FAST_RUN, run_entry
from omegaconf import OmegaConf

from moe.checkpoint.picker import resolve_checkpoint
from moe.config import ModelConfig, MoEOptConfig, TrainConfig
from moe.config.infer import InferConfig
from moe.errors import UserError
from moe.infer.command import load, run
from moe.infer.generate import generate
from moe.infer.load import model_from_checkpoint
from moe.model import MoETransformer
from moe.model.expert_layout import recorded

SAMPLE_TOK = "data/sample"  # bundled tokenizer, 512 ids
ARCH = dict(vocab_size=512, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
            num_experts=4, top_k=2, max_position_embeddings=128)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # subprocesses too: tiny ops stall with 2 threads on a busy box


pytestmark = pytest.mark.usefixtures("one_thread")


def save_ckpt(path, model: MoETransformer, extra=None, **data):
    """A checkpoint laid out as train.py writes one (Lightning: state_dict with `model.` keys + cfg)."""
    cfg = OmegaConf.structured(TrainConfig)
    cfg.run_name = "test"
    cfg.model = OmegaConf.structured(model.model_config)
    cfg.moe_opt = OmegaConf.structured(model.moe_opt)
    cfg.data.tokenizer = SAMPLE_TOK
    for k, v in data.items():
        cfg.data[k] = v
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = {"epoch": 0, "global_step": 7, "pytorch-lightning_version": "2.6.6",
                  "state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                  "hyper_parameters": {"cfg": OmegaConf.to_container(cfg, resolve=True)}, **(extra or {})}
    torch.save(recorded(checkpoint), path)  # with the expert layout it holds, as train.py records it
    return path


def tiny_model(seed=0, **kw) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig(**(ARCH | kw)), MoEOptConfig()).eval()


def icfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(InferConfig), kw)


@pytest.fixture
def ckpt(tmp_path):
    return save_ckpt(tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt", tiny_model())


def test_generation_from_a_checkpoint_matches_the_generator(ckpt, tmp_path, capsys):
    out_file = tmp_path / "out.jsonl"
    results = run(icfg(ckpt=str(ckpt.parent.parent), prompt="Once upon a time", max_new_tokens=9,
                       output_file=str(out_file), stop_at_eos=False))
    model, _ = model_from_checkpoint(ckpt)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SAMPLE_TOK)
    ids = tok("Once upon a time")["input_ids"]
    want = generate(model, torch.tensor([ids]), max_new_tokens=9, vocab_limit=512).tokens[0]
    assert results[0]["tokens"] == want and results[0]["prompt_tokens"] == len(ids)
    written = json.loads(out_file.read_text().splitlines()[0])
    assert written["completion"] == tok.decode(want, skip_special_tokens=True)
    printed = capsys.readouterr().out
    assert "=== [0] Once upon a time" in printed and "9 new tokens" in printed and "tokens/s" in printed


def test_generation_stops_at_the_models_context_and_says_so(ckpt, capsys):
    """max_position_embeddings=128: a prompt of n tokens gets 128 - n new ones, not max_new_tokens=100000
    (which ran past the context for minutes); a prompt that fills the context alone is refused."""
    results = run(icfg(ckpt=str(ckpt), prompt="Once upon a time", max_new_tokens=100000, stop_at_eos=False))
    n = results[0]["prompt_tokens"]
    assert results[0]["new_tokens"] == 128 - n
    assert f"note: max_new_tokens=100000 capped to {128 - n}" in capsys.readouterr().err
    with pytest.raises(UserError, match="prompt='2.. tokens' leaves no room to generate in "
                                        "model.max_position_embeddings=128"):
        run(icfg(ckpt=str(ckpt), prompt="time " * 200, max_new_tokens=4))


def test_chat_template_batches_and_seeds(ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = ['{"prompt": "What is 2 plus 3?"}', '{"prompt": "Tom"}', "", '{"prompt": "A longer prompt, here"}']
    prompts.write_text("\n".join(rows) + "\n")
    base = dict(ckpt=str(ckpt), prompts_file=str(prompts), max_new_tokens=8, chat=True, stop_at_eos=False)
    greedy = run(icfg(**base, batch_size=2))
    assert [r["prompt"] for r in greedy][1] == "<|user|>\nTom\n<|assistant|>\n"
    assert run(icfg(**base, batch_size=1)) == greedy  # padding in batches changes nothing
    sample = dict(base, temperature=1.0, top_k=20, top_p=0.95)
    a, b, c = run(icfg(**sample, seed=1)), run(icfg(**sample, seed=1)), run(icfg(**sample, seed=2))
    assert a == b and a != c and a != greedy
    assert run(icfg(**sample, seed=1, greedy=True)) == greedy


def test_ckpt_last_picks_the_newest_run(tmp_path):
    old = save_ckpt(tmp_path / "runs" / "old" / "checkpoints" / "last.ckpt", tiny_model(seed=1))
    new = save_ckpt(tmp_path / "runs" / "new" / "checkpoints" / "last.ckpt", tiny_model(seed=2))
    os.utime(old, (2e9, 2e9))
    os.utime(new, (1e9, 1e9))
    assert resolve_checkpoint("last", tmp_path / "runs") == old  # by mtime, not by name
    loaded = load(icfg(ckpt="last", runs_dir=str(tmp_path / "runs")))
    assert torch.equal(loaded.model.embed_tokens.weight, tiny_model(seed=1).embed_tokens.weight)
    with pytest.raises(UserError, match=r"found no .*checkpoints/last.ckpt"):
        resolve_checkpoint("last", tmp_path / "nowhere")


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load(icfg(ckpt=str(tmp_path / "missing.ckpt")))
    with pytest.raises(UserError, match="without a complete checkpoint"):
        load(icfg(ckpt=str(tmp_path)))
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(UserError, match="not a moe training checkpoint"):
        load(icfg(ckpt=str(tmp_path / "other.pt")))
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    with pytest.raises(UserError, match="could not be read"):
        load(icfg(ckpt=str(tmp_path / "junk.ckpt")))
    # weights of one architecture under a config of another (e.g. an edited or foreign checkpoint)
    path = save_ckpt(tmp_path / "x.ckpt", tiny_model())
    blob = torch.load(path, weights_only=True)
    blob["hyper_parameters"]["cfg"]["model"]["num_layers"] = 3
    blob["hyper_parameters"]["cfg"]["model"]["hidden_size"] = 64
    torch.save(blob, path)
    with pytest.raises(UserError, match=r"does not match .*missing: layers.2.*shape"):
        load(icfg(ckpt=str(path)))
    with pytest.raises(UserError, match="exactly one of"):
        load(icfg())
    with pytest.raises(UserError, match="exactly one of"):
        load(icfg(ckpt=str(path), hf_dir=str(tmp_path)))


def test_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path):
    path = save_ckpt(tmp_path / "small.ckpt", tiny_model(vocab_size=300))
    with pytest.raises(UserError, match="has 512 tokens but the model's vocab_size is 300"):
        load(icfg(ckpt=str(path)))
    with pytest.raises(UserError, match="has no tokenizer.json"):
        load(icfg(ckpt=str(path), tokenizer=str(tmp_path)))


def test_prompt_and_sampling_errors(ckpt, tmp_path):
    with pytest.raises(UserError, match="nothing to generate"):
        run(icfg(ckpt=str(ckpt)))
    with pytest.raises(UserError, match="prompts_file=.* does not exist"):
        run(icfg(ckpt=str(ckpt), prompts_file=str(tmp_path / "nope.txt")))
    for key, value in [("top_p", 0.0), ("temperature", -1.0), ("top_k", -2), ("batch_size", 0)]:
        with pytest.raises(UserError, match=f"{key}="):
            run(icfg(ckpt=str(ckpt), prompt="x", **{key: value}))


def test_hf_dir_chat_uses_the_directorys_own_template(ckpt, tmp_path):
    out = run(icfg(ckpt=str(ckpt), export_hf=str(tmp_path / "hf")))
    base = dict(prompt="Tom", max_new_tokens=6, chat=True, stop_at_eos=False)
    from_ckpt = run(icfg(ckpt=str(ckpt), **base))
    from_dir = run(icfg(hf_dir=str(out), **base))  # exported template renders what training saw
    assert from_dir[0]["prompt"] == from_ckpt[0]["prompt"] == "<|user|>\nTom\n<|assistant|>\n"
    assert from_dir[0]["tokens"] == from_ckpt[0]["tokens"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = "[INST] {{ messages[0]['content'] }} [/INST]"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert run(icfg(hf_dir=str(out), **base))[0]["prompt"] == "[INST] Tom [/INST]"
    explicit = run(icfg(hf_dir=str(out), chat_template="Q: {prompt} A: {completion}", **base))
    assert explicit[0]["prompt"] == "Q: Tom A: "


def test_cli_export_then_hf_dir_generates_the_same_text(ckpt, tmp_path):
    out = tmp_path / "exported"
    proc = run_entry("infer.py", f"ckpt={ckpt}", f"export_hf={out}", check=True, env=ONE_THREAD, here=True)
    assert "exported" in proc.stdout and (out / "model.safetensors").is_file()
    proc = run_entry("infer.py", f"hf_dir={out}", "prompt=Once upon a time", "max_new_tokens=7",
                     "stop_at_eos=false", f"output_file={tmp_path / 'hf.jsonl'}", check=True, env=ONE_THREAD,
                     here=True)
    assert "tokens/s" in proc.stdout
    ours = run(icfg(ckpt=str(ckpt), prompt="Once upon a time", max_new_tokens=7, stop_at_eos=False))
    assert json.loads((tmp_path / "hf.jsonl").read_text())["tokens"] == ours[0]["tokens"]
    assert not list(tmp_path.glob("*.log"))  # infer.py leaves no Hydra files behind
    proc = run_entry("infer.py", f"ckpt={tmp_path / 'missing.ckpt'}", "prompt=x", env=ONE_THREAD, here=True)
    assert proc.returncode == 2 and "does not exist. Fix:" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_train_infer_export_finetune(tmp_path):
    """train.py -> infer.py ckpt=last -> export_hf -> train.py model.init_from_hf=DIR starts from DIR."""
    short = (*FAST_RUN, "optimizer.warmup_steps=0", "trainer.val_check_interval=2",
             "trainer.limit_val_batches=1", "trainer.micro_batch_size=2", "model.num_layers=2",
             "model.hidden_size=64", "data.seq_len=32")
    one = dict(check=True, env=ONE_THREAD)
    runs = tmp_path / "runs"
    run_entry("train.py", f"hydra.run.dir={runs / 'base'}", "trainer.max_steps=2", *short, **one)
    proc = run_entry("infer.py", "ckpt=last", f"runs_dir={runs}", "prompt=Once upon a time",
                     "max_new_tokens=5", "chat=true", **one)
    assert "tokens/s" in proc.stdout
    export = tmp_path / "hf"
    run_entry("infer.py", "ckpt=last", f"runs_dir={runs}", f"export_hf={export}", **one)
    # fine-tune with a vanishing learning rate: the weights after one step are the imported ones;
    # the architecture comes from config.json even though the preset says num_layers=4
    run_entry("train.py", f"hydra.run.dir={runs / 'ft'}", f"model.init_from_hf={export}",
              "trainer.max_steps=1", "optimizer.lr=1e-12", "optimizer.min_lr=1e-12", *FAST_RUN,
              "optimizer.warmup_steps=0", "trainer.micro_batch_size=2", "data.seq_len=32", **one)
    tuned, cfg = model_from_checkpoint(runs / "ft" / "checkpoints" / "last.ckpt")
    base, _ = model_from_checkpoint(runs / "base" / "checkpoints" / "last.ckpt")
    assert cfg.model.num_layers == 2 and cfg.model.hidden_size == 64 and cfg.model.init_from_hf == str(export)
    for (name, a), b in zip(base.state_dict().items(), tuned.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8, msg=name)
