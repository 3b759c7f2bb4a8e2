"""Clean-row logits under sequence parallelism: DiffusionGemma's SFT loss (canvas noisy rows + the
AR loss on clean rows) with TP = 2 and --sequence-parallel equals one rank, loss and every
parameter gradient (gloo, CPU shim).

Under sequence parallelism each TP rank feeds one shard of this rank's rows ([noisy chunk i |
clean chunk i], `shard_major_order`) and the output layer all-gathers the kept rows, so each
shard keeps its noisy chunk plus the chosen clean rows of its clean chunk, padded to one count
(`sequence_parallel_logit_rows`). The SFT batches of `tests/test_diffusiongemma_layouts.py` choose
16 clean rows in shard 0 and 15 in shard 1 (every next-token pair, the default
--encoder-loss-scope all; 9 and 15 with the response targets only; first micro-batch, one sequence
rank): the padding is exercised. Layouts: TP 2 alone (2 ranks); TP 2 x CSBP 2 + 2 and TP 2 x CP 2 (4 ranks), where CP 2's
canvas start 1 would give rank 0 15 noisy and 15 clean rows, so the start moves down to 0
(`SequenceLayout.canvas_layout(row_multiple=TP)`; under CSBP the MoE balance rule already moves
both starts to 0, TP 2 making the expert tensor-parallel group larger than one). Each layout runs
with self-conditioning (sample 0 of each micro-batch draws it) and without (no first pass).
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.gradients import EXACT_DTYPE, MOE_TOL, check_close, gradient_error
from tests.test_diffusiongemma_layouts import B, ENC_W, L_SFT, SFT_SEED, V, _gpt, sft_batches
from tests.test_diffusiongemma_tp import _shard

TP = 2


def _sft_model(gpt, cp, bp, sc=True):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective

    layout = SequenceLayout(BlockGeometry(L_SFT, B, "token_causal"), cp, bp)
    obj = DiffusionGemmaSFTObjective(B, V, seed=SFT_SEED, encoder_loss_weight=ENC_W,
                                     self_conditioning_prob=0.5 if sc else 0.0)
    seq = cp * bp > 1
    model = DiffusionGemmaSFTModel(gpt, obj, layout, shard_rank=bps.get_shard_rank() if seq else 0,
                                   ring_group=bps.get_clean_ring_group() if seq else None)
    return model, obj


def _sft_loss(gpt, cp, bp, sc=True):
    """Two accumulated micro-batches (first response blocks 2 and 1; with `sc` sample 0 of each
    draws self-conditioning); returns (loss, canvas starts)."""
    model, obj = _sft_model(gpt, cp, bp, sc)
    batches = sft_batches()
    denominator = sum(obj.denominator(m) for _, m, _ in batches)
    total = 0.0
    for tokens, loss_mask, index in batches:
        out = model(tokens, loss_mask, index, denominator)
        out.loss.backward()
        total = total + out.loss.detach()
    return total, dict(model.feeder._canvas_starts)


@pytest.fixture(scope="module")
def reference(megatron_single_rank):
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    ref = {}
    for sc in (True, False):
        gpt = _gpt()
        loss, starts = _sft_loss(gpt, 1, 1, sc)
        assert starts == {2: 2, 1: 1}, starts
        grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in gpt.named_parameters()}
        ref[sc] = dict(loss=float(loss), grads=grads)
    ref["state"] = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    path = os.path.join(tempfile.mkdtemp(), "reference.pt")
    torch.save(ref, path)
    return path


def _rank(rank, world, path, cases):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    install_cpu_compat()
    ref = torch.load(path)
    out = []
    for (cp, bp), sc in [(case, sc) for case in cases for sc in (True, False)]:
        bps.initialize_block_parallel(tensor_model_parallel_size=TP, context_parallel_size=cp, block_parallel_size=bp)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        model_parallel_cuda_manual_seed(5)
        config = tiny_megatron_config(sliding_window=3, tensor_model_parallel_size=TP, sequence_parallel=True,
                                      params_dtype=EXACT_DTYPE)
        gpt = diffusion_gemma_model(config, V, 64)
        gpt.load_state_dict({k: _shard(k, ref["state"][k], tp_rank) for k in gpt.state_dict()
                             if not k.endswith("_extra_state")}, strict=False)
        gpt.train()
        loss, starts = _sft_loss(gpt, cp, bp, sc)
        shard_group = bps.get_shard_group() if cp * bp > 1 else None
        if shard_group is not None:
            dist.all_reduce(loss, group=shard_group)
        pairs = []
        for n, p in gpt.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            if shard_group is not None:
                dist.all_reduce(g, group=shard_group)
            if getattr(p, "sequence_parallel", False):  # replicated weight fed by this TP rank's rows only
                dist.all_reduce(g, group=mpu.get_tensor_model_parallel_group())
            pairs.append((g, _shard(n, ref[sc]["grads"][n], tp_rank)))
        worst, rel_norm = gradient_error(pairs)
        out.append(dict(case=(cp, bp), sc=sc, loss=float(loss), ref=ref[sc]["loss"], worst=worst,
                        rel_norm=rel_norm, starts=starts))
        bps.destroy_block_parallel()
    return out


def _check(results, expected_starts):
    for res in results[0]:
        print(f"TP 2 + SP, cp, bp = {res['case']}, {'SC' if res['sc'] else 'no SC'}: loss {res['loss']:.12f} (1 rank {res['ref']:.12f}, "
              f"|diff| {abs(res['loss'] - res['ref']):.1e}), gradients |g - g1|/|g1| {res['rel_norm']:.2e} (all "
              f"parameters), worst per-parameter max|g - g1|/max|g1| {res['worst']:.2e}; canvas starts {res['starts']}")
    for per_rank in results:
        for res in per_rank:
            # float64 except Megatron's fp32 router softmax: tests/gradients.py (MOE_TOL).
            check_close(res["loss"], res["ref"], res["worst"], res["rel_norm"], MOE_TOL, res)
            assert res["starts"] == expected_starts[res["case"]], res


@pytest.mark.exactness
def test_tp2_sequence_parallel_sft_equals_one_rank(reference):
    _check(run_distributed(_rank, 2, reference, [(1, 1)]), {(1, 1): {2: 2, 1: 1}})


@pytest.mark.exactness
@pytest.mark.slow  # suite budget (docs/testing.md)
def test_tp2_sequence_parallel_csbp_and_cp_sft_equal_one_rank(reference):
    # CP 2: start 1 leaves rank 0 with 15 noisy and 15 clean rows, odd for TP 2: moved down to 0.
    # CSBP 2+2: starts kept (TP shards divide the rows; no expert parallelism, nothing to balance).
    _check(run_distributed(_rank, 4, reference, [(2, 2), (2, 1)]), {(2, 2): {2: 2, 1: 1}, (2, 1): {2: 2, 1: 0}})


# ---- metadata --------------------------------------------------------------------------------

def test_sequence_parallel_logit_rows_select_and_order():
    """Simulated shard-major feed, per-shard keep, all-gather, reorder: the requested rows in order."""
    from megatron_csbp.layout.masks import RowMeta
    from megatron_csbp.attention.feed import sequence_parallel_logit_rows, shard_major_order

    for n, c, shards in [(8, 16, 2), (12, 8, 4), (0, 8, 2), (6, 9, 3), (4, 4, 2)]:
        rows = RowMeta.of(torch.arange(n) + 100, torch.arange(c))
        values = torch.arange(n + c) * 10  # a row's value = 10 x its local index
        fed = values[shard_major_order(rows, shards)]
        for seed in range(6):
            g = torch.Generator().manual_seed(seed)
            chosen = torch.randperm(c, generator=g)[: int(torch.randint(0, c + 1, (1,), generator=g))]
            if seed % 2:
                chosen = chosen.sort().values
            logit_rows = torch.cat([torch.arange(n), n + chosen])
            keep, order = sequence_parallel_logit_rows(n, c, logit_rows, shards)
            assert len({len(k) for k in keep}) == 1 and len(keep[0]) >= 1
            shard_rows = fed.view(shards, -1)
            gathered = torch.cat([shard_rows[i][keep[i]] for i in range(shards)])
            assert torch.equal(gathered[order], values[logit_rows]), (n, c, shards, chosen)
    with pytest.raises(ValueError, match="every noisy row"):
        sequence_parallel_logit_rows(4, 4, torch.tensor([1, 0, 5]), 2)


@pytest.mark.parametrize("cp, bp, block", [(2, 1, 3), (1, 1, 3), (2, 2, 3), (1, 2, 3), (2, 1, 4)])
def test_canvas_start_moves_down_until_rows_divide(cp, bp, block):
    """`canvas_layout(first, row_multiple=m)`: the largest placeable start <= first where every
    rank's noisy and clean row counts divide by m (0 when the start-0 layout does)."""
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry

    layout = SequenceLayout(BlockGeometry(8 * block, block, "token_causal"), cp, bp, clean_loss=True)
    assert layout.rows_divide_by(2)
    for first in range(layout.geometry.num_blocks + 1):
        for balanced in (False, True):
            plain = layout.canvas_layout(first, balanced=balanced).canvas_start
            s = layout.canvas_layout(first, balanced=balanced, row_multiple=2).canvas_start
            assert s <= plain and layout.canvas_layout(s, balanced=balanced).canvas_start == s
            assert layout.canvas_layout(s).rows_divide_by(2)
            for t in range(s + 1, plain + 1):  # nothing placeable in between works
                placed = layout.canvas_layout(t, balanced=balanced)
                assert placed.canvas_start != t or not placed.rows_divide_by(2)


