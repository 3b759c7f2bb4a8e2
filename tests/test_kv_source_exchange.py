"""K=V layers under CSBP move raw k only (a `KVSource`), and each receiver derives K and V.

DiffusionGemma's full layers (and sliding layers with `sliding_k_eq_v`) have V = v_norm(raw k),
K = rope(k_norm(raw k)). The clean exchange then all-gathers / ring-shifts / windowed-all-to-alls
raw k instead of K and V packed; the receiver computes K and V of the received rows at their
layout positions. Checked here:

- the derivation reproduces the owner's K and V bitwise (fp32 and bf16, one rank, real forward);
- loss and parameter gradients under CSBP (all-gather, ring; windowed sliding layers with K=V;
  full-layer recompute) equal one rank, on 2 gloo ranks;
- the bytes each K=V layer records are exactly half of the K+V exchange, by formula, and the
  same run with `exchange_kv_source = False` records the K+V formula;
- TP = 2 with sequence parallelism (fewer KV heads than TP ranks on full layers) x CSBP gives the
  same loss and gradients with the source as with K and V, and half the bytes (4 gloo ranks).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.gradients import EXACT_DTYPE, MOE_TOL, check_close, gradient_error

V, L, B, W, BATCH = 96, 16, 4, 3, 2


def _config(sliding_k_eq_v=False, **kw):
    """float64 unless `params_dtype` says otherwise (the exactness tests: tests/gradients.py)."""
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    kw.setdefault("params_dtype", EXACT_DTYPE)
    return tiny_megatron_config(sliding_window=W, sliding_k_eq_v=sliding_k_eq_v, **kw)


def _gpt(config):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model

    install_cpu_compat()  # Megatron's RNG tracker names CUDA
    model_parallel_cuda_manual_seed(5)
    gpt = diffusion_gemma_model(config, V, 64)
    from megatron_csbp.model.diffusiongemma.tiny import redraw_weights

    redraw_weights(gpt, seed=0)  # random everywhere, norms and scales near 1, distinct layer scalars
    return gpt.train()


def _attentions(gpt):
    from megatron_csbp.model.diffusiongemma.attention import DiffusionGemmaSelfAttention

    return [m for m in gpt.modules() if isinstance(m, DiffusionGemmaSelfAttention)]


def _model(gpt, cp, bp, transport):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import BD3LMObjective

    layout = SequenceLayout(BlockGeometry(L, B, "token_causal"), cp, bp)
    if cp * bp == 1:
        return BlockDiffusionModel(gpt, BD3LMObjective(B, mask_token_id=V - 1, seed=3), layout)
    return BlockDiffusionModel(gpt, BD3LMObjective(B, mask_token_id=V - 1, seed=3), layout,
                               bps.get_shard_rank(), bps.get_clean_ring_group(), transport)


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, V - 1, (BATCH, L), generator=g)
    loss_mask = torch.ones_like(tokens)
    loss_mask[0, :4] = 0
    return tokens, loss_mask, torch.tensor([11, 42])


# ---- one rank: the derivation is the owner's computation ---------------------------------------

def _captured_calls(gpt, model):
    """(layer, key, value, source) of every core attention call of one forward."""
    from megatron_csbp.attention.core_attention import BlockDiffusionAttention
    from megatron_csbp.attention.plan_handles import kv_source_of

    calls = []

    def hook(module, args, kwargs):
        _, key, value = args[:3]
        calls.append((module.layer_number, key.detach(), value.detach(), kv_source_of(value)))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
               for m in gpt.modules() if isinstance(m, BlockDiffusionAttention)]
    try:
        with torch.no_grad():
            model(*_batch())
    finally:
        for h in handles:
            h.remove()
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_derived_k_and_v_equal_the_owners_bitwise(megatron_single_rank, dtype):
    config = _config(sliding_k_eq_v=True, params_dtype=dtype)
    gpt = _gpt(config).to(dtype)
    model = _model(gpt, 1, 1, "allgather")
    calls = _captured_calls(gpt, model)
    assert len(calls) == config.num_layers
    positions = model.plan.local.position
    rows = torch.randperm(len(positions), generator=torch.Generator().manual_seed(1))[:9]  # any subset, any order
    for layer, key, value, source in calls:
        assert source is not None, layer
        assert source.raw.dtype == dtype and key.dtype == dtype
        with torch.no_grad():
            k, v = source.derive(source.raw[rows].contiguous(), positions[rows])
        assert torch.equal(k, key[rows]), (layer, (k - key[rows]).abs().max())
        assert torch.equal(v, value[rows]), layer


def test_layer_rotary_angles_are_the_model_table(megatron_single_rank):
    from megatron_csbp.model.diffusiongemma.config import FULL, SLIDING
    from megatron_csbp.model.diffusiongemma.rotary import GemmaRotaryTables, layer_rotary_angles, select_table
    from megatron_csbp.model.rotary import LayoutRotaryEmbedding

    config = _config()
    table = LayoutRotaryEmbedding(GemmaRotaryTables(config))
    table.positions = torch.tensor([5, 0, 17, 3, 250, 17])
    emb = table()
    for kind in (SLIDING, FULL):
        mine = layer_rotary_angles(config.rope_inv_freq(kind), table.positions)
        assert torch.equal(mine, select_table(emb, kind, config.rotary_half_dims)), kind


def test_no_source_without_k_eq_v_or_under_selective_recompute(megatron_single_rank):
    gpt = _gpt(_config())  # sliding layers have V projections
    calls = _captured_calls(gpt, _model(gpt, 1, 1, "allgather"))
    assert [source is not None for _, _, _, source in calls] == [False, True, False, True]
    gpt = _gpt(_config(sliding_k_eq_v=True, recompute_granularity="selective", recompute_modules=["core_attn"]))
    gpt.train()
    calls = _captured_calls(gpt, _model(gpt, 1, 1, "allgather"))
    assert [source is not None for _, _, _, source in calls] == [False] * 4


# ---- 2 ranks: CSBP with the source equals one rank; bytes are half ------------------------------

def _expected_bytes(cp, bp, rank, config, attention, value_width: int) -> int:
    """Bytes one rank records for one layer over forward + backward when each moved row has
    `value_width` values per KV group (d for raw k, 2d for packed K and V), from the layout sizes
    and the mask predicate (not the exchange plan)."""
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from tests.test_window_exchange import window_rows_oracle

    G = attention.num_query_groups_per_partition
    per_row = BATCH * G * value_width * torch.tensor([], dtype=config.params_dtype).element_size()
    window = attention.core_attention.window
    layout = SequenceLayout(BlockGeometry(L, B, "token_causal"), cp, bp)
    if window is not None and bp > 1:  # CSBP's windowed all-to-all: what is sent and received, both ways
        recv, send = window_rows_oracle(layout, layout.geometry.with_window(window), rank)
        return 2 * (recv + send) * per_row
    # CP moves every member's 2L / P rows, CSBP the clean shards (L / P rows): all-gather +
    # reduce-scatter, or P-1 ring shifts each way: (P-1) shards sent and received, twice
    shard = (2 * L if bp == 1 else L) // cp
    return 4 * (cp - 1) * shard * per_row


def _run(config, cp, bp, transport, send_source=True):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.attention.accounting import traffic_counter

    gpt = _gpt(config)
    for a in _attentions(gpt):
        a.exchange_kv_source = a.k_eq_v and send_source
    model = _model(gpt, cp, bp, transport)
    counter = traffic_counter()
    counter.reset()
    out = model(*_batch())
    out.loss.backward()
    per_layer = {k: sum(v.values()) for k, v in counter.per_layer().items()}
    counter.reset()
    loss = out.loss.detach()
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in gpt.named_parameters()}
    if cp * bp > 1:
        from megatron.core import parallel_state as mpu

        dist.all_reduce(loss, group=bps.get_shard_group())
        for n, p in gpt.named_parameters():
            dist.all_reduce(grads[n], group=bps.get_shard_group())
            if config.sequence_parallel and getattr(p, "sequence_parallel", False):
                dist.all_reduce(grads[n], group=mpu.get_tensor_model_parallel_group())
    expected = {}
    if cp > 1:
        for a in _attentions(gpt):
            d = a.hidden_size_per_attention_head
            expected[a.layer_number] = dict(k_eq_v=a.k_eq_v,
                                             raw=_expected_bytes(cp, bp, bps.get_shard_rank(), config, a, d),
                                             kv=_expected_bytes(cp, bp, bps.get_shard_rank(), config, a, 2 * d))
    return dict(loss=float(loss), grads=grads, per_layer=per_layer, expected=expected)


def _compare(res, ref):
    worst, rel_norm = gradient_error((res["grads"][n], r) for n, r in ref["grads"].items())
    return dict(loss=res["loss"], ref=ref["loss"], worst=worst, rel_norm=rel_norm,
                per_layer=res["per_layer"], expected=res["expected"])


CASES = [  # (sliding K=V, cp, bp, transport, send the source, full-layer recompute)
    (False, 2, 2, "allgather", True, False),
    (False, 2, 2, "ring", True, False),
    (True, 2, 2, "allgather", True, False),
    (True, 2, 2, "ring", True, False),
    (True, 2, 2, "allgather", False, False),  # K and V: the bytes the source halves
    (True, 2, 2, "ring", True, True),
    (True, 2, 1, "allgather", True, False),  # CP baseline: moves K and V whatever the layer offers
]


def _rank(rank, world):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()  # recompute replays Megatron's RNG states, which name CUDA
    refs, out = {}, []
    for sliding_k_eq_v in (False, True):
        bps.initialize_block_parallel()
        refs[sliding_k_eq_v] = _run(_config(sliding_k_eq_v), 1, 1, "allgather")
        bps.destroy_block_parallel()
    for sliding_k_eq_v, cp, bp, transport, send, recompute in CASES:
        bps.initialize_block_parallel(context_parallel_size=cp, block_parallel_size=bp)
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        res = _run(_config(sliding_k_eq_v, **extra), cp, bp, transport, send)
        out.append(_compare(res, refs[sliding_k_eq_v]))
        bps.destroy_block_parallel()
    return out


@pytest.mark.exactness
def test_csbp_with_kv_source_equals_one_rank_and_moves_half_the_bytes():
    results = run_distributed(_rank, 2)
    for case, res in zip(CASES, results[0]):
        print(f"{case}: loss {res['loss']:.12f} (1 rank {res['ref']:.12f}), |g - g1|/|g1| {res['rel_norm']:.2e}, "
              f"worst {res['worst']:.2e}; bytes per layer {res['per_layer']}")
    for per_rank in results:
        for case, res in zip(CASES, per_rank):
            sliding_k_eq_v, cp, bp, transport, send, recompute = case
            # float64 except Megatron's fp32 router softmax: tests/gradients.py (MOE_TOL).
            check_close(res["loss"], res["ref"], res["worst"], res["rel_norm"], MOE_TOL, case)
            for layer, e in res["expected"].items():
                raw_moves = e["k_eq_v"] and send and bp > 1  # CSBP with a source; CP moves K and V
                assert e["raw"] * 2 == e["kv"]
                expected = e["raw"] if raw_moves else e["kv"]
                if recompute:  # the recompute replays the forward: forward bytes twice, backward once
                    expected = expected * 3 // 2
                assert res["per_layer"][layer] == expected, (case, layer, e, res["per_layer"])


# ---- TP = 2 with sequence parallelism x CSBP (4 ranks) ---------------------------------------

def _tp_rank(rank, world):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    out = []
    for transport in ("allgather", "ring"):
        runs = {}
        for send in (True, False):
            bps.initialize_block_parallel(tensor_model_parallel_size=2, context_parallel_size=2, block_parallel_size=2)
            config = _config(True, tensor_model_parallel_size=2, sequence_parallel=True)
            runs[send] = _run(config, 2, 2, transport, send)
            bps.destroy_block_parallel()
        out.append(dict(transport=transport, cmp=_compare(runs[True], runs[False]), kv_bytes=runs[False]["per_layer"]))
    return out


@pytest.mark.exactness
@pytest.mark.slow  # suite budget (docs/testing.md)
def test_tp2_sequence_parallel_csbp_source_equals_k_and_v():
    results = run_distributed(_tp_rank, 4)
    for res in results[0]:
        c = res["cmp"]
        print(f"TP=2+SP, CSBP {res['transport']}: loss {c['loss']:.12f} (K and V {c['ref']:.12f}), "
              f"|dg|/|g| {c['rel_norm']:.2e}, worst {c['worst']:.2e}; bytes per layer {c['per_layer']} (K and V {res['kv_bytes']})")
    for per_rank in results:
        for res in per_rank:
            c = res["cmp"]
            check_close(c["loss"], c["ref"], c["worst"], c["rel_norm"], MOE_TOL, res["transport"])
            for layer, e in c["expected"].items():
                assert c["per_layer"][layer] == e["raw"] and res["kv_bytes"][layer] == e["kv"], (layer, e, res)
