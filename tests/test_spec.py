"""`with_block_diffusion_attention` swaps every core attention of real megatron-core specs."""
import copy
import dataclasses
import functools

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_csbp.attention.core_attention import BlockDiffusionAttention
from megatron_csbp.model.spec import (count_block_attention, swap_core_attention_in_model,
                                      with_block_diffusion_attention)
from tests.megatron_specs import built_class


def core_attentions(node, found=None):
    """Every value held by a `core_attention` field anywhere in a spec tree (partials included)."""
    found = [] if found is None else found
    if isinstance(node, ModuleSpec):
        core_attentions(node.submodules, found)
    elif isinstance(node, functools.partial):
        for x in list(node.args) + list(node.keywords.values()):
            core_attentions(x, found)
    elif isinstance(node, (list, tuple)):
        for x in node:
            core_attentions(x, found)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "core_attention":
                found.append(value)
            else:
                core_attentions(value, found)
    return found


def is_block(x):
    return x is BlockDiffusionAttention or (isinstance(x, functools.partial) and x.func is BlockDiffusionAttention)


def _check_swap(spec, expected):
    before = copy.deepcopy(spec)
    swapped = with_block_diffusion_attention(spec)
    old, new = core_attentions(spec), core_attentions(swapped)
    assert len(old) == len(new) == expected
    assert all(x is DotProductAttention for x in old), "the input spec must not be modified"
    assert all(is_block(x) for x in new)
    assert repr(spec) == repr(before)
    return swapped


def test_local_gpt_spec():
    spec = get_gpt_layer_local_spec()
    swapped = _check_swap(spec, 1)
    # Everything except the core attention is the same module class as before.
    sa_old, sa_new = spec.submodules.self_attention, swapped.submodules.self_attention
    assert sa_new.module is sa_old.module
    assert sa_new.submodules.linear_qkv is sa_old.submodules.linear_qkv
    assert built_class(swapped.submodules.mlp) is built_class(spec.submodules.mlp)


def test_local_moe_and_mla_specs():
    _check_swap(get_gpt_layer_local_spec(num_experts=4), 1)
    _check_swap(get_gpt_layer_local_spec(multi_latent_attention=True), 1)


def test_moe_decoder_block_spec():
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                               moe_layer_freq=[1, 0, 1, 1], moe_router_topk=2, add_bias_linear=False,
                               use_cpu_initialization=True)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    assert len(block.layer_specs) == 4
    swapped = _check_swap(block, 4)
    mlps = [built_class(s.submodules.mlp).__name__ for s in swapped.layer_specs]
    assert mlps == ["MoELayer", "MLP", "MoELayer", "MoELayer"]


def test_transformer_engine_spec():
    """The swap on megatron-core's TE layer specs (dense, QK-norm, MoE): TEDotProductAttention (the
    only TE module the plugin replaces) becomes BlockDiffusionAttention; every other TE module class
    stays, and the input spec is not modified. Without TransformerEngine, megatron-core's TE classes
    are unittest.mock stand-ins (its spec provider imports them that way), so there is nothing real
    to check on CPU: a stated skip, counted in CI's summary; it runs where `pip install
    megatron-csbp[gpu]` installed TE (the GPU machine)."""
    pytest.importorskip("transformer_engine", reason="transformer-engine not installed (GPU extra): megatron-core's "
                                                     "TE classes are mock stand-ins without it")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    for kw in ({}, {"qk_layernorm": True}, {"num_experts": 4}):
        spec = get_gpt_layer_with_transformer_engine_spec(**kw)
        assert core_attentions(spec) == [TEDotProductAttention], kw
        swapped = with_block_diffusion_attention(spec)
        new = core_attentions(swapped)
        assert len(new) == 1 and is_block(new[0]), kw
        sa_old, sa_new = spec.submodules.self_attention, swapped.submodules.self_attention
        assert sa_new.module is sa_old.module
        for name in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
            assert getattr(sa_new.submodules, name) is getattr(sa_old.submodules, name), (kw, name)
        assert built_class(swapped.submodules.mlp) is built_class(spec.submodules.mlp)
        assert core_attentions(spec) == [TEDotProductAttention]  # the input spec is not modified


def test_functools_partial_inside_spec():
    # Newer megatron-core releases put functools.partial objects in specs; the walker looks inside
    # both their keywords and their positional arguments.
    local = get_gpt_layer_local_spec()
    sa = local.submodules.self_attention
    layer = copy.deepcopy(local)
    layer.submodules.self_attention = functools.partial(ModuleSpec, module=sa.module, params=sa.params,
                                                        submodules=copy.deepcopy(sa.submodules))
    layer.submodules.cross_attention = functools.partial(copy.deepcopy, copy.deepcopy(sa))
    swapped = _check_swap(layer, 2)
    built = swapped.submodules.self_attention
    assert isinstance(built, functools.partial) and built.func is ModuleSpec
    assert built().submodules.core_attention is BlockDiffusionAttention
    assert swapped.submodules.cross_attention.func is copy.deepcopy


def test_kernel_choice_and_no_attention():
    spec = with_block_diffusion_attention(get_gpt_layer_local_spec(), kernel="math")
    ca = spec.submodules.self_attention.submodules.core_attention
    assert isinstance(ca, functools.partial) and ca.func is BlockDiffusionAttention and ca.keywords == {"kernel": "math"}
    with pytest.raises(ValueError, match="no core_attention"):
        with_block_diffusion_attention(ModuleSpec(module=torch.nn.Identity))


def test_built_model_and_post_build_fallback(megatron_single_rank):
    from megatron.core.models.gpt import GPTModel

    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               attention_dropout=0.0, hidden_dropout=0.0)
    torch.manual_seed(0)
    swapped = GPTModel(config, with_block_diffusion_attention(get_gpt_layer_local_spec()), vocab_size=64,
                       max_sequence_length=32, position_embedding_type="rope")
    assert count_block_attention(swapped) == 3
    assert not any(isinstance(m, DotProductAttention) for m in swapped.modules())
    # The fallback for builders that overwrite core attention after the spec: same result, and
    # the parameters are untouched (core attention owns none).
    torch.manual_seed(0)
    stock = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=32,
                     position_embedding_type="rope")
    assert count_block_attention(stock) == 0
    names = [n for n, _ in stock.named_parameters()]
    assert swap_core_attention_in_model(stock) == 3
    assert count_block_attention(stock) == 3 and [n for n, _ in stock.named_parameters()] == names
    assert swap_core_attention_in_model(stock) == 0
    for a, b in zip(stock.parameters(), swapped.parameters()):
        assert torch.equal(a, b)
