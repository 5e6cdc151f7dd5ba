"""python -m moe.eval: our lm_eval adapter against lm_eval's own Hugging Face backend on the export, held-out
perplexity against the model's own loss, a sharded checkpoint against its consolidated file, and the refusal
of a task lm_eval would download."""
import json
import math
import re

import pytest
import torch
from conftest import REPO, on_gloo_ranks, run_entry
from omegaconf import OmegaConf
from test_infer import SAMPLE_TOK, save_ckpt, tiny_model

from moe.config.eval import EvalConfig
from moe.eval.command import run
from moe.eval.tasks import BUNDLED_TASKS, stay_offline
from moe.model.expert_layout import recorded

pytestmark = pytest.mark.usefixtures("one_thread")

# the second is over 128 tokens: several windows
TEXTS = ["Once upon a time there was a little bird.",
         " ".join((REPO / "data/sample/train.txt").read_text().splitlines()[:4])]


def ecfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(EvalConfig), kw)


@pytest.fixture(scope="module")
def ours_and_hf(tmp_path_factory):
    """(our adapter on a tiny fp32 model, lm_eval's HFLM on its export)."""
    stay_offline()
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from moe.eval.lm import MoELM
    from moe.infer.export import export_hf

    model = tiny_model(seed=3)
    tokenizer = AutoTokenizer.from_pretrained(SAMPLE_TOK)
    out = export_hf(model, tmp_path_factory.mktemp("hf") / "tiny", SAMPLE_TOK)
    hf = HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=8)
    return MoELM(model, tokenizer, batch_size=8), hf


def test_our_adapter_scores_the_bundled_tasks_as_lm_evals_hf_backend_scores_the_export(ours_and_hf):
    from lm_eval.evaluator import simple_evaluate

    from moe.eval.tasks import task_manager

    def evaluate(lm):
        return simple_evaluate(model=lm, tasks=list(BUNDLED_TASKS), task_manager=task_manager([]),
                               bootstrap_iters=0, log_samples=True)

    ours, theirs = (evaluate(lm) for lm in ours_and_hf)
    for task in BUNDLED_TASKS:
        mine, hf = ours["samples"][task], theirs["samples"][task]
        assert len(mine) == len(hf) == 30
        for a, b in zip(mine, hf, strict=True):
            for [(ll_a, greedy_a)], [(ll_b, greedy_b)] in zip(a["resps"], b["resps"], strict=True):
                assert math.isclose(float(ll_a), float(ll_b), rel_tol=1e-5, abs_tol=1e-5)
                assert greedy_a == greedy_b
        metrics = {k: v for k, v in ours["results"][task].items() if k.startswith("acc")}
        assert metrics and metrics == {k: theirs["results"][task][k] for k in metrics}


def test_rolling_loglikelihood_and_greedy_generation_match_lm_evals_hf_backend(ours_and_hf):
    from lm_eval.api.instance import Instance

    ours, hf = ours_and_hf
    rolling = [Instance("loglikelihood_rolling", doc={}, arguments=(t,), idx=0) for t in TEXTS]
    for a, b in zip(ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5)
    prompts = ["Once upon a time", "The cat", "Lucy liked to swim in the"]

    def asks(until: list[list[str]]) -> list:
        return [Instance("generate_until", doc={}, arguments=(p, {"until": u, "max_gen_toks": 12,
                                                                  "do_sample": False}), idx=0)
                for p, u in zip(prompts, until, strict=True)]

    whole = ours.generate_until(asks([[]] * 3))
    assert whole == hf.generate_until(asks([[]] * 3)) and all(whole)
    # a word each text holds as its stop string: the text up to it, from both
    stops = [[re.findall(r"[a-z]{2,}", text[2:])[0]] for text in whole]
    cut = ours.generate_until(asks(stops))
    assert cut == hf.generate_until(asks(stops))
    assert cut == [t.split(s)[0] for t, [s] in zip(whole, stops, strict=True)]


