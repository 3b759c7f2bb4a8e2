"""LoRA on megatron-core 0.16's grouped experts (`GroupedMLP`, `--moe-grouped-gemm` with the local spec):
per local expert, adapters on its fc1 / fc2 over the grouped GEMM's token splits, named, sharded, drawn
and saved as sequential experts' adapters are (docs/lora.md#grouped-experts)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe import grouped_gemm_util as gg
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

from megatron_csbp.lora import LoRAConfig
from megatron_csbp.lora.layers import _ExpertRowShare, _tp_size, add_adapter_pair, expert_tp_a, lora_shards

FCS = ("linear_fc1", "linear_fc2")


class ExpertAdapter(torch.nn.Module):
    """One local expert's adapter on fc1 (column: A replicated, B sharded over expert TP like the
    expert's fc1 rows, stride 2 for SwiGLU's [gate ; up]) or fc2 (row: A sharded, B replicated)."""

    def __init__(self, lora: LoRAConfig, fc: str, in_features: int, out_features: int, stride: int,
                 group, like: torch.Tensor):
        super().__init__()
        self.sharded = "lora_B" if fc == "linear_fc1" else "lora_A"
        self.stride, self.group = stride, group
        add_adapter_pair(self, ((lora.rank, in_features), (out_features, lora.rank)), self.sharded, stride, like,
                         dtype=like.dtype, device=like.device)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """As the LoRA linear of a sequential expert stores its adapter (lora/layers.py `lora_shards`)."""
        return lora_shards(self, self.group, {self.sharded: 0 if self.sharded == "lora_B" else 1}, self.stride == 2,
                           prefix, sharded_offsets, metadata)


class _ExpertAdapters(torch.nn.ModuleDict):
    """One local expert's adapters (`linear_fc1`, `linear_fc2`): a sequential expert's MLP's names."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {k: v for name, adapter in self.items()
                for k, v in adapter.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata).items()}


class LoRAGroupedMLP(GroupedMLP):
    """GroupedMLP whose experts' fc1 / fc2 (`lora_targets`) carry adapters `local_experts.<i>.<fc>.lora_A
    / lora_B`; the base GEMMs stay grouped (`gg.ops.gmm`), the adapters run per expert in torch ops."""

    def __init__(self, num_local_experts, config, pg_collection=None, *, lora: LoRAConfig,
                 lora_targets: Sequence[str] = FCS):
        super().__init__(num_local_experts, config, pg_collection=pg_collection)
        if self.activation_recompute:
            raise ValueError("--recompute-modules moe_act with --lora-rank: the grouped experts' adapters are not "
                             "recomputed; leave moe_act out of --recompute-modules")
        self.lora_config, self.lora_targets = lora, tuple(lora_targets)
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        world, ffn = _tp_size(self.tp_group), config.moe_ffn_hidden_size
        gated = 2 if config.gated_linear_unit else 1
        sizes = {"linear_fc1": (config.hidden_size, ffn * gated // world, gated, self.weight1),
                 "linear_fc2": (ffn // world, config.hidden_size, 1, self.weight2)}
        self.local_experts = torch.nn.ModuleList(
            _ExpertAdapters({fc: ExpertAdapter(lora, fc, *sizes[fc][:3], self.tp_group, sizes[fc][3])
                             for fc in self.lora_targets}) for _ in range(num_local_experts))

    def _delta(self, fc: str, x: torch.Tensor, splits):
        """The adapters' term of `fc` over the tokens `x` split by expert: B_e A_e x per expert, the
        rank-r product of fc2 reduced over expert TP (lora/layers.py's expert-TP rules)."""
        if fc not in self.lora_targets:
            return 0
        adapters, world, group = [e[fc] for e in self.local_experts], _tp_size(self.tp_group), self.tp_group
        row = fc == "linear_fc2"
        pieces = torch.split(self.lora_dropout(x), splits)
        u = torch.cat([F.linear(xe, ad.lora_A if row else expert_tp_a(ad.lora_A, group))
                       for ad, xe in zip(adapters, pieces)])
        if row and world > 1:
            u = mappings.reduce_from_tensor_model_parallel_region(u, group=group)
        y = torch.cat([F.linear(ue, ad.lora_B) for ad, ue in zip(adapters, torch.split(u, splits))])
        y = y * self.lora_config.scaling
        return _ExpertRowShare.apply(y, world) if row and world > 1 else y  # the dispatcher sums the TP ranks'

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """GroupedMLP.forward with each GEMM's adapter term added before the activation / at the output."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if x.nelement() == 0:  # megatron-core's path; the adapters join with zero gradients
            out, bias = super().forward(x, tokens_per_expert, probs)
            return out + sum(p.sum() for p in self.local_experts.parameters()) * 0, bias
        assert self.config.bf16, "Currently GroupedMLP for MoE only supports bf16."
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)
        splits = tokens_per_expert.tolist()
        w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, self.config.hidden_size)
        h = gg.ops.gmm(x, w1, tokens_per_expert, trans_b=False)
        h = self.activation_func_with_probs(h + self._delta("linear_fc1", x, splits), probs.unsqueeze(-1))
        out = gg.ops.gmm(h, w2, tokens_per_expert, trans_b=False)
        return out + self._delta("linear_fc2", h, splits), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron-core's for the grouped weights; the adapters' as SequentialMLP stores its experts
        (expert axis by global index: a sequential model's keys and shards)."""
        adapters = self._modules.pop("local_experts")  # GroupedMLP's reads every tensor as weight1 or weight2
        try:
            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._modules["local_experts"] = adapters
        sd.update(SequentialMLP.sharded_state_dict(self, prefix, sharded_offsets, metadata))
        return sd


#: megatron-core's grouped experts class -> its LoRA subclass (lora/spec.py swaps it in)
GROUPED = {GroupedMLP: LoRAGroupedMLP}
