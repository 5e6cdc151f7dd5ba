"""A save_pretrained directory read straight into our model (moe.hf.convert.from_hf_dir: built on the meta
device, each tensor read from the files in the dtype asked for) holds, bit for bit, what converting the
transformers model loaded from it gives, in fp32 and in bf16; DeepSeek-V3's multi-token-prediction layer,
which transformers does not load, comes from the files as they hold it."""
import pytest
import torch

from moe.hf import from_hf
from moe.hf.families import converter_for
from tests import test_hf, test_hf_families, test_hf_gpt_oss
from tests.test_mtp import deepseek_dir


def saved(family: str, path):
    """A family's tiny random directory, as the family's own tests build it; the files' MTP tensors
    (DeepSeek-V3's; none for the others)."""
    if family == "deepseek_v3":
        return deepseek_dir(path)[1]
    hf = {"mixtral": lambda: test_hf.hf_model(*test_hf.CASES[1]),
          "gpt_oss": test_hf_gpt_oss.hf_model,
          "qwen3_moe": lambda: test_hf_families.hf_model("qwen3_moe")}[family]()
    hf.save_pretrained(path)
    return {}


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "qwen3_moe"])
def test_a_directory_loads_as_its_transformers_model_converts_bit_for_bit(family, tmp_path):
    files = saved(family, tmp_path)
    hf = converter_for(family).loading_class({}).from_pretrained(str(tmp_path))
    want = from_hf(hf).state_dict()
    for dtype in (None, torch.bfloat16):
        got = from_hf(tmp_path, dtype=dtype).state_dict()
        main = {k: v for k, v in got.items() if not k.startswith("mtp.")}
        assert main.keys() == want.keys()
        for name, value in main.items():
            expected = want[name] if dtype is None or name.endswith("expert_bias") else want[name].to(dtype)
            assert value.dtype == expected.dtype and torch.equal(value, expected), name
    depth = {k.removeprefix("mtp.0."): v for k, v in got.items() if k.startswith("mtp.0.")}
    assert bool(depth) == bool(files)
    if files:  # read from layer 2 of the files (the layer after the main model's two)
        assert torch.equal(depth["eh_proj.weight"], files["model.layers.2.eh_proj.weight"].bfloat16())
        assert torch.equal(depth["enorm.weight"], files["model.layers.2.enorm.weight"].bfloat16())