def test_perplexity_is_the_models_own_loss_on_the_same_windows():
    """loglikelihood_rolling's windows (every token predicted once, the most context max_length allows)
    scored by the forward's training loss (labels, fused cross-entropy), computed here without lm_eval."""
    from transformers import AutoTokenizer

    from moe.eval.lm import MoELM
    from moe.eval.perplexity import perplexity

    model = tiny_model(seed=5)
    tok = AutoTokenizer.from_pretrained(SAMPLE_TOK)
    lm = MoELM(model, tok, batch_size=2)
    length, total, count = model.model_config.max_position_embeddings, 0.0, 0
    for text in TEXTS:
        tokens = tok.encode(text)
        seq = [tok.eos_token_id, *tokens]  # no BOS in this tokenizer: EOS conditions the first token
        for start in range(0, len(tokens), length):
            end = min(start + length, len(tokens))  # predicts seq[start + 1 .. end]
            first = max(0, end - length)
            labels = [-100] * (start - first) + seq[start + 1:end + 1]
            with torch.no_grad():
                loss = model(torch.tensor([seq[first:end]]), labels_BS=torch.tensor([labels])).lm_loss
            total, count = total + float(loss) * (end - start), count + end - start
    got = perplexity(lm, TEXTS)
    assert got["tokens"] == count and count > length
    assert math.isclose(got["loss"], total / count, rel_tol=1e-5)
    assert math.isclose(got["perplexity"], math.exp(total / count), rel_tol=1e-5)


def _save_sharded(rank, path, ckpt_file):
    from torch.distributed.device_mesh import init_device_mesh

    from moe.checkpoint.sharded import save_sharded
    from moe.checkpoint.trust import load_trusted

    saved = load_trusted(ckpt_file)  # weights-only, as the product reads its own checkpoints
    holder = torch.nn.Module()  # LitMoE's `model.` prefix
    holder.model = tiny_model()
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("expert_dp", "ep"))
    state = recorded({"global_step": 7, "state_dict": {}, "hyper_parameters": saved["hyper_parameters"]})
    save_sharded(path, holder, [], mesh, state, is_global_zero=True)


def test_a_sharded_checkpoint_evaluates_as_its_consolidated_file_and_eval_json_lands_in_the_run(tmp_path):
    from moe.tools.consolidate import convert

    ckpt = save_ckpt(tmp_path / "file" / "checkpoints" / "last.ckpt", tiny_model())
    sharded = tmp_path / "run" / "checkpoints" / "step-000007.ckpt"
    on_gloo_ranks(1, _save_sharded, str(sharded), str(ckpt))
    consolidated = convert(str(sharded), str(tmp_path / "consolidated.ckpt"))
    docs = tmp_path / "heldout.txt"
    docs.write_text("\n".join(TEXTS) + "\n")
    settings = dict(tasks=list(BUNDLED_TASKS), limit=8, perplexity_file=str(docs))
    from_shards = run(ecfg(ckpt=str(sharded.parent.parent), **settings))  # the run dir: its newest checkpoint
    from_file = run(ecfg(ckpt=str(consolidated), output=str(tmp_path / "file.json"), **settings))
    assert from_shards["tasks"] == from_file["tasks"] and from_shards["perplexity"] == from_file["perplexity"]
    assert from_shards["tasks"]["moe_tiny_mc"]["samples"] == 8
    written = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert written["tasks"] == from_shards["tasks"] and written["model"] == str(sharded)
    assert not list((tmp_path / "run").glob(".eval.json*"))  # the temporary file was renamed into place


