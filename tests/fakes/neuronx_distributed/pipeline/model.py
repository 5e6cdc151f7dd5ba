"""FAKE neuronx_distributed.pipeline.model.NxDPPModel (v2.28.0 signature, pipeline/model.py:75-114).

Traces the module with torch.fx in the constructor as NxD does (pipeline/trace.py:151-200): the
transformer layer class, `leaf_module_cls` (substring match on the class name) and the parallel
layers are leaves; `autowrap_modules` (plus math and the parallel_layers package) and
`autowrap_functions` are called, not traced into. A forward that cannot be traced fails here as on
trn1. It then runs the traced graph on every rank, unpartitioned, micro-batch by micro-batch, and
`run_train` returns the mean loss on the last stage, None on the others (model.py:1974-2000).
"""
import math

import torch

from .. import parallel_layers
from ..parallel_layers import PARALLEL_FUNCTIONS, PARALLEL_MODULES, parallel_state


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_modules, **kwargs):
        super().__init__(param_shapes_constant=True, **kwargs)
        self.leaf_modules = leaf_modules

    def is_leaf_module(self, m, module_qualified_name):
        if any(t in type(m).__name__ for t in self.leaf_modules):
            return True
        return super().is_leaf_module(m, module_qualified_name)


class NxDPPModel(torch.nn.Module):
    def __init__(self, module, transformer_layer_cls=None, num_microbatches: int = 1, virtual_pipeline_size: int = 1,
                 output_loss_value_spec=None, return_mb_loss: bool = False, broadcast_and_average_loss: bool = False,
                 use_zero1_optimizer: bool = False, use_model_wrapper: bool = False,
                 use_optimizer_wrapper: bool = False, pipeline_cuts=None, input_names=None, leaf_module_cls=None,
                 autowrap_functions=None, autowrap_modules=None, autowrap_obj_methods=None, tracer_cls=None,
                 param_init_fn=None, trace_file_path=None, return_loss_on_cpu: bool | None = True,
                 deallocate_pipeline_outputs: bool = False, auto_partition: bool | None = False,
                 fuse_microbatches: bool | None = False, manual_pp_partition: bool | None = False,
                 manual_pp_stage_partition_fn=None, manual_pp_loss_fn=None, _delay_tracing: bool | None = False,
                 _turn_off_odd_even_scheduler: bool | None = False, _all_reduce_send_recv: bool | None = False,
                 _fused_send_recv: bool | None = False, _fused_fwd_bwd: bool | None = False,
                 _mark_step_before_pp_runtime: bool | None = True, _mark_step_after_pp_runtime: bool | None = True,
                 _deallocate_send_tensors: bool | None = True, _use_gloo_for_metadata_comm: bool = False,
                 _debug_mode: bool = False, _debug_pp_size: int = 8, _debug_pp_rank: int = 0):
        super().__init__()
        if transformer_layer_cls is None and not manual_pp_partition:
            raise ValueError("transformer_layer_cls is required (pipeline/model.py:235-236)")
        if input_names is None:
            raise ValueError("input_names is required to trace the model (pipeline/model.py:356-359)")
        if auto_partition and pipeline_cuts:
            raise ValueError("auto_partition and pipeline_cuts exclude each other (model.py:340-343)")
        self.original_torch_module = module
        self.transformer_layer_cls, self.num_microbatches = transformer_layer_cls, num_microbatches
        self.output_loss_value_spec, self.return_loss_on_cpu = output_loss_value_spec, return_loss_on_cpu
        leaves = [transformer_layer_cls.__name__, *(leaf_module_cls or []), *(m.__name__ for m in PARALLEL_MODULES)]
        tracer = _Tracer(leaves, autowrap_modules=(math, parallel_layers, *(autowrap_modules or [])),
                         autowrap_functions=(*(autowrap_functions or []), *PARALLEL_FUNCTIONS))
        import inspect

        concrete = {n: p.default for n, p in inspect.signature(module.forward).parameters.items()
                    if n not in input_names}
        self.traced = torch.fx.GraphModule(module, tracer.trace(module, concrete_args=concrete))

    @property
    def _last_stage(self) -> bool:
        return parallel_state.get_pipeline_model_parallel_rank() == parallel_state.get_pipeline_model_parallel_size() - 1

    def _loss(self, outputs):
        spec = self.output_loss_value_spec
        return outputs[list(spec).index(True)] if isinstance(spec, (tuple, list)) else outputs

    def _run(self, train: bool, **kwargs):
        chunks = [dict(zip(kwargs, values, strict=True))
                  for values in zip(*(v.chunk(self.num_microbatches) for v in kwargs.values()), strict=True)]
        losses = []
        for micro in chunks:
            loss = self._loss(self.traced(**micro))
            if train:
                (loss / self.num_microbatches).backward()
            losses.append(loss.detach())
        if not self._last_stage:
            return None
        loss = torch.stack(losses).mean()
        return loss.cpu() if self.return_loss_on_cpu else loss

    def run_train(self, *args, **kwargs):
        return self._run(True, **kwargs)

    def run_eval(self, *args, **kwargs):
        with torch.no_grad():
            return self._run(False, **kwargs)

    def local_named_parameters(self, recurse: bool = True):
        return self.original_torch_module.named_parameters(recurse=recurse)

    def local_state_dict(self, *args, **kwargs):
        return self.original_torch_module.state_dict(*args, **kwargs)
