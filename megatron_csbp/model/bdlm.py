"""`BlockDiffusionModel`: a Megatron `GPTModel` (any spec with the block attention swapped in)
trained as a block diffusion LM.

Per forward it builds this rank's rows from the layout ([owned noisy ; clean]), feeds them with
their shared positions, gets logits for the noisy rows only (a pre-hook on the output layer drops
the clean rows: half the output GEMM, no fp32 logits for them), and returns this rank's partial
loss over the global denominator. Summing it over the shard group gives the full loss.

Objectives may ask for more through their `NoisedBatch` (DiffusionGemma SFT uses all three):
- `first_canvas_block`: noisy rows only for blocks from there on (the layout's `canvas_layout`;
  plans are cached per canvas start, at most `CANVAS_PLAN_CACHE` of them besides the model's own,
  least recently used evicted: each holds its masks' row vectors and tile tables);
- `clean_targets` / `clean_weights` (objective flag `needs_clean_logits`): a loss on clean rows;
  each clean row is counted by one rank of the shard group (`SequenceLayout.clean_loss_positions`)
  and only the counted rows that carry a target in the micro-batch reach the output layer (under
  sequence parallelism: each TP shard keeps its noisy chunk and its chosen clean rows, padded to
  one count for the all-gather; see `sequence_parallel_logit_rows`);
- `self_conditioning` ([b] bool): when any sample draws it, a no-grad first pass gives the noisy
  rows' logits, fed to the second pass as `self_conditioning_logits` (+ the per-sample mask).
The canvas start and whether the first pass runs follow from the samples alone, so every rank of
the shard group (same samples) computes the same; ranks that exchange MoE tokens across
different samples agree on them (MIN / MAX) before any other collective.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu

from megatron_csbp.attention.block_attention import AttentionPlan, plan_for_layout
from megatron_csbp.attention.plan_handles import plan_mask
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.model.rotary import LayoutRotaryEmbedding
from megatron_csbp.model.hybrid import count_gated_delta_layers
from megatron_csbp.model.spec import count_block_attention
from megatron_csbp.objectives.base import Objective
from megatron_csbp.utils.precision import at_least_fp32, compute_dtype, vocab_parallel_cross_entropy


# Canvas plans kept besides the model's own plan (LRU). Each is linear in the local rows (row
# vectors, tile tables), so the bound keeps their total at a few plans' worth.
CANVAS_PLAN_CACHE = 4


@dataclass
class LossOutput:
    loss: torch.Tensor  # this rank's partial loss (already divided by the global denominator)
    num_targets: torch.Tensor  # target rows on this rank
    weighted_sum: torch.Tensor  # sum of w * CE on this rank (before the division)


class BlockDiffusionModel(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module, objective: Objective, layout: SequenceLayout,
                 shard_rank: int = 0, ring_group=None, transport: str = "allgather"):
        super().__init__()
        if count_block_attention(gpt) == 0 and count_gated_delta_layers(gpt) == 0:
            raise ValueError("the GPT model has no BlockDiffusionAttention or BlockDiffusionGatedDeltaNet: build it "
                             "from with_block_diffusion_attention(spec) or model.hybrid.hybrid_block_spec")
        if getattr(gpt, "mtp_process", False):
            raise ValueError("multi-token prediction rolls labels over the CP group: not supported with block diffusion")
        if gpt.position_embedding_type == "rope":
            if not isinstance(gpt.rotary_pos_emb, LayoutRotaryEmbedding):
                gpt.rotary_pos_emb = LayoutRotaryEmbedding(gpt.rotary_pos_emb, compute_dtype(gpt.config.params_dtype))
        elif gpt.position_embedding_type != "none":
            raise ValueError(f"--position-embedding-type {gpt.position_embedding_type} is not supported (use rope or none)")
        objective.check_vocab(gpt.vocab_size)
        if getattr(objective, "needs_clean_logits", False) and not layout.clean_loss:
            layout = replace(layout, clean_loss=True)
        self.gpt, self.objective, self.layout = gpt, objective, layout
        self.shard_rank, self.ring_group, self.transport = shard_rank, ring_group, transport
        if objective.uses_noisy_stream:
            self.plan: AttentionPlan = plan_for_layout(layout, shard_rank, ring_group, transport)
            self.replication = 1
        else:
            self.plan, self.replication = autoregressive_plan(layout, shard_rank, ring_group, transport)
        self._num_logit_rows: Optional[int] = None
        self._logit_rows: Optional[torch.Tensor] = None
        self._logit_order: Optional[torch.Tensor] = None  # gathered output rows -> requested order
        self._sp_shards = self._sequence_parallel_shards(gpt.config)
        if self._sp_shards > 1:
            self.plan.physical_order = shard_major_order(self.plan.local, self._sp_shards)
        # Canvas start -> plan, least recently used first; the model's own plan is never evicted.
        self._canvas_plans: "OrderedDict[int, AttentionPlan]" = OrderedDict({layout.canvas_start: self.plan})
        self._canvas_starts: Dict[int, int] = {}  # first response block -> canvas start (ints, <= blocks)
        self._counted_clean: Dict[int, torch.Tensor] = {}  # canvas start -> counted rows, same keys
        gpt.output_layer.register_forward_pre_hook(self._keep_noisy_rows)
        gpt.output_layer.register_forward_hook(self._order_logit_rows)

    def _keep_noisy_rows(self, module, args):
        if self._logit_rows is not None:
            hidden = args[0].index_select(0, self._logit_rows.to(args[0].device))
        elif self._num_logit_rows is not None:
            hidden = args[0][: self._num_logit_rows]
        else:
            return None
        return (hidden,) + tuple(args[1:])

    def _order_logit_rows(self, module, args, output):
        """Sequence parallelism with `logit_rows`: the all-gathered rows [shard 0's k | shard 1's k
        | ...] -> the requested order, padding dropped."""
        if self._logit_order is None:
            return None
        logits, bias = output
        return logits.index_select(0, self._logit_order.to(logits.device)), bias

    # ---- canvas plans ----------------------------------------------------------------------------
    def canvas_plan(self, first_block: int) -> AttentionPlan:
        """This rank's plan when noisy rows start at block `first_block` (moved down where the
        layout needs it, see `SequenceLayout.canvas_layout`); built once per start and kept in an
        LRU cache of `CANVAS_PLAN_CACHE` plans (the model's own plan always stays)."""
        first_block = int(first_block)
        if first_block in self._canvas_starts:
            s = self._canvas_starts[first_block]
        else:
            layout = self.layout.canvas_layout(first_block, balanced=self._expert_parallel(),
                                               row_multiple=self._sp_shards)
            s = self._canvas_starts[first_block] = layout.canvas_start
        if s not in self._canvas_plans:
            layout = self.layout.canvas_layout(s)
            plan = plan_for_layout(layout, self.shard_rank, self.ring_group, self.transport)
            if self._sp_shards > 1:
                plan.physical_order = shard_major_order(plan.local, self._sp_shards)
            self._canvas_plans[s] = plan
            self._counted_clean[s] = self._counted_clean_rows(layout, plan)
            self._evict_canvas_plans()
        self._canvas_plans.move_to_end(s)
        return self._canvas_plans[s]

    def _evict_canvas_plans(self) -> None:
        own = self.layout.canvas_start
        while len(self._canvas_plans) > CANVAS_PLAN_CACHE + 1:
            oldest = next(s for s in self._canvas_plans if s != own)
            del self._canvas_plans[oldest]
            self._counted_clean.pop(oldest, None)

    def _counted_clean_rows(self, layout: SequenceLayout, plan: AttentionPlan) -> torch.Tensor:
        """Indices (into this rank's clean rows) of the clean rows whose loss this rank counts."""
        clean_pos = plan.local.position[plan.local.is_clean]
        counted = layout.clean_loss_positions(self.shard_rank)
        return torch.nonzero(torch.isin(clean_pos, counted)).flatten()

    def counted_clean_rows(self, plan: AttentionPlan) -> torch.Tensor:
        for s, p in self._canvas_plans.items():
            if p is plan:
                if s not in self._counted_clean:
                    self._counted_clean[s] = self._counted_clean_rows(self.layout.canvas_layout(s), plan)
                return self._counted_clean[s]
        raise KeyError("plan not built by this model")

    @staticmethod
    def agree_with_expert_peers(first_block: int, any_sc: bool):
        """Ranks that exchange tokens in MoE layers (the expert tensor-and-model-parallel group)
        may hold different samples but must issue the same collectives with the same shapes: they
        agree on the earliest canvas block (MIN) and on running the self-conditioning pass (MAX).
        Extra canvas blocks carry no loss and a first pass for a sample without self-conditioning
        is masked out, so the loss is unchanged. Ranks of one shard group hold the same samples
        and draw the same values from (seed, sample index): no collective is needed there."""
        if not (dist.is_initialized() and mpu.model_parallel_is_initialized()):
            return first_block, any_sc
        group = mpu.get_expert_tensor_and_model_parallel_group(check_initialized=False)
        if group is None or dist.get_world_size(group) == 1:
            return first_block, any_sc
        t = torch.tensor([-first_block, int(any_sc)], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(-t[0]), bool(t[1])

    @staticmethod
    def _expert_parallel() -> bool:
        """MoE tokens cross to expert-parallel peers, which may sit at other places of the layout:
        every rank must then hold as many rows as its peers, so canvases are balanced over the
        block-parallel ranks. (Expert-TP peers are TP ranks: they hold the same rows already.)"""
        if not mpu.model_parallel_is_initialized():
            return False
        group = mpu.get_expert_model_parallel_group(check_initialized=False)
        return group is not None and dist.get_world_size(group) > 1

    @staticmethod
    def _sequence_parallel_shards(config) -> int:
        return config.tensor_model_parallel_size if config.sequence_parallel else 1

    def logits(self, input_ids: torch.Tensor, rows, *, plan: Optional[AttentionPlan] = None,
               logit_rows: Optional[torch.Tensor] = None, **model_kwargs) -> torch.Tensor:
        """Logits [b, noisy rows, vocab / TP] of this rank's rows (ids in local row order).

        With sequence parallelism the rows are fed shard-major ([noisy | clean] per TP shard) so
        that every TP rank drops its clean rows alike before the output layer; the gathered logits
        come back in local noisy-row order. `plan` defaults to the model's (canvas start 0);
        `logit_rows` (local row indices: every noisy row in order, then chosen clean rows) picks
        the rows that reach the output layer instead, and the logits come back in that order."""
        plan = self.plan if plan is None else plan
        num_noisy = int((~rows.is_clean).sum())
        positions = rows.position.to(input_ids.device)
        keep, gathered_order = logit_rows, None
        if plan.physical_order is not None:
            if logit_rows is not None:
                per_shard, gathered_order = sequence_parallel_logit_rows(
                    num_noisy, len(rows) - num_noisy, logit_rows, self._sp_shards)
                keep = per_shard[mpu.get_tensor_model_parallel_rank()]
            order = plan.physical_order.to(input_ids.device)
            input_ids, positions = input_ids[:, order], positions[order]
        if self.gpt.position_embedding_type == "rope":
            self.gpt.rotary_pos_emb.positions = positions
        # Logits for the noisy rows only; with no noisy stream (AR) for every row.
        self._num_logit_rows = num_noisy // self._sp_shards if num_noisy else None
        self._logit_rows, self._logit_order = keep, gathered_order
        try:
            return self.gpt(input_ids, positions[None].expand_as(input_ids), attention_mask=plan_mask(plan),
                            **model_kwargs)
        finally:
            self._num_logit_rows = None
            self._logit_rows = self._logit_order = None

    def forward(self, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                sample_index: Optional[torch.Tensor] = None,
                denominator: Optional[torch.Tensor] = None) -> LossOutput:
        b, L = tokens.shape
        if L != self.layout.geometry.seq_length:
            raise ValueError(f"batch has sequence length {L}, the layout was built for --seq-length "
                             f"{self.layout.geometry.seq_length}")
        if loss_mask is None:
            loss_mask = torch.ones_like(tokens)
        if sample_index is None:
            sample_index = torch.arange(b)
        if denominator is None:
            denominator = self.objective.denominator(loss_mask)
        noised = self.objective.noise(tokens, loss_mask, sample_index)
        if noised.clean_tokens is not None:
            tokens = noised.clean_tokens
        plan = self.plan
        sc = noised.self_conditioning
        any_sc = sc is not None and bool(sc.any())
        if noised.first_canvas_block is not None or sc is not None:
            first, any_sc = self.agree_with_expert_peers(
                self.layout.canvas_start if noised.first_canvas_block is None else noised.first_canvas_block, any_sc)
            if noised.first_canvas_block is not None:
                plan = self.canvas_plan(first)
        rows = plan.local
        pos = rows.position.to(tokens.device)
        is_clean = rows.is_clean.to(tokens.device)
        input_ids = torch.where(is_clean[None], tokens[:, pos], noised.noisy_tokens[:, pos])
        n = int((~is_clean).sum())
        model_kwargs = {}
        if any_sc and n:
            # Self-conditioning: a detached first pass gives the noisy rows' logits.
            with torch.no_grad():
                first_logits = self.logits(input_ids, rows, plan=plan)
            model_kwargs = dict(self_conditioning_logits=first_logits.detach(), self_conditioning_mask=sc)
        if noised.clean_targets is not None:
            return self._loss_with_clean_rows(noised, plan, pos, n, input_ids, denominator, model_kwargs)
        logits = self.logits(input_ids, rows, plan=plan, **model_kwargs)
        # Target rows: the noisy rows, or (AR) the clean rows.
        target_pos = pos[~is_clean] if self.objective.uses_noisy_stream else pos
        targets = noised.targets[:, target_pos]
        weights = noised.weights[:, target_pos]
        # AR on k replicated clean rings: each ring computes the full loss, so each counts 1/k.
        return self.loss(logits, targets, weights, denominator * self.replication)

    def _loss_with_clean_rows(self, noised, plan, pos, n, input_ids, denominator, model_kwargs) -> LossOutput:
        """One cross entropy over [noisy rows ; counted clean rows with a target]: Megatron's
        vocab-parallel CE works in place on its input, so two calls on slices of the same logits
        would clash in backward."""
        if not self.objective.uses_noisy_stream:
            raise ValueError("clean-row targets need an objective with a noisy stream")
        clean_pos = pos[n:]
        counted = self.counted_clean_rows(plan).to(pos.device)
        has_target = (noised.clean_targets[:, clean_pos[counted]] >= 0).any(dim=0)
        chosen = counted[has_target]
        logit_rows = torch.cat([torch.arange(n, device=pos.device), n + chosen])
        logits = self.logits(input_ids, plan.local, plan=plan, logit_rows=logit_rows, **model_kwargs)
        noisy_pos, target_clean = pos[:n], clean_pos[chosen]
        targets = torch.cat([noised.targets[:, noisy_pos], noised.clean_targets[:, target_clean]], dim=1)
        weights = torch.cat([noised.weights[:, noisy_pos], noised.clean_weights[:, target_clean]], dim=1)
        return self.loss(logits, targets, weights, denominator * self.replication)

    def loss(self, logits, targets, weights, denominator) -> LossOutput:
        """sum(w * CE over target rows) / denominator, vocab-parallel under TP."""
        exclude = self.objective.mask_token_id if self.objective.exclude_mask_from_softmax else None
        return weighted_cross_entropy(logits, targets, weights, denominator, exclude_token=exclude)


def weighted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                           denominator: torch.Tensor, exclude_token: Optional[int] = None) -> LossOutput:
    """sum over target rows (targets >= 0) of w * CE / denominator with Megatron's vocab-parallel
    cross entropy (logits [b, s, V/TP], this rank's vocabulary shard; TP = 1 too).

    `exclude_token` (the absorbing mask token of BD3-LM) is removed from the softmax: its logit is
    -inf on the shard that holds it. Rows that are no target get a placeholder target that is never
    that column (CE of a row whose target logit is -inf is +inf, and +inf x 0 = NaN), and their CE
    is dropped with `where`, not multiplied by 0. A target equal to `exclude_token` is refused: its
    probability is 0 by construction (objectives never make the mask token a target).
    """
    logits_f = at_least_fp32(logits)
    is_target = targets >= 0
    placeholder = 0
    if exclude_token is not None:
        if bool((targets == exclude_token).any()):
            raise ValueError(f"a target equals the mask token {exclude_token}, which is excluded from the softmax: "
                             "the objective must never make the mask token a target")
        logits_f = _exclude_token(logits_f, exclude_token)
        placeholder = 1 if exclude_token == 0 else 0
    safe_targets = torch.where(is_target, targets, torch.full_like(targets, placeholder))
    # Megatron's vocab-parallel CE wants [s, b, V/TP] (works for TP = 1 too) and rewrites its
    # input in place: never hand it a view of the model's own logits.
    logits_sb = logits_f.transpose(0, 1)
    logits_sb = (logits_sb.clone(memory_format=torch.contiguous_format) if logits_sb.data_ptr() == logits.data_ptr()
                 else logits_sb.contiguous())
    ce = vocab_parallel_cross_entropy(
        logits_sb, safe_targets.transpose(0, 1).contiguous()
    ).transpose(0, 1)
    weighted = torch.where(is_target, ce * weights, torch.zeros_like(ce)).sum()
    # A rank whose rows hold no target still returns a loss attached to every parameter.
    loss = weighted / denominator + 0.0 * logits.sum()
    return LossOutput(loss, is_target.sum(), weighted.detach())


def _exclude_token(logits_f: torch.Tensor, token_id: int) -> torch.Tensor:
    """-inf at `token_id` on the tensor-parallel rank whose vocabulary shard holds it."""
    local_vocab = logits_f.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local_vocab if mpu.model_parallel_is_initialized() else 0
    if start <= token_id < start + local_vocab:
        logits_f = logits_f.index_fill(-1, torch.tensor([token_id - start], device=logits_f.device), float("-inf"))
    return logits_f


def autoregressive_plan(layout: SequenceLayout, shard_rank: int, ring_group, transport: str):
    """Clean stream only, token-causal: each ring holds a zigzag copy of the stream (CP ranks), so
    AR runs under every layout. Returns (plan, number of rings that compute the same loss)."""
    g = layout.geometry
    geometry = BlockGeometry(g.seq_length, g.block_size, "token_causal", g.window)
    empty = torch.zeros(0, dtype=torch.long)
    if layout.ring_size == 1:
        plan = AttentionPlan(geometry, RowMeta.of(empty, torch.arange(g.seq_length)))
    else:
        ring_position = layout.ring_of(shard_rank)[1]
        local = RowMeta.of(empty, layout.clean_shard_positions(ring_position))
        shards = layout.ring_clean_rows(shard_rank)
        plan = AttentionPlan(geometry, local, "clean", transport, ring_group, shards, shards, ring_position)
    return plan, layout.shard_group_size // layout.ring_size


def shard_major_order(rows: RowMeta, shards: int) -> torch.Tensor:
    """Physical order for sequence parallelism: shard i holds [noisy chunk i | clean chunk i]."""
    n = int((~rows.is_clean).sum())
    c = len(rows) - n
    if n % shards or c % shards:
        raise ValueError(
            f"--sequence-parallel with --tensor-model-parallel-size {shards} needs this rank's {n} noisy and "
            f"{c} clean rows to divide by {shards} (choose --seq-length/--block-size accordingly)"
        )
    parts = []
    for i in range(shards):
        parts.append(torch.arange(i * n // shards, (i + 1) * n // shards))
        parts.append(n + torch.arange(i * c // shards, (i + 1) * c // shards))
    return torch.cat(parts)


def sequence_parallel_logit_rows(num_noisy: int, num_clean: int, logit_rows: torch.Tensor, shards: int):
    """The rows each TP shard keeps before the output layer when the rows are fed shard-major
    (`shard_major_order`) and `logit_rows` = [every noisy row in local order ; chosen clean rows]
    (local indices) must reach it. Returns (keep, order):

    - keep[i]: indices into shard i's rows: its noisy chunk, then the chosen clean rows of its
      clean chunk (in the given order), then padding (the shard's first row) up to k = the largest
      count over shards, at least 1, so that the sequence-parallel all-gather sees equal sizes;
    - order: indices into the gathered [shards * k] rows giving the logits in `logit_rows` order
      (padding dropped).

    Static metadata of (row counts, chosen rows): every TP rank computes the same, no collective."""
    n, c = int(num_noisy), int(num_clean)
    if n % shards or c % shards:
        raise ValueError(f"{n} noisy and {c} clean rows do not divide by {shards} sequence-parallel shards")
    nc, cc = n // shards, c // shards
    rows = logit_rows.detach().to("cpu", torch.long)
    if len(rows) < n or not torch.equal(rows[:n], torch.arange(n)):
        raise ValueError("under sequence parallelism logit_rows must start with every noisy row in local order")
    clean = rows[n:] - n
    if len(clean) and (int(clean.min()) < 0 or int(clean.max()) >= c):
        raise ValueError(f"logit_rows name clean rows outside [0, {c})")
    if len(torch.unique(clean)) != len(clean):
        raise ValueError("logit_rows name a clean row twice")
    shard_of = torch.div(clean, cc, rounding_mode="floor") if cc else clean
    counts = torch.bincount(shard_of, minlength=shards) if len(clean) else torch.zeros(shards, dtype=torch.long)
    k = max(nc + int(counts.max()), 1)
    keep, clean_slot = [], torch.empty(len(clean), dtype=torch.long)
    for i in range(shards):
        mine = torch.nonzero(shard_of == i).flatten()
        pad = torch.zeros(k - nc - len(mine), dtype=torch.long)
        keep.append(torch.cat([torch.arange(nc), nc + clean[mine] - i * cc, pad]))
        clean_slot[mine] = i * k + nc + torch.arange(len(mine))
    noisy = torch.arange(n)
    noisy_slot = (noisy // nc) * k + noisy % nc if nc else noisy
    return keep, torch.cat([noisy_slot, clean_slot])
