"""megatron-core's Column/RowParallelLinear with a LoRA adapter: `y = base(x) + B(A(dropout(x))) * alpha / r`.

The base weight keeps its name (`M.weight`); the adapter adds `M.lora_A` [r, in] and `M.lora_B` [out, r]
(full shapes), placed like the base weight under tensor parallelism: a column layer shards B's rows
like its weight (stride 2 for SwiGLU's fc1) and replicates A; a row layer shards A's columns and
replicates B, the rank-r product reduced over TP before B. Under sequence parallelism only the
rank-r activations cross ranks. The collectives and why: docs/lora.md.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes


def _tp_size(group) -> int:
    return group.size() if group is not None and torch.distributed.is_initialized() else 1


def expert_tp_a(a: torch.Tensor, group) -> torch.Tensor:
    """A as an expert-TP rank's `x @ A^T` takes it: the input's gradient stays partial (the token
    dispatcher sums it), so A's gradient is summed over the expert-TP `group` (megatron-core's copy to
    the tensor-parallel region: identity forward, all-reduce backward)."""
    return mappings.copy_to_tensor_model_parallel_region(a, group=group) if _tp_size(group) > 1 else a


class _ExpertRowShare(torch.autograd.Function):
    """y / n on each of the n expert-TP ranks (the dispatcher sums their outputs), passing y's full
    gradient back (every rank receives it whole)."""

    @staticmethod
    def forward(ctx, y, n):
        return y / n

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fuse_parts(pieces, groups: Optional[int], dim: int = -1) -> torch.Tensor:
    """A fused module's rows from its parts' (in order): linear_qkv's per query group ([q_g; k_g; v_g]
    for each of `groups`), SwiGLU fc1's [gate; up] (`groups` None)."""
    if groups is None:
        return torch.cat(pieces, dim)
    dim = dim % pieces[0].dim()
    split = [p.reshape(*p.shape[:dim], groups, p.shape[dim] // groups, *p.shape[dim + 1:]) for p in pieces]
    out = torch.cat(split, dim + 1)
    return out.reshape(*out.shape[:dim], -1, *out.shape[dim + 2:])


def add_adapter_pair(module, shapes, sharded: str, stride: int, weight, suffix: str = "", **factory) -> None:
    """Register `lora_A` and `lora_B` (+ `suffix`) of `shapes` on `module`, zeros (`factory`: dtype,
    device): `sharded` the TP-sharded one (B by rows with `stride`, A by columns), the other replicated;
    reduced over data parallelism like `weight` (expert adapters over the expert data-parallel group)."""
    for name, shape in zip(("lora_A", "lora_B"), shapes):
        p = torch.nn.Parameter(torch.zeros(*shape, **factory))
        if name == sharded:
            set_tensor_model_parallel_attributes(p, True, 0 if name == "lora_B" else 1, stride)
        else:
            set_tensor_model_parallel_attributes(p, False, 0, 1)
        p.allreduce = getattr(weight, "allreduce", True)
        module.register_parameter(name + suffix, p)


def lora_shards(module, group, axes, swiglu: bool, prefix, sharded_offsets, metadata):
    """megatron-core's own sharded state dict of `module` with the TP-sharded (over `group`) tensors in
    `axes` (the adapter's other one replicated over TP, like a bias); `swiglu`: lora_B's rows follow
    fc1's [gate ; up] like the weight."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    sd = make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axes,
                                             sharded_offsets, tp_group=group, dp_cp_group=metadata["dp_cp_group"])
    if swiglu:
        key = f"{prefix}lora_B"
        sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                               (metadata or {}).get("singleton_local_shards", False))
    return sd


class _LoRA:
    """The adapter of both layers: A and B, one of them TP-sharded (`sharded`), both initialised to
    zeros here (lora/init.py draws them by global name once the model is built)."""

    def _add_adapter(self, config, lora, shapes, sharded: str, stride: int, suffix: str = ""):
        self.lora_config, self.lora_scaling = lora, lora.scaling
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        add_adapter_pair(self, shapes, sharded, stride, self.weight, suffix, dtype=config.params_dtype)

    @property
    def lora_world(self) -> int:
        return _tp_size(self.tp_group)


def _part_rows(config, name: str, parts, out: int, gated: bool, world: int):
    """(this rank's rows of each of the fused module's parts, query groups on this rank or None);
    one line where the module is not laid out as the canonical targets assume."""
    if name == "linear_fc1":
        if not gated:
            raise ValueError(f"--lora-target-modules linear_fc1_{parts[0]}: this model's linear_fc1 is not SwiGLU's "
                             "[gate; up] (no --swiglu); adapt linear_fc1")
        return {"gate": out // 2, "up": out // 2}, None
    heads, groups, d = config.num_attention_heads, config.num_query_groups or config.num_attention_heads, \
        config.kv_channels
    if out * world != groups * (heads // groups + 2) * d:
        raise ValueError(f"--lora-target-modules linear_{parts[0]}: this model's linear_qkv is not [q; k; v] per query "
                         "group (e.g. a gated or latent attention); adapt linear_qkv")
    local = groups // world
    return {"q": local * heads // groups * d, "k": local * d, "v": local * d}, local


class LoRAColumnParallelLinear(_LoRA, ColumnParallelLinear):
    """With `lora_parts` (canonical targets, e.g. ("q", "v") of linear_qkv): one adapter per part,
    `lora_A_<part>` [r, in] and `lora_B_<part>` [part rows, r], B's rows the part's rows of the fused
    weight (contiguous per TP rank), its product placed in the part's rows."""

    def __init__(self, input_size, output_size, *, config, init_method, lora, lora_gated: bool = False,
                 lora_parts=(), lora_name: str = "", **kwargs):
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        gated = lora_gated and config.gated_linear_unit
        self.lora_parts, self.lora_stride = tuple(lora_parts), 2 if gated else 1
        rows = {"": self.output_size_per_partition}  # B's rows by adapter suffix ("_q" ...: a part's)
        if self.lora_parts:
            self.lora_rows, self.lora_groups = _part_rows(config, lora_name, self.lora_parts,
                                                          self.output_size_per_partition, gated, self.lora_world)
            rows = {"_" + part: self.lora_rows[part] for part in self.lora_parts}
        for suffix, n in rows.items():
            self._add_adapter(config, lora, ((lora.rank, input_size), (n, lora.rank)), "lora_B",
                              1 if suffix else self.lora_stride, suffix)
            if self.sequence_parallel and not self.explicit_expert_comm and self.lora_world > 1:
                # A's gradient covers this rank's rows only: finalize_model_grads sums it over TP
                getattr(self, "lora_A" + suffix).sequence_parallel = True

    def _lora_u(self, x, a):
        u = F.linear(x, expert_tp_a(a, self.tp_group) if self.explicit_expert_comm else a)
        if self.lora_world > 1 and not self.explicit_expert_comm:
            if self.sequence_parallel:
                u = mappings.gather_from_sequence_parallel_region(u, tensor_parallel_output_grad=True,
                                                                  group=self.tp_group)
            else:
                u = mappings.copy_to_tensor_model_parallel_region(u, group=self.tp_group)
        return u

    def lora_delta(self, x):
        x = self.lora_dropout(x)
        if not self.lora_parts:
            return F.linear(self._lora_u(x, self.lora_A), self.lora_B) * self.lora_scaling
        a = torch.cat([getattr(self, f"lora_A_{p}") for p in self.lora_parts])
        us = self._lora_u(x, a).split(self.lora_config.rank, dim=-1)
        ys = dict(zip(self.lora_parts, (F.linear(u, getattr(self, f"lora_B_{p}")) for u, p in zip(us, self.lora_parts))))
        lead = us[0].shape[:-1]
        pieces = [ys[p] if p in ys else us[0].new_zeros(*lead, rows) for p, rows in self.lora_rows.items()]
        return fuse_parts(pieces, self.lora_groups) * self.lora_scaling

    def forward(self, input_, weight=None, runtime_gather_output=None):
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        output, bias = super().forward(input_, weight, runtime_gather_output=False)
        output = output + self.lora_delta(input_).to(output.dtype)
        if gather:
            output = mappings.gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {"weight": 0, "bias": 0, "lora_B": 0, **{f"lora_B_{p}": 0 for p in self.lora_parts}}
        return lora_shards(self, self.tp_group, axes, self.lora_stride == 2 and not self.lora_parts, prefix,
                           sharded_offsets, metadata)


class LoRARowParallelLinear(_LoRA, RowParallelLinear):
    def __init__(self, input_size, output_size, *, config, init_method, lora, lora_gated: bool = False, **kwargs):
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        self._add_adapter(config, lora, ((lora.rank, self.input_size_per_partition), (output_size, lora.rank)),
                          "lora_A", 1)
        if self.sequence_parallel and not self.explicit_expert_comm and self.lora_world > 1:
            # B's gradient covers this rank's rows only: finalize_model_grads sums it over TP
            self.lora_B.sequence_parallel = True

    def lora_delta(self, x):
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
        u = F.linear(self.lora_dropout(x), self.lora_A)
        world = self.lora_world
        if world > 1:
            if self.sequence_parallel and not self.explicit_expert_comm:
                u = mappings.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
            else:
                u = mappings.reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        y = F.linear(u, self.lora_B) * self.lora_scaling
        if self.explicit_expert_comm and world > 1:
            y = _ExpertRowShare.apply(y, world)  # the dispatcher sums the expert-TP ranks' outputs
        return y

    def forward(self, input_):
        output, bias = super().forward(input_)
        return output + self.lora_delta(input_).to(output.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return lora_shards(self, self.tp_group, {"weight": 1, "lora_A": 1}, False, prefix, sharded_offsets, metadata)
