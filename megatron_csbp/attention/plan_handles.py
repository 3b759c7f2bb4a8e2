"""Plan handles: how an `AttentionPlan` and a `KVSource` ride through Megatron's layer calls.

Megatron's layers pass `attention_mask` and `value` tensors through every path (recompute
detaches and replays inputs, saves them for backward, moves them between devices). The
block-diffusion model hands the plan of this rank as a one-element long tensor holding the plan's
id (`plan_mask`, `plan_from_mask`, `plan_or_none`); the DiffusionGemma attention attaches a K/V
source to the `value` it returns (`with_kv_source`, `kv_source_of`). Layers that need per-row
facts of the plan read them here too (`physical_is_clean`, `local_is_clean`), and the core
attention reads its layer's sliding window from Megatron's settings (`layer_window`).

Size: the id table holds one weak entry per live plan (a few per model), whatever the length.
"""
from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.utils import is_layer_window_attention

if TYPE_CHECKING:  # pragma: no cover
    from megatron_csbp.attention.block_attention import AttentionPlan, KVSource

# Plans are found by an id stored in the mask tensor's value: the value survives everything
# Megatron does to layer inputs (detach in recompute, save_for_backward, device moves).
_PLANS: "weakref.WeakValueDictionary[int, AttentionPlan]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def plan_mask(plan: "AttentionPlan") -> torch.Tensor:
    """A 1-element tensor for Megatron's `attention_mask` argument that identifies `plan`."""
    handle = getattr(plan, "_mask_handle", None)
    if handle is None:
        plan_id = next(_NEXT_ID)
        _PLANS[plan_id] = plan
        handle = torch.tensor([plan_id], dtype=torch.long)
        handle.block_diffusion_plan = plan  # keeps the plan alive as long as the mask is
        plan._mask_handle = handle
    return handle


def plan_or_none(attention_mask) -> Optional["AttentionPlan"]:
    """The block-diffusion plan carried by `attention_mask`, or None for an ordinary mask."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.long and attention_mask.numel() == 1:
        return _PLANS.get(int(attention_mask.item()))
    return None


def plan_from_mask(attention_mask) -> "AttentionPlan":
    plan = plan_or_none(attention_mask)
    if plan is None:
        raise RuntimeError("BlockDiffusionAttention got an ordinary attention mask. Run the model through "
                           "megatron_csbp.model.BlockDiffusionModel, which passes the block layout as the mask.")
    return plan


_KV_SOURCE = "block_diffusion_kv_source"


def with_kv_source(value: torch.Tensor, source: "KVSource") -> torch.Tensor:
    """`value` carrying the K/V source of its rows to `BlockDiffusionAttention` (returns it)."""
    if source.raw.shape[:2] != value.shape[:2]:
        raise ValueError(f"K/V source rows {tuple(source.raw.shape[:2])} do not match value {tuple(value.shape[:2])}")
    setattr(value, _KV_SOURCE, source)
    return value


def kv_source_of(value) -> Optional["KVSource"]:
    """The K/V source attached to `value` by `with_kv_source`, or None."""
    return getattr(value, _KV_SOURCE, None)


def physical_is_clean(plan):
    """is_clean of the rows in the order they are fed (sequence parallelism may feed them
    shard-major, `plan.physical_order`); noisy rows keep their relative plan order either way."""
    order = getattr(plan, "physical_order", None)
    return plan.local.is_clean if order is None else plan.local.is_clean[order]


def local_is_clean(attention_mask, num_rows: int, sequence_parallel: bool):
    """Bool [num_rows] of this rank's rows (after sequence-parallel scattering), or None when the
    mask carries no block-diffusion plan (every row clean)."""
    plan = plan_or_none(attention_mask)
    if plan is None:
        return None
    is_clean = physical_is_clean(plan)
    if sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
        rank = parallel_state.get_tensor_model_parallel_rank()
        is_clean = is_clean[rank * num_rows : (rank + 1) * num_rows]
    if is_clean.numel() != num_rows:
        raise RuntimeError(f"block-diffusion plan has {is_clean.numel()} rows, the layer got {num_rows}")
    return is_clean


def layer_window(config, layer_number: int) -> Optional[int]:
    """Sliding window W (keys q-W < k <= q) of this layer from Megatron's window settings."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right not in (0, -1) and right is not None:
        raise ValueError(f"--window-size right side must be 0 for block diffusion, got {config.window_size}")
    return None if left is None or left < 0 else left + 1
