"""Trainium (hardware=trn1) through neuronx-distributed (NxD), frozen on Neuron SDK 2.28.

AWS ended NxD training support after SDK 2.28 (PyTorch 2.9, transformers 4.x), so this backend is
written and checked against neuronx-distributed v2.28.0 (docs/TRAINIUM.md has the pins and why).
It trains the same moe.model.MoETransformer as every backend, with NxD's parallel layers swapped
in (layers.py), the same objective and optimizer groups (module.py), and NxD's strategy,
precision plugin and checkpoints (strategy.py), its expert parallelism carved out of data
parallelism (nxd_moe_layer.py). What NxD cannot do is refused at validation
(moe.backends.neuron.rules): dropless or full-capacity expert parallelism, drop policies other
than NxD's, bf16 routing arithmetic, every_n checkpointing, KV replication. Nothing here is imported
unless hardware=trn1 runs.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch

from moe.backends.base import Backend, TrainerParts
from moe.errors import UserError

NOT_INSTALLED = "needs neuronx-distributed and torch-neuronx (SDK 2.28), which are not installed"
INSTALL_HINT = ("run on a trn1 instance in the Neuron SDK 2.28 environment (the Deep Learning AMI Neuron "
                "PyTorch 2.9, venv /opt/aws_neuronx_venv_pytorch_2_9), with this repository installed as "
                "`pip install -e . -c constraints-trn1.txt` (docs/TRAINIUM.md); here, use hardware=cpu, "
                "or dry_run=true to check the trn1 plan")


class NeuronBackend(Backend):
    name = "neuron"

    def prepare(self) -> None:
        from moe.backends.neuron.env import neuron_env

        self._env = neuron_env(self.cfg.hardware, self.cfg.model, self.cfg.trainer)
        os.environ.update(self._env)  # before torch_xla starts: XLA reads these once
        _import_nxd(self.cfg.hardware)
        self._nxd_config: dict | None = None
        self._source = None  # initial_values' source, chosen at the first parameter

    def env(self) -> dict[str, str]:
        return dict(self._env)

    def threads(self) -> None:
        return None

    def trainer_parts(self) -> TrainerParts:
        from moe.backends.neuron.strategy import MoENeuronStrategy, NeuronPrecision

        keep = self.cfg.trainer.keep_last_checkpoints
        strategy = MoENeuronStrategy(self.nxd_config(), keep_checkpoints=keep)
        # accelerator "auto": the strategy brings NxD's accelerator; Lightning refuses both
        # (trainer/connectors/accelerator_connector.py). NxD's optimizer clips inside its step.
        return TrainerParts(accelerator="auto", strategy=strategy, precision=None,
                            plugins=[NeuronPrecision()])

    def nxd_config(self) -> dict:
        """neuronx_distributed_config's result, made once: the strategy and the module share it."""
        from neuronx_distributed.trainer import neuronx_distributed_config

        from moe.backends.neuron.layers import init_from
        from moe.backends.neuron.nxd_config import nxd_config_kwargs

        if self._nxd_config is None:
            cfg = self.cfg
            kwargs = nxd_config_kwargs(cfg.hardware, cfg.model, cfg.optimizer, cfg.parallel, self.dims,
                                       init_from(self.initial_values, cfg.model))
            self._nxd_config = neuronx_distributed_config(**kwargs)
        return self._nxd_config

    def initial_values(self, name: str, shape, first_expert: int | None) -> torch.Tensor:
        """What NxD's param_init_fn fills a parameter from (moe/backends/neuron/layers.py init_from):
        model.init_from_hf's files on a fresh run, else moe.model.init's values for cfg.seed (a
        resumed run's weights come from its checkpoint right after)."""
        if self._source is None:
            from moe.backends.neuron.layers import random_init

            self._source = self.initial_source() or random_init(self.cfg.model, self.cfg.seed)
        return self._source(name, shape, first_expert)

    def build_module(self, resuming: bool = False, guard=None):
        """NxD builds the model in the module's setup, each rank its own shard (initial_values)."""
        from moe.backends.neuron.module import NeuronLitMoE

        self._resuming = resuming
        return NeuronLitMoE(self.nxd_config(), backend=self, guard=guard)

    def checkpoint_options(self) -> dict:
        """No last.ckpt copy: NxD keeps the newest keep_last_checkpoints tags, resume takes the newest."""
        return {"keep": None, "link_last": False}

    def parallelize(self, module) -> None:
        """NxD parallelises while it builds the model (layers.build_model)."""

    # -- numbers every rank must agree on, reduced on the XLA device --------------------------------
    def all_reduce(self, module, tensor: torch.Tensor, op: str, stage_only: bool = False) -> torch.Tensor:
        """xm.all_reduce over every rank on the device: NxD's strategy.reduce takes sum and mean only
        and puts a CPU tensor through the xla process group (lightning/strategy.py:159-199)."""
        import torch_xla.core.xla_model as xm

        kind = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX}[op]
        return xm.all_reduce(kind, tensor.to(module.device)).detach().cpu()

    def grad_norm(self, module) -> torch.Tensor:
        """A norm of every rank's local gradients, the same on every rank: NaN or inf exactly when any
        rank's gradient is, for the spike guard's decision (the logged norm is NxD's, after the step). A
        gradient is where NxD's optimizer reads it (neuronx-distributed v2.28.0 trainer/optimizer.py:101-119):
        `param.grad`, else `main_grad`, the fp32 sum into which torch-xla's ZeRO-1 moves it in the backward
        under mixed precision's use_fp32_grad_acc, leaving `param.grad` None (torch_xla 2.9.0
        distributed/zero_redundancy_optimizer.py:199-217; NxD sets the hook, trainer/trainer.py:284-285)."""
        grads = [p.grad if p.grad is not None else getattr(p, "main_grad", None) for p in module.parameters()]
        squares = [g.detach().float().pow(2).sum() for g in grads if g is not None]
        local = torch.stack(squares).sum() if squares else torch.zeros((), device=module.device)
        return self.all_reduce(module, local.reshape(1), "sum")[0].sqrt()

    def micro_batch_sync(self, module, last: bool):
        """Each micro-batch's forward and backward is one XLA graph: executed when it ends (xm.mark_step), as
        NeuronLitMoE cut it before the step was one method. Lightning's manual backward reaches a plain
        `loss.backward()` here: its DDP pre_backward returns for a model that is not DDP
        (lightning/pytorch/strategies/ddp.py:317 at 2.6.6; NxD's strategy is XLAStrategy's, a DDPStrategy)."""
        return _marked_step()

    def clip_gradients(self, module, norm, max_norm: float) -> None:
        """NxD's optimizer clips inside its step (optimizer_config max_grad_norm; ZeRO-1: its max_norm)."""

    def logged_grad_norm(self, module, norm) -> float:
        """The norm NxD's optimizer computed inside its step (before clipping; NaN where it has none):
        NxDOptimizer.grad_norm (trainer/optimizer.py:26-28)."""
        after = module.trainer.optimizers[0].grad_norm
        return math.nan if after is None else float(after)

    def skip_update(self, module) -> None:
        """This step's NxD optimizer step is left out, here, whatever the gradients hold: NxD's optimizers
        have no step that updates nothing. NxDOptimizer.step hands on to torch-xla's ZeRO-1 (neuronx-
        distributed v2.28.0 trainer/optimizer.py:122-147), which steps every shard with a gradient or a
        `main_grad` (torch_xla 2.9.0 distributed/zero_redundancy_optimizer.py:339-356, :403-438): zeroed,
        AdamW still moves the moments and decays the weights; with none at all NxD's ZeRO-1 clipping fails
        (optimizer/zero_redundancy_optimizer.py:71-105 -> parallel_layers/grads.py:126-127). So the
        optimizer's `step` is, for this one call, one that updates nothing (the attribute goes with that
        call): the step's `optimizer.step()` still counts the step (Lightning) and runs the precision plugin
        and its graph cut, and the weights, the moments and ZeRO-1's fp32 master shards stay as they are;
        the next step's zero_grad clears the gradients."""
        optimizer = module.trainer.optimizers[0]  # NxDOptimizer: the precision plugin calls its step()

        def left_out(closure=None):
            del optimizer.step  # the class's step again from the next step on
            return None

        optimizer.step = left_out


@contextlib.contextmanager
def _marked_step():
    yield
    import torch_xla.core.xla_model as xm

    xm.mark_step()


def _import_nxd(hardware) -> None:
    """Import neuronx-distributed, or stop with what to install."""
    try:
        import neuronx_distributed  # noqa: F401
        import torch_xla  # noqa: F401
    except ImportError as err:
        if "transformers.utils.fx" in str(err) or "HFTracer" in str(err):
            problem = ("cannot import neuronx-distributed next to transformers 5: its pipeline/trace.py "
                       "imports "
                       f"transformers.utils.fx.HFTracer, which transformers 5 removed ({err})")
        else:
            problem = f"{NOT_INSTALLED} ({err})"
        raise UserError("hardware", hardware.name, INSTALL_HINT, problem=problem) from err
