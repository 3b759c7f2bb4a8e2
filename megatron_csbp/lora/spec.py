"""Adapters through the layer spec: `with_adapters(spec, lora)` replaces every targeted
Column/RowParallelLinear of a spec tree by its LoRA subclass (the base weight keeps its name).

The model builders call `active_transform(spec)` where they swap core attention
(model/spec.py); `adapted(lora, build)` makes the config active while a model is built, then checks
the targets, freezes the base weights and draws the adapters (lora/init.py).
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import functools
from typing import Callable, Optional, Sequence

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_csbp.lora import LoRAConfig, is_adapter, split_target
from megatron_csbp.lora.layers import LoRAColumnParallelLinear, LoRARowParallelLinear

_ACTIVE: contextvars.ContextVar[Optional[LoRAConfig]] = contextvars.ContextVar("lora", default=None)
GROUPED_EXPERTS = ("GroupedMLP", "TEGroupedMLP")
_SUBCLASS = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}


def matches(target: str, path: Sequence[str]) -> bool:
    """`linear_fc1` matches every module of that name; `experts.linear_fc1` those whose parent is `experts`."""
    parts = target.split(".")
    return list(path[-len(parts):]) == parts


def _adapted(value, lora: LoRAConfig, path):
    module = value.module if isinstance(value, ModuleSpec) else value
    parts = lora.parts_for(path) if isinstance(module, type) else None
    if parts is None:
        return None
    if module not in _SUBCLASS:
        if module.__name__.startswith("TE"):
            raise ValueError(f"--lora-rank: {'.'.join(path)} is TransformerEngine's {module.__name__}; LoRA adapts "
                             "megatron-core's local ColumnParallelLinear / RowParallelLinear (use the local layer spec)")
        return None
    params = dict(value.params) if isinstance(value, ModuleSpec) else {}
    params.update(lora=lora, lora_gated=path[-1] == "linear_fc1", **(dict(lora_parts=parts, lora_name=path[-1])
                                                                     if parts else {}))
    return ModuleSpec(module=_SUBCLASS[module], params=params)


def _walk(node, lora: LoRAConfig, path):
    fcs = tuple(fc for fc in ("linear_fc1", "linear_fc2") if any(matches(t, path + [fc]) for t in lora.target_modules))
    grouped = isinstance(node, ModuleSpec) and getattr(node.module, "__name__", "") in GROUPED_EXPERTS
    parts = [t for t in lora.target_modules if split_target(t)[1] and matches(split_target(t)[0], path + ["linear_fc1"])]
    if grouped and parts:
        raise ValueError(f"--lora-target-modules {parts[0]}: grouped experts (--moe-grouped-gemm) take fc1 adapters "
                         "whole, not per part; target linear_fc1 there or use sequential experts")
    if fcs and grouped:
        if node.module.__name__ != "GroupedMLP":
            raise ValueError(f"--lora-rank with --moe-grouped-gemm: TransformerEngine's grouped experts "
                             f"({node.module.__name__}) take no LoRA adapters; LoRA adapts megatron-core's local "
                             "GroupedMLP and sequential experts (use the local layer spec)")
        from megatron_csbp.lora.grouped import GROUPED  # megatron-core 0.16's GroupedMLP (gone in 0.19)

        return ModuleSpec(module=GROUPED[node.module], params=dict(node.params, lora=lora, lora_targets=fcs))
    if isinstance(node, ModuleSpec):
        if node.submodules is not None:
            node.submodules = _walk(node.submodules, lora, path)
        return node
    if isinstance(node, functools.partial):  # newer megatron-core's specs: a module's `submodules` keyword
        return functools.partial(node.func, *(_walk(a, lora, path) for a in node.args),
                                 **{k: _field(v, lora, path if k == "submodules" else path + [k])
                                    for k, v in node.keywords.items()})
    if isinstance(node, (list, tuple)):
        return type(node)(_walk(x, lora, path) for x in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            setattr(node, f.name, _field(getattr(node, f.name), lora, path + [f.name]))
    return node


def _field(value, lora: LoRAConfig, path):
    replacement = _adapted(value, lora, path)
    return replacement if replacement is not None else _walk(value, lora, path)


def with_adapters(spec, lora: LoRAConfig):
    """A copy of `spec` whose targeted parallel linears carry adapters."""
    return _walk(copy.deepcopy(spec), lora, [])


def active_transform(spec):
    """`spec` with adapters when a model is being built under `adapted(...)`, else unchanged."""
    lora = _ACTIVE.get()
    return spec if lora is None else with_adapters(spec, lora)


def check_targets(model: torch.nn.Module, lora: LoRAConfig) -> None:
    """One line for a target no module of `model` matches (of any pipeline stage's chunk: a stage
    may hold no layer of a kind, e.g. a hybrid's stage of Gated DeltaNet layers only)."""
    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel.state import collective_device

    # module paths as the spec names them: a sequential expert's `local_experts.<i>` is no step of the
    # spec's path (experts.linear_fc1 names the experts' fc1 there)
    adapted = [[p for p in n.split(".") if p != "local_experts" and not p.isdigit()]
               for n, m in model.named_modules()
               if isinstance(m, tuple(_SUBCLASS.values())) or "lora_A" in m._parameters]
    found = [any(matches(split_target(t)[0], path) for path in adapted) for t in lora.target_modules]
    if mpu.model_parallel_is_initialized() and mpu.get_pipeline_model_parallel_world_size() > 1:
        group = mpu.get_pipeline_model_parallel_group()
        agreed = torch.tensor(found, dtype=torch.int32, device=collective_device(group))
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
        found = agreed.tolist()
    for target, ok in zip(lora.target_modules, found):
        if not ok:  # (the parallel linears of the model's layers: those a spec builds)
            have = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                     if isinstance(m, tuple(_SUBCLASS)) and n.startswith("decoder.")}))
            raise ValueError(f"--lora-target-modules {target}: the model has no module named {target} "
                             f"(it has {have})")


def adapted(lora: Optional[LoRAConfig], build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    """`build()` with adapters on `lora`'s targets, base frozen, adapters drawn from `seed` by global
    name; `build()` itself when `lora` is None."""
    if lora is None:
        return build()
    token = _ACTIVE.set(lora)
    try:
        model = build()
    finally:
        _ACTIVE.reset(token)
    check_targets(model, lora)
    for name, p in model.named_parameters():  # the base frozen
        if not is_adapter(name):
            p.requires_grad_(False)
    from megatron_csbp.lora.init import draw_adapters

    draw_adapters(model, lora, seed)
    return model
