"""Swap every `core_attention` in a Megatron layer spec for the block-diffusion one.

Works on any spec tree: GPT local and TransformerEngine layer specs, MoE decoder block specs
(`TransformerBlockSubmodules.layer_specs`), and the `functools.partial` objects that newer
megatron-core releases put inside specs. The input spec is not modified.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_csbp.attention.core_attention import BlockDiffusionAttention
from megatron_csbp.lora.spec import active_transform


def _core_attention(kernel: str):
    return BlockDiffusionAttention if kernel == "auto" else functools.partial(BlockDiffusionAttention, kernel=kernel)


def _swap(node, replacement, counter):
    if isinstance(node, ModuleSpec):
        if node.submodules is not None:
            node.submodules = _swap(node.submodules, replacement, counter)
        return node
    if isinstance(node, functools.partial):
        args = tuple(_swap(a, replacement, counter) for a in node.args)
        keywords = {k: _swap(v, replacement, counter) for k, v in node.keywords.items()}
        return functools.partial(node.func, *args, **keywords)
    if isinstance(node, (list, tuple)):
        return type(node)(_swap(x, replacement, counter) for x in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "core_attention" and value is not None:
                setattr(node, f.name, replacement)
                counter[0] += 1
            else:
                setattr(node, f.name, _swap(value, replacement, counter))
    return node


def with_block_diffusion_attention(spec, kernel: str = "auto"):
    """Return a copy of `spec` with every core attention replaced by `BlockDiffusionAttention`."""
    spec = copy.deepcopy(spec)
    counter = [0]
    spec = _swap(spec, _core_attention(kernel), counter)
    if counter[0] == 0:
        raise ValueError("the layer spec has no core_attention to replace (is it an attention-free spec?)")
    return active_transform(spec)  # LoRA adapters while a model is built with them (lora/spec.py)


def swap_core_attention_in_model(model: torch.nn.Module, kernel: str = "auto") -> int:
    """Fallback for builders that overwrite core attention after the spec (0.19 with
    --attention-backend local, Megatron-Bridge): replace the built modules in place. Core attention
    owns no parameters, so nothing is lost. Returns the number of modules replaced."""
    replaced = 0
    for module in model.modules():
        ca = getattr(module, "core_attention", None)
        if ca is not None and not isinstance(ca, BlockDiffusionAttention):
            module.core_attention = _core_attention(kernel)(
                config=ca.config, layer_number=getattr(ca, "layer_number", getattr(module, "layer_number", 1)),
                attention_type="self", softmax_scale=getattr(ca, "softmax_scale", None),
            )
            replaced += 1
    return replaced


def count_block_attention(model: torch.nn.Module) -> int:
    return sum(isinstance(m, BlockDiffusionAttention) for m in model.modules())
