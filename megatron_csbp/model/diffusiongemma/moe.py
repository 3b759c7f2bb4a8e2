"""The DiffusionGemma feed-forward block: a dense GeGLU MLP in parallel with routed experts.

With r the residual stream after attention:
  h1 = post_dense_norm(dense(pre_dense_norm(r)))
  router: softmax_fp32(proj(rmsnorm_noscale(r) * scale * hidden^-0.5)), top-k, renormalised,
          times per_expert_scale[expert]  (no bias, no auxiliary loss)
  h2 = post_experts_norm(sum_k w_k * expert_k(pre_experts_norm(r)))
  returns h1 + h2   (the layer adds post_feedforward_norm(h1 + h2) to r)

It is a Megatron `MoELayer` (token dispatchers, expert parallelism, SequentialMLP / grouped
experts all Megatron's) with the dense branch and the four branch norms as extra submodules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_csbp.model.diffusiongemma.norms import rms_normalize


class DiffusionGemmaRouter(TopKRouter):
    """Megatron's top-k softmax router (top-k of the logits, softmax over the k, which equals the
    renormalised top-k of the full softmax) with Gemma's input scaling and per-expert scale."""

    def __init__(self, config, pg_collection=None, **kwargs):
        # kwargs: handed to `TopKRouter` as is (megatron-core 0.19's MoELayer adds `is_mtp_layer=`).
        super().__init__(config=config, pg_collection=pg_collection, **kwargs)
        if config.moe_router_pre_softmax or config.moe_router_score_function != "softmax":
            raise ValueError("DiffusionGemma routing is softmax over the top-k logits (moe_router_pre_softmax=False)")
        if self.is_aux_loss_enabled() or config.moe_z_loss_coeff or config.moe_router_enable_expert_bias:
            raise ValueError("DiffusionGemma routing has no auxiliary loss, z-loss or expert bias")
        if config.moe_expert_capacity_factor is not None:
            raise ValueError("token dropping changes DiffusionGemma's routing")
        if config.moe_input_jitter_eps:
            raise ValueError("router input jitter is not part of DiffusionGemma")
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))
        for p in (self.scale, self.per_expert_scale):
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        self.input_scale = config.hidden_size ** -0.5
        self.eps = config.layernorm_epsilon

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype))

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        x = rms_normalize(input, self.eps).type_as(input) * self.scale * self.input_scale
        probs, routing_map = super().forward(x, padding_mask=padding_mask)
        # probs is [tokens, experts], zero off the routing map.
        probs = probs * self.per_expert_scale.to(probs.dtype)[None, :]
        return probs, routing_map


@dataclass
class DiffusionGemmaMoESubmodules(MoESubmodules):
    dense: Union[ModuleSpec, type] = None
    pre_dense_layernorm: Union[ModuleSpec, type] = None
    post_dense_layernorm: Union[ModuleSpec, type] = None
    pre_experts_layernorm: Union[ModuleSpec, type] = None
    post_experts_layernorm: Union[ModuleSpec, type] = None


class DiffusionGemmaMoELayer(MoELayer):
    def __init__(self, config, submodules: DiffusionGemmaMoESubmodules, **kwargs):
        if config.moe_shared_expert_intermediate_size is not None:
            raise ValueError("DiffusionGemma's dense branch is its own submodule, not a Megatron shared expert")
        # kwargs: the rest of what the transformer layer passes (layer_number, pg_collection; megatron-core
        # 0.19 adds `is_mtp_layer=` and `name=`), handed to `MoELayer` as is.
        super().__init__(config=config, submodules=submodules, **kwargs)
        self.dense = build_module(submodules.dense, config=config, tp_group=self.tp_group)
        for name in ("pre_dense_layernorm", "post_dense_layernorm", "pre_experts_layernorm", "post_experts_layernorm"):
            setattr(self, name, build_module(getattr(submodules, name), config=config, hidden_size=config.hidden_size,
                                             eps=config.layernorm_epsilon))

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise ValueError("partial CUDA-graph MoE execution is not supported for DiffusionGemma")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            # As MoELayer: the token dispatchers assume sequence-parallel shards under TP.
            raise ValueError("MoE with tensor parallelism needs --sequence-parallel")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        residual = hidden_states.contiguous()
        dense_out, dense_bias = self.dense(self.pre_dense_layernorm(residual))
        assert dense_bias is None
        h1 = self.post_dense_layernorm(dense_out)

        probs, routing_map = self.route(residual, padding_mask)
        expert_in, probs = self.preprocess(self.pre_experts_layernorm(residual).contiguous(), probs, routing_map)
        dispatched, probs = self.dispatch(expert_in, probs)
        expert_out, _ = self.routed_experts_compute(dispatched, probs)
        h2 = self.post_experts_layernorm(self.postprocess(self.combine(expert_out), None))
        return h1 + h2, None
