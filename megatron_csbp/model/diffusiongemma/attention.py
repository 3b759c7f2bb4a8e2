"""DiffusionGemma self-attention: Megatron's `SelfAttention` with K=V full layers, a weightless V
norm on every layer and its layer type's rotary table; on K=V layers the value carries a
`KVSource` so CSBP moves raw k only. docs/diffusiongemma.md (the "K=V full layers" row and the
traffic section).
"""
from __future__ import annotations

import functools

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region
from megatron.core.transformer.attention import SelfAttention

from megatron_csbp.attention.block_attention import KVSource
from megatron_csbp.attention.plan_handles import with_kv_source
from megatron_csbp.model.diffusiongemma.norms import WeightlessRMSNorm
from megatron_csbp.model.diffusiongemma.rotary import layer_rotary_angles, select_table
from megatron_csbp.utils.precision import compute_dtype

try:  # the rotary scale Megatron's attention applies (1 unless YaRN)
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config as _rotary_mscale,
    )
except ImportError:  # pragma: no cover - other megatron-core versions
    def _rotary_mscale(config):
        return 1.0


class DiffusionGemmaSelfAttention(SelfAttention):
    def __init__(self, config, submodules, layer_number: int, **kwargs):
        # kwargs: the rest of what the transformer layer passes (attn_mask_type, cp_comm_type, pg_collection;
        # megatron-core 0.19 adds `name=`, the module's dotted name), handed to `SelfAttention` as is.
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        if config.attention_output_gate:
            raise ValueError("attention_output_gate is not part of DiffusionGemma")
        self.layer_kind = config.layer_type(layer_number)
        self.k_eq_v = config.k_eq_v(layer_number)
        self.rotary_half_dims = config.rotary_half_dims
        if self.k_eq_v:
            # No value projection: [q heads of the group ; k] per KV group.
            self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size
            self.linear_qkv = submodules.linear_qkv(
                self.config.hidden_size, self.linear_qkv_out_dim, config=self.config,
                init_method=self.config.init_method, gather_output=False, bias=False, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
        self.v_layernorm = WeightlessRMSNorm(config, self.hidden_size_per_attention_head, eps=config.layernorm_epsilon)
        #: K=V layers hand core attention raw k as the K/V source (CSBP moves it instead of K and V)
        self.exchange_kv_source = self.k_eq_v
        # Within one forward call only: whether this call rotates keys (None outside a call).
        self._call_rotates_keys = None
        self._inv_freq = {}  # this layer kind's rotary inverse frequencies per device (static)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False,
                                    split_qkv: bool = True):
        if output_gate or not split_qkv or key_value_states is not None:
            raise ValueError("DiffusionGemma attention computes split q, k, v for self attention only")
        mixed, _ = self.linear_qkv(hidden_states)
        hn = self.hidden_size_per_attention_head
        q_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        kv_slots = 1 if self.k_eq_v else 2
        if self.config.num_query_groups < self.world_size:
            # Fewer KV groups than TP ranks: gather the groups, keep this rank's (as Megatron does).
            mixed = all_gather_last_dim_from_tensor_parallel_region(mixed)
            idx = parallel_state.get_tensor_model_parallel_rank() // (self.world_size // self.config.num_query_groups)
            size = mixed.size(-1) // self.config.num_query_groups
            mixed = mixed[:, :, idx * size : (idx + 1) * size]
        mixed = mixed.view(*mixed.shape[:-1], self.num_query_groups_per_partition, (q_per_group + kv_slots) * hn)
        parts = torch.split(mixed, [q_per_group * hn] + [hn] * kv_slots, dim=3)
        query = parts[0].reshape(parts[0].size(0), parts[0].size(1), -1, hn)
        key, raw_value = parts[1], parts[-1]  # K=V: the value is k
        if self.config.num_query_groups < self.world_size:
            idx = parallel_state.get_tensor_model_parallel_rank() % (self.world_size // self.config.num_query_groups)
            size = self.num_attention_heads_per_partition // (self.world_size // self.config.num_query_groups)
            query = query[:, :, idx * size : (idx + 1) * size, :]
        query, key, value = self.q_layernorm(query), self.k_layernorm(key), self.v_layernorm(raw_value)
        if self.k_eq_v and self.exchange_kv_source and self._call_rotates_keys is not None:
            with_kv_source(value, KVSource(raw_value, functools.partial(self.derive_kv, rotate=self._call_rotates_keys)))
        return query, key, value

    def derive_kv(self, raw: torch.Tensor, positions: torch.Tensor, rotate: bool = True):
        """(K, V) of K=V rows from raw k [n, b, G, d] at layout `positions` [n]: the same norms and
        the same Megatron rotary function as `forward`, the angles of this layer kind's table at
        those positions (`layer_rotary_angles`, equal to the model's table rows)."""
        key, value = self.k_layernorm(raw), self.v_layernorm(raw)
        if rotate:
            device = raw.device
            if device not in self._inv_freq:
                self._inv_freq[device] = self.config.rope_inv_freq(self.layer_kind).to(device)
            angles = layer_rotary_angles(self._inv_freq[device], positions.to(device))
            angles = angles.to(compute_dtype(self.config.params_dtype))  # as LayoutRotaryEmbedding hands them out
            key = apply_rotary_pos_emb(key, angles, config=self.config, mscale=_rotary_mscale(self.config),
                                       cp_group=self.pg_collection.cp)
        return key, value

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, *args, **kwargs):
        if rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                raise ValueError("DiffusionGemma attention expects the combined rotary tensor, not a (q, k) tuple")
            rotary_pos_emb = select_table(rotary_pos_emb, self.layer_kind, self.rotary_half_dims)
        no_rope = bool(self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1])
        # The K/V source is offered only where this call's keys are plain training/eval keys: not
        # under an inference context (KV caches, flash decode) nor selective core-attention
        # recompute (Megatron detaches q, k, v there, the source would not follow).
        inference = inference_context is not None or kwargs.get("inference_params") is not None
        offer = not inference and not (getattr(self, "checkpoint_core_attention", False) and self.training)
        self._call_rotates_keys = (rotary_pos_emb is not None and not no_rope) if offer else None
        try:
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, *args, **kwargs)
        finally:
            self._call_rotates_keys = None
