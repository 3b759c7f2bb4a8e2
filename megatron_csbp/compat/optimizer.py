"""megatron-core optimizer call sites that assume CUDA tensors or TE/Apex Adam.

`patch_cpu_optimizers` (device relocation, only without CUDA: CUDA type names, the DP-zero
gather's gloo branch) and `patch_torch_adam` (a library fix on every device; acts only when the
inner optimizer is torch Adam/AdamW, else calls megatron-core's own code). Each call site and its
numerics: docs/compat.md#every-patched-call-site.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys

import torch


_ORIG_TENSOR_TYPE = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _ORIG_TENSOR_TYPE(self)
        return name.replace("torch.", "torch.cuda.", 1)
    return _ORIG_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def cuda_type_names():
    """While active, CPU tensors report `torch.cuda.<T>Tensor` from `.type()`."""
    if torch.Tensor.type is _cuda_named_type:  # nested
        yield
        return
    torch.Tensor.type = _cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = _ORIG_TENSOR_TYPE


def _with_cuda_type_names(fn):
    if getattr(fn, "__cpu_compat__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)

    wrapper.__cpu_compat__ = True
    return wrapper


def _is_torch_adam(opt) -> bool:
    """The inner optimizer is torch's Adam/AdamW: megatron-core's fallback without TE's or apex's
    fused Adam (whose per-parameter state carries a `step` tensor)."""
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))


def patch_cpu_optimizers() -> None:
    """Device relocation (CPU only): CUDA type names, the DP-zero gather's gloo branch."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    wrapped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            if getattr(module, "clip_grad_by_total_norm_fp32", None) is not None and \
                    not getattr(module.clip_grad_by_total_norm_fp32, "__cpu_compat__", False):
                module.clip_grad_by_total_norm_fp32 = wrapped
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    # The non-gloo branch of the DP-zero state gather moves shards with `.cuda()`; on CPU the
    # "NCCL" data-parallel group is gloo anyway, so take the gloo branch (same collectives).
    def get_parameter_state_dp_zero(orig):
        def patched(self, use_gloo_comm=True, *args, **kwargs):
            if self.data_parallel_group_gloo is None:
                self.data_parallel_group_gloo = self.data_parallel_group
            return orig(self, True, *args, **kwargs)
        return patched

    _replace_once(distrib.DistributedOptimizer, "get_parameter_state_dp_zero", get_parameter_state_dp_zero)


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
            if _is_torch_adam(self.optimizer):
                _init_empty_torch_adam_states(self.optimizer)
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
        _replace_once(distrib.DistributedOptimizer, make.__name__, make)


def _replace_once(owner, name: str, make) -> None:
    """`owner.name = make(original)` (wrapped to keep its name and doc), unless already done."""
    orig = getattr(owner, name)
    if getattr(orig, "__cpu_compat__", False):
        return
    patched = functools.wraps(orig)(make(orig))
    patched.__cpu_compat__ = True
    setattr(owner, name, patched)


def _init_empty_torch_adam_states(opt) -> None:
    if not _is_torch_adam(opt):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
                opt.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

