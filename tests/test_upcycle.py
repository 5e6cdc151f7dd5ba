"""Dense -> MoE upcycling: every expert a copy of the dense MLP, so with dropless renormalised routing
the upcycled model computes the dense model's logits; from the command line it trains and exports."""
from __future__ import annotations

import pytest
import torch
from conftest import REPO, run_entry

from moe.errors import UserError
from moe.hf import upcycle

transformers = pytest.importorskip("transformers")


def dense_dir(tmp_path, kind: str = "mistral"):
    config_cls = {"mistral": transformers.MistralConfig, "llama": transformers.LlamaConfig}[kind]
    model_cls = {"mistral": transformers.MistralForCausalLM, "llama": transformers.LlamaForCausalLM}[kind]
    config = config_cls(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=False)
    if kind == "mistral":
        config.sliding_window = None
    torch.manual_seed(0)
    model = model_cls(config).eval()
    path = tmp_path / kind
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("kind", ["mistral", "llama"])
def test_upcycled_logits_equal_the_dense_models(tmp_path, kind):
    path, dense = dense_dir(tmp_path, kind)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    for source in (path, dense):  # a directory or a model
        model = upcycle(source, num_experts=4, top_k=2).eval()
        assert model.model_config.num_experts == 4 and model.model_config.top_k == 2
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits_BSV, dense(ids).logits, rtol=0, atol=1e-4)
    noisy = upcycle(path, num_experts=4, top_k=2, noise_std=0.01).eval()
    experts = noisy.layers[0].ffn.experts.gate_up
    assert not torch.equal(experts[0], experts[1])  # noise breaks the copies' symmetry


def test_meta_build_upcycles_each_rank_from_the_files(tmp_path):
    """The training path: Backend.build_module on meta, materialised from the dense files."""
    from conftest import compose_cfg

    from moe.backends import build_backend
    from moe.train.run import settled_of

    path, dense = dense_dir(tmp_path)
    settled = settled_of(compose_cfg(f"model.upcycle_from_hf={path}", "model.num_experts=4", "model.top_k=2",
                                     "moe_opt=dropless", f"data.tokenizer={REPO}/data/sample"))
    backend = build_backend(settled.config, settled.dims)
    module = backend.build_module()
    backend.parallelize(module)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(module.model(ids).logits_BSV, dense(ids).logits, rtol=0, atol=1e-4)


def test_training_fine_tunes_an_upcycled_model_and_exports_it(tmp_path, train_here):
    path, _ = dense_dir(tmp_path)
    run = train_here(f"model.upcycle_from_hf={path}", "model.num_experts=4", "model.top_k=2",
                     f"data.tokenizer={REPO}/data/sample", "trainer.max_steps=6")
    lines = (run / "metrics.csv").read_text().splitlines()
    assert len(lines) >= 7
    export = tmp_path / "export"
    run_entry("infer.py", f"ckpt={run}", f"export_hf={export}", check=True, here=True)
    exported = transformers.MixtralForCausalLM.from_pretrained(export, local_files_only=True)
    assert exported.config.num_local_experts == 4 and exported.config.num_experts_per_tok == 2


@pytest.mark.parametrize("experts, top_k, g", [(8, 4, 2), (4, 4, 4), (8, 2, 2)])
def test_fine_grained_upcycling_starts_equal_to_the_dense_model(tmp_path, experts, top_k, g):
    """Each expert a 1/g slice of the dense MLP; tied router rows pick whole copies; weights x g."""
    path, dense = dense_dir(tmp_path)
    model = upcycle(path, num_experts=experts, top_k=top_k, granularity=g).eval()
    assert model.model_config.intermediate_size == 64 // g and model.moe_opt.topk_scaling_factor == g
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits_BSV, dense(ids).logits, rtol=0, atol=1e-4)
    router = model.layers[0].ffn.router.weight
    assert torch.equal(router[0], router[g - 1])  # one copy's slices tie
    assert experts == g or not torch.equal(router[0], router[g])  # copies differ
    model.train()
    out = model(ids)
    out.logits_BSV.square().mean().backward()
    grad = model.layers[0].ffn.router.weight.grad
    assert not torch.equal(grad[0], grad[1])  # the tie breaks in training


def test_fine_grained_upcycling_refuses_a_granularity_that_cannot_slice(tmp_path):
    from moe.errors import ConfigError

    path, _ = dense_dir(tmp_path)
    with pytest.raises(ConfigError) as err:
        upcycle(path, num_experts=8, top_k=2, granularity=4)  # top_k 2 is not a multiple of 4
    assert err.value.field == "granularity" and "divides num_experts=8, top_k=2" in err.value.fix


def test_fine_grained_upcycling_from_the_command_line_builds_the_sliced_experts(tmp_path):
    """The meta-device path (each rank reads its slices) gives the same model as moe.hf.upcycle."""
    from conftest import compose_cfg

    from moe.backends import build_backend
    from moe.train.run import settled_of

    path, dense = dense_dir(tmp_path)
    overrides = [f"model.upcycle_from_hf={path}", "model.num_experts=8", "model.top_k=4",
                 "model.upcycle_granularity=2", "moe_opt=dropless", "moe_opt.topk_scaling_factor=2",
                 f"data.tokenizer={REPO}/data/sample"]
    settled = settled_of(compose_cfg(*overrides))
    assert settled.config.model.intermediate_size == 32
    backend = build_backend(settled.config, settled.dims)
    module = backend.build_module()
    backend.parallelize(module)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    module.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(module.model(ids).logits_BSV, dense(ids).logits, rtol=0, atol=1e-4)
    cfg = compose_cfg(*(o for o in overrides if "topk_scaling" not in o))
    with pytest.raises(UserError, match="moe_opt.topk_scaling_factor=2"):
        settled_of(cfg)
