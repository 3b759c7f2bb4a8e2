"""megatron-core optimizer call sites that assume CUDA tensors or TE/Apex Adam.

`patch_cpu_optimizers` (device relocation, only without CUDA: CUDA type names, the DP-zero
gather's gloo branch) and `patch_torch_adam` (a library fix on every device; acts only when the
inner optimizer is torch Adam/AdamW, else calls megatron-core's own code). Each call site and its
numerics: docs/compat.md#every-patched-call-site.
"""
from __future__ import annotations

import functools
import importlib
import sys

import torch

from megatron_csbp.compat import replace_once, swapped, under
from megatron_csbp.compat.pipeline import cuda_is_identity

_ORIG_TENSOR_TYPE = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _ORIG_TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _ORIG_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


#: while active, CPU tensors report `torch.cuda.<T>Tensor` from `.type()`
cuda_type_names = functools.partial(swapped, torch.Tensor, "type", _cuda_named_type)


def _is_torch_adam(opt) -> bool:
    """The inner optimizer is torch's Adam/AdamW: megatron-core's fallback without TE's or apex's
    fused Adam (whose per-parameter state carries a `step` tensor)."""
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))


def patch_cpu_optimizers() -> None:
    """Device relocation (CPU only): CUDA type names, the DP-zero gather's gloo branch."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    replace_once(clip_grads, "clip_grad_by_total_norm_fp32", under(cuda_type_names))
    for name, module in list(sys.modules.items()):  # the modules that imported it by name
        if name.startswith("megatron.core") and getattr(module, "clip_grad_by_total_norm_fp32", None) is not None:
            module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib.DistributedOptimizer):
        replace_once(cls, "__init__", under(cuda_type_names))
    # The non-gloo branch of the DP-zero state gather moves shards with `.cuda()`; on CPU the
    # "NCCL" data-parallel group is gloo anyway, so take the gloo branch (same collectives).
    def get_parameter_state_dp_zero(orig):
        def patched(self, use_gloo_comm=True, *args, **kwargs):
            if self.data_parallel_group_gloo is None:
                self.data_parallel_group_gloo = self.data_parallel_group
            return orig(self, True, *args, **kwargs)
        return patched

    replace_once(distrib.DistributedOptimizer, "get_parameter_state_dp_zero", get_parameter_state_dp_zero)

    # The dynamic loss scale's load moves the saved scale with `.cuda(current_device())`: on CPU it stays.
    grad_scaler = importlib.import_module("megatron.core.optimizer.grad_scaler")
    replace_once(grad_scaler.DynamicGradScaler, "load_state_dict", under(cuda_is_identity))


def patch_torch_adam() -> None:
    """Library fix (every device): megatron-core's DistributedOptimizer with torch Adam."""
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")

    # Without TE/Apex the inner optimizer is torch Adam, whose per-parameter state has a "step"
    # tensor. The fully-reshardable load skips "step" on purpose (it is restored from the param
    # groups) but then copies every destination key: KeyError 'step'. Copy the keys it has.
    def _set_main_param_and_optimizer_states(orig):
        def patched(self, model_param, tensors):
            if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or not _is_torch_adam(self.optimizer):
                return orig(self, model_param, tensors)
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main_param, **self.optimizer.state[main_param]}
            for key, value in tensors.items():
                dst[key].copy_(value)
        return patched

    # Same fallback: `state_dict()` reads the per-parameter torch Adam "step", which does not exist
    # before the first step (loading a checkpoint into a fresh run): AssertionError. Give empty
    # states the values torch Adam would create on its first step (zeros, step 0): numerically the
    # same optimizer, and the load then overwrites them.
    def state_dict(orig):
        def patched(self, *args, **kwargs):
            opt = self.optimizer
            if _is_torch_adam(opt):
                for p in (p for group in opt.param_groups for p in group["params"] if len(opt.state[p]) == 0):
                    opt.state[p].update(step=torch.tensor(0.0, dtype=torch.float32),
                                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
            return orig(self, *args, **kwargs)
        return patched

    # Same fallback, on load: one `step` tensor object is put into every parameter's state, and
    # torch Adam increments it in place once per parameter: after a resume the bias correction
    # uses step + number of parameters (silently different updates). Give each state its own copy.
    def load_state_dict(orig):
        def patched(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            if not _is_torch_adam(self.optimizer):
                return out
            for st in self.optimizer.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].detach().clone()
            return out
        return patched

    for make in (_set_main_param_and_optimizer_states, state_dict, load_state_dict):
        replace_once(distrib.DistributedOptimizer, make.__name__, make)


def patch_mixed_dtype_groups() -> None:
    """Library fix (every device): fp32 parameters beside fp16/bf16 ones in one optimizer
    (megatron-core's torch norms keep fp32 weights whatever `params_dtype`; docs/compat.md)."""
    opt_mod = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")

    # DistributedOptimizer: `model_param_group_index_map` is built in grad-buffer order, then each
    # group's params are installed as [*fp32 shards, *fp32-from-float16 shards]: in a group mixing
    # dtypes the map names other params' states (a save crashes or files states under wrong keys).
    # Rebuild it in the installed order (a no-op for single-dtype groups).
    def __init__(orig):
        def patched(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            for g, (fp32, f16) in enumerate(zip(self.model_fp32_groups, self.model_float16_groups)):
                for i, p in enumerate([*fp32, *f16]):
                    self.model_param_group_index_map[p] = (g, i)
        return patched

    # Float16OptimizerWithFloat16Params numbers the optimizer state's params by the float16 params
    # alone, but the inner optimizer holds the fp32 ones too, in model order: "Param id N does not
    # match any model sharded param". Number them in the optimizer's order, each main copy by its
    # model param, and pair the fp32 main copies with the float16 params' ids only.
    def sharded_state_dict(orig):
        def patched(self, model_sharded_state_dict, is_loading=False, metadata=None):
            if self.is_stub_optimizer or not any(self.fp32_from_fp32_groups):
                return orig(self, model_sharded_state_dict, is_loading, metadata)
            if is_loading:
                self.init_state_fn(self.optimizer, self.config)
            state_dict = self.state_dict()
            model_of = {id(main): model for mains, models in zip(self.fp32_from_float16_groups, self.float16_groups)
                        for main, model in zip(mains, models)}
            in_order = [model_of.get(id(p), p) for g in self.optimizer.param_groups for p in g["params"]]
            id_map = opt_mod.get_param_id_to_sharded_param_map(model_sharded_state_dict, in_order)
            # (a dict by group: dist_checkpointing cannot merge back a list holding an empty list)
            state_dict["fp32_from_fp16_params"] = {
                g: [opt_mod.make_sharded_optimizer_tensor(id_map[pid], main, prefix="optimizer.state.fp32_param")
                    for pid, main in zip([pid for pid, p in zip(ids["params"], group["params"]) if id(p) in model_of],
                                         mains)]
                for g, (mains, ids, group) in enumerate(zip(state_dict["fp32_from_fp16_params"],
                                                            state_dict["optimizer"]["param_groups"],
                                                            self.optimizer.param_groups))}
            step = self._extract_common_per_param_step(state_dict["optimizer"])
            opt_mod.optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
            if step:
                state_dict["optimizer"]["state"]["common_step"] = step
            return state_dict
        return patched

    def load_state_dict(orig):
        def patched(self, state_dict):
            mains = state_dict.get("fp32_from_fp16_params")
            if isinstance(mains, dict):  # saved by the patched sharded_state_dict above
                state_dict = {**state_dict, "fp32_from_fp16_params": [mains[g] for g in sorted(mains)]}
            return orig(self, state_dict)
        return patched

    init = distrib.DistributedOptimizer.__init__
    if not getattr(init, "__mixed_dtype_fix__", False):  # (its own mark: the CPU type-name wrap goes around it)
        distrib.DistributedOptimizer.__init__ = functools.wraps(init)(__init__(init))
        distrib.DistributedOptimizer.__init__.__mixed_dtype_fix__ = True
    for make in (sharded_state_dict, load_state_dict):
        replace_once(opt_mod.Float16OptimizerWithFloat16Params, make.__name__, make)