@pytest.mark.parametrize("scope,counts", [("all", [16, 15]), ("response", [9, 15])])
def test_sft_batches_exercise_the_padding(scope, counts):
    """The first SFT micro-batch on one sequence rank: 16 chosen clean rows in TP shard 0, 15 in
    shard 1 (every pair, the default --encoder-loss-scope), so shard 1 pads 1 row; 9 and 15 with
    the response targets only, shard 0 padding 6 (the claim of the module docstring)."""
    from megatron_csbp.attention.feed import sequence_parallel_logit_rows
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective

    tokens, loss_mask, index = sft_batches()[0]
    noised = DiffusionGemmaSFTObjective(B, V, seed=SFT_SEED, encoder_loss_scope=scope).noise(tokens, loss_mask, index)
    n = (L_SFT // B - noised.first_canvas_block) * B  # canvas rows; the clean rows are positions 0..L-1
    chosen = torch.nonzero((noised.clean_targets >= 0).any(dim=0)).flatten()
    assert [int((chosen < L_SFT // 2).sum()), int((chosen >= L_SFT // 2).sum())] == counts
    keep, order = sequence_parallel_logit_rows(n, L_SFT, torch.cat([torch.arange(n), n + chosen]), TP)
    assert [len(k) for k in keep] == [n // 2 + max(counts)] * 2 and len(order) == n + sum(counts)