def test_a_task_lm_eval_would_download_is_refused_with_the_fix(tmp_path):
    ckpt = save_ckpt(tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt", tiny_model())
    proc = run_entry("moe/eval/__main__.py", f"ckpt={ckpt}", "tasks=[hellaswag]", here=True)
    assert proc.returncode == 2, proc.stderr
    said = " ".join(proc.stderr.split())
    assert "tasks='hellaswag'" in said and "task_dirs=[DIR]" in said and "docs/EVALUATION.md" in said
    hub = tmp_path / "hub_tasks"
    hub.mkdir()
    (hub / "arc_hub.yaml").write_text("task: arc_hub\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\n"
                                      "output_type: multiple_choice\ntest_split: test\ndoc_to_text: q\n"
                                      "doc_to_choice: [a, b]\ndoc_to_target: 0\n")
    proc = run_entry("moe/eval/__main__.py", f"ckpt={ckpt}", "tasks=[arc_hub]", f"task_dirs=[{hub}]",
                     here=True)
    assert proc.returncode == 2, proc.stderr
    said = " ".join(proc.stderr.split())
    assert "dataset_path='allenai/ai2_arc'" in said and "fetches nothing" in said
    proc = run_entry("moe/eval/__main__.py", f"ckpt={ckpt}", "taks=[moe_tiny_mc]", here=True)  # a typo
    assert proc.returncode == 2 and "docs/EVALUATION.md" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs" / "a" / "eval.json").exists()


def test_a_local_task_dir_reads_its_data_beside_its_yaml_from_any_working_directory(tmp_path, monkeypatch):
    """A generate_until task copied as lm_eval's own are (yaml + jsonl, `data_files` relative to the yaml),
    run from another directory: one answer is the model's own greedy text, so exact_match is 1/4."""
    from lm_eval.api.instance import Instance
    from transformers import AutoTokenizer

    from moe.eval.lm import MoELM

    model = tiny_model(seed=4)
    ckpt = save_ckpt(tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt", model)
    settings = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    prompts = ["Once upon a time", "The cat", "Lucy liked", "Tom went"]
    own = MoELM(model, AutoTokenizer.from_pretrained(SAMPLE_TOK)).generate_until(
        [Instance("generate_until", doc={}, arguments=(prompts[0], dict(settings)), idx=0)])[0]
    assert own  # a text, not the empty string every stop would give
    local = tmp_path / "lm_eval_local"
    local.mkdir()
    answers = [own, "no", "no", "no"]
    (local / "echo.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                              for p, a in zip(prompts, answers, strict=True)))
    (local / "echo_local.yaml").write_text(
        "task: echo_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: echo.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
        "doc_to_target: '{{answer}}'\n"
        f"generation_kwargs: {json.dumps(settings)}\nmetric_list:\n  - metric: exact_match\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    got = run(ecfg(ckpt=str(ckpt), tasks=["echo_local"], task_dirs=[str(local)]))
    assert got["tasks"]["echo_local"]["exact_match"] == 0.25 and got["tasks"]["echo_local"]["samples"] == 4
    assert json.loads((tmp_path / "runs" / "a" / "eval.json").read_text())["tasks"] == got["tasks"]


@pytest.mark.parametrize("arrange", [True, False], ids=["standalone", "in_run"])
def test_only_a_standalone_evaluation_rearranges_the_experts_for_generation(arrange):
    """A model stored [E, in, out] on the CPU, where the decoding kernels want [E, out, in]: generate_until
    arranges its experts (moe.infer.generate) where `python -m moe.eval` owns the model; in-run evaluation
    (arrange_experts=False) leaves a training model's parameters in the memory its optimizer and DDP hold
    them in. The texts are the same."""
    from lm_eval.api.instance import Instance
    from transformers import AutoTokenizer

    from moe.eval.lm import MoELM
    from moe.model.expert_layout import IN_OUT, kernel_order, memory_order, storing

    tok = AutoTokenizer.from_pretrained(SAMPLE_TOK)
    with storing(IN_OUT):
        model = tiny_model(seed=4, intermediate_size=24).to(torch.bfloat16)  # widths of 16-byte multiples
    experts = model.layers[0].ffn.experts
    request = Instance("generate_until", doc={}, arguments=("Once upon a time", {"until": ["\n"],
                       "max_gen_toks": 4, "do_sample": False}), idx=0)
    text = MoELM(model, tok, arrange_experts=arrange).generate_until([request])
    want = kernel_order(torch.device("cpu"), torch.bfloat16) if arrange else IN_OUT
    assert memory_order(experts.gate_up, experts.layout) == want
    assert text == MoELM(model, tok).generate_until([request])  # arranged or not, the same tokens
