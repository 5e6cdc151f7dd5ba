"""neuronx-distributed's capacity path on an XLA device, under each trn1 precision preset, against float64.

    python tests/neuron_real/check_slots.py            # every preset, each in its own process
    python tests/neuron_real/check_slots.py --one      # one preset: the environment is already set

NxD's ExpertMLPs.forward_capacity_factor counts each expert's tokens and places them in capacity
slots with float64 arithmetic (modules/moe/expert_mlps_v2.py:285-294, :518, :531-545). XLA reads the
precision variables once, at start-up, so each preset runs in a process started with the
environment moe.backends.neuron.env.neuron_env gives for it. A micro-batch of KARAKURI's size (4096
tokens, 8 experts, top-2, capacity factor 2.0) is routed at random on the XLA device (torch-xla's
CPU client); every token's hidden state spells its index in 0/1 values (exact in any precision) and
the experts return their input, so the [E, C] slot map each expert receives and the combined output
show where every token went. Both are compared with the same call on CPU tensors in float64.

Exits 0 when the precision trn1 uses for MoE models (`auto` -> mixed) and fp32 place every slot
exactly, and bf16_sr, which validation refuses with MoE layers, misplaces some (the control: this
check sees the corruption the refusal prevents).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

TOKENS, EXPERTS, TOP_K, CAPACITY_FACTOR, BITS = 4096, 8, 2, 2.0, 13  # 2**13 > 4096 token codes


def slot_map_and_output(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The [E, C] token index each slot receives, and the combined output, of NxD's capacity path."""
    import torch.distributed as dist
    from neuronx_distributed.modules.moe.expert_mlps import ExpertMLPs
    from neuronx_distributed.parallel_layers import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29599", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    experts = ExpertMLPs(num_experts=EXPERTS, top_k=TOP_K, hidden_size=BITS, intermediate_size=4,
                         hidden_act="silu", glu_mlp=True, capacity_factor=CAPACITY_FACTOR,
                         normalize_top_k_affinities=True).to(device)
    received = []
    experts.mlp_op.register_forward_hook(lambda module, args, out: received.append(args[0]) or args[0])
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(TOKENS) + 1  # 0 is what a dropped slot loads (token 0's row) in both runs
    hidden = ((codes.unsqueeze(1) >> torch.arange(BITS)) & 1).float()
    affinities = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=g), dim=-1)
    index = affinities.topk(TOP_K, dim=-1).indices
    with torch.no_grad():
        out = experts.forward_capacity_factor(hidden.to(device), affinities.double().to(device),
                                              index.to(device))
    bits = received[0].cpu().double()
    slots = (bits * (2 ** torch.arange(BITS, dtype=torch.float64))).sum(-1).round().long()  # [E, C]
    return slots, out.cpu().double()


def run_one() -> None:
    import torch_xla.core.xla_model as xm

    got_slots, got_out = slot_map_and_output(xm.xla_device())
    want_slots, want_out = slot_map_and_output("cpu")
    wrong = int((got_slots != want_slots).sum())
    error = float((got_out - want_out).abs().max() / want_out.abs().max())
    print(f"{wrong} {got_slots.numel()} {error:.3e}")


def main() -> int:
    from hydra import compose, initialize_config_dir

    import moe.config  # noqa: F401
    from moe.backends.neuron.env import neuron_env
    from moe.config.derived import neuron_precision

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
    ok = True
    for preset in ("auto", "fp32", "bf16_sr"):
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose("train", overrides=["hardware=trn1", "trainer.devices=2",
                                              f"hardware.neuron_precision={preset}"])
        name = neuron_precision(cfg.hardware, cfg.model)
        env = {**os.environ, **neuron_env(cfg.hardware, cfg.model, cfg.trainer)}
        proc = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode:
            print(f"{preset}: failed\n{proc.stderr[-3000:]}")
            return 1
        wrong, slots, error = proc.stdout.split()[-3:]
        exact = wrong == "0"
        expected = name != "bf16_sr"  # validation refuses bf16_sr with MoE layers
        ok &= exact == expected
        flags = " ".join(f"{k}={env[k]}" for k in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"))
        verdict = f"{'exact' if exact else 'corrupted'} ({'as expected' if exact == expected else 'WRONG'})"
        print(f"summary: {preset:>7} -> {name:<7} ({flags}): {wrong} of {slots} slots misplaced, output off "
              f"by {error} of its scale: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        run_one()
    else:
        sys.exit(main())
