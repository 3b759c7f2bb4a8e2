"""The cost model and planner: exact work and traffic counts, CLI output, model sources, errors."""
import json
import os

import pytest

from tests.distributed import run_distributed

from megatron_csbp.planner.cli import main
from megatron_csbp.planner.cost import Layout, Workload, estimate
from megatron_csbp.planner.hardware import PRESETS, load_hardware
from megatron_csbp.planner.model_config import LayerShape, ModelConfig, from_hf_config, load_preset
from megatron_csbp.planner.work import mask_pairs, rank_work

GiB = 2 ** 30


def test_mask_pairs_match_the_brief():
    for L, B in ((256, 16), (1024, 64), (96, 32)):
        assert mask_pairs(L, B) == L * (L + B)  # twice causal over L, a quarter of dense 2L x 2L
        # token-causal clean stream: L(L+1)/2 clean pairs
        assert mask_pairs(L, B, "token_causal") == L * B + L * (L - B) // 2 + L * (L + 1) // 2


def test_work_is_balanced_and_sums_to_the_mask():
    L, B = 1024, 16
    total = mask_pairs(L, B)
    for cp, bp in ((4, 1), (4, 4), (2, 4), (1, 4)):
        w = rank_work(L, B, cp, bp, "mirrored", "block_causal", None)
        if bp == 1 or cp == bp:
            assert sum(x.sparse_pairs for x in w) == total
        if cp > 1:
            assert len({x.sparse_pairs for x in w}) == 1  # zigzag / mirrored pairs: exactly balanced
            # rows per rank: noisy L/BP + the ring's clean shard L/CP (2L/P when CP = BP = P)
            assert {x.rows for x in w} == {2 * L // cp if bp == 1 else L // bp + L // cp}
    bp_only = rank_work(L, B, 1, 4, "mirrored", "block_causal", None)
    assert max(x.rows for x in bp_only) > 2 * L // 4  # BP replicates the clean prefix
    contiguous = rank_work(L, B, 4, 4, "contiguous", "block_causal", None)
    assert max(x.sparse_pairs for x in contiguous) > min(x.sparse_pairs for x in contiguous)


def test_window_plan_moves_only_window_rows():
    w = rank_work(1024, 16, 4, 4, "mirrored", "block_causal", 64)
    assert all(x.exchange_rows <= 2 * 63 for x in w)
    full = rank_work(1024, 16, 4, 4, "mirrored", "block_causal", None)
    assert all(x.exchange_rows == 1024 - 256 for x in full)


def _tiny(layers=2, G=2, d=32):
    layer = LayerShape(4, G, d, None, False, 256)
    return ModelConfig("t", 128, 512, tuple([layer] * layers), gated_mlp=False)


@pytest.mark.parametrize("recompute,factor", [("none", 8), ("full", 12)])
def test_traffic_equals_formulas(recompute, factor):
    model, hw = _tiny(layers=3), PRESETS["h100"]
    L, P, G, d, s = 4096, 4, 2, 32, 2
    wl = Workload(L, 32)
    cp = estimate(model, Layout(1, P, 1, 1, 1, recompute), wl, hw, 8)
    cs = estimate(model, Layout(1, P, P, 1, 1, recompute), wl, hw, 8)
    bp = estimate(model, Layout(1, 1, P, 1, 1, recompute), wl, hw, 8)
    assert cp.attn_bytes_per_gpu == 3 * factor * L * G * d * s * (P - 1) // P
    assert cs.attn_bytes_per_gpu * 2 == cp.attn_bytes_per_gpu
    assert bp.attn_bytes_per_gpu == 0
    assert cs.peak_memory_gib <= cp.peak_memory_gib  # CSBP keeps only clean K/V of others
    assert bp.peak_memory_gib > cs.peak_memory_gib  # BP replicates the clean prefix


def test_kv_shared_layers_halve_csbp_traffic_only():
    """K=V layers (V derived from the k projection): CSBP moves the raw k alone, CP still K and V."""
    hw, wl, P = PRESETS["h100"], Workload(4096, 32), 4
    shared = ModelConfig("t", 128, 512, (LayerShape(4, 2, 32, None, True, 256),) * 3, gated_mlp=False)
    cp, cs = (estimate(m, Layout(1, P, bp, 1, 1, "none"), wl, hw, 8) for m, bp in ((shared, 1), (shared, P)))
    plain_cp, plain_cs = (estimate(_tiny(layers=3), Layout(1, P, bp, 1, 1, "none"), wl, hw, 8) for bp in (1, P))
    assert cp.attn_bytes_per_gpu == plain_cp.attn_bytes_per_gpu
    assert cs.attn_bytes_per_gpu * 2 == plain_cs.attn_bytes_per_gpu


def test_nemotron_14b_traffic_matches_paper():
    m = load_preset("nemotron-diffusion-14b")
    wl, hw = Workload(262144, 256), PRESETS["h200"]
    base = estimate(m, Layout(1, 8, 1, 1, 2, "full"), wl, hw, 8)
    csbp = estimate(m, Layout(1, 8, 8, 1, 2, "full"), wl, hw, 8)
    # Closed formula: per layer and pass, CP all-gathers K and V of the other 7/8 of its 2L rows (noisy
    # + clean), CSBP of the L clean rows: rows x 7/8 x 2 (K, V) x G 8 x d 128 x 2 bytes (bf16), over
    # 40 layers and 3 passes (forward, its full-recompute replay, backward's gradients of the same
    # rows): CP 210 GiB and CSBP 105 GiB per GPU per step at L = 256K.
    L, P, layers, G, d = 262144, 8, m.num_layers, 8, 128
    assert (layers, m.layers[0].num_kv_heads, m.layers[0].head_dim) == (40, G, d)
    per_row = 2 * G * d * 2
    formula_cp = layers * 3 * (P - 1) * (2 * L) // P * per_row
    assert formula_cp / GiB == 210.0
    assert base.attn_bytes_per_gpu == pytest.approx(formula_cp, rel=1e-12)
    assert csbp.attn_bytes_per_gpu == pytest.approx(formula_cp / 2, rel=1e-12)  # 105 GiB: the clean rows only


def test_presets_parameter_counts():
    g = load_preset("diffusiongemma-26b-a4b")
    # google/diffusiongemma-26B-A4B-it (design notes, shared/docs/diffusiongemma-notes.md): about 25.3B text
    # parameters, about 3.8B active per token; the preset's count from its config within 0.2B / 0.1B
    assert g.total_params / 1e9 == pytest.approx(25.2, abs=0.2)
    assert g.active_params / 1e9 == pytest.approx(3.8, abs=0.1)
    assert sum(1 for l in g.layers if l.window) == 25 and g.layers[5].head_dim == 512
    # Qwen3-27B-like (planner/models/qwen3-27b-like.json, an assumed shape): untied embedding and LM
    # head 2 x 151936 x 5120, per layer Q and O 2 x 5120 x 40 x 128, K and V 2 x 5120 x 8 x 128,
    # SwiGLU 3 x 5120 x 21504, over 64 layers: 26,721,648,640 weights in matrices (the planner counts
    # matrices; the RMSNorm vectors, 660,480 more, are left out): the "26.7B" of the preset's notes.
    h, layers, heads, groups, d, ffn, V = 5120, 64, 40, 8, 128, 21504, 151936
    dense = 2 * V * h + layers * (2 * h * heads * d + 2 * h * groups * d + 3 * h * ffn)
    assert dense == 26_721_648_640
    assert load_preset("qwen3-27b-like").total_params == dense


def test_hf_config_and_megatron_flags_agree(tmp_path):
    cfg = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
           "intermediate_size": 2816, "vocab_size": 32000, "tie_word_embeddings": False, "hidden_act": "silu"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    common = ["--seq-length", "8192", "--block-size", "32", "--gpus", "4", "--hardware", "h100", "--json"]
    a = tmp_path / "a.json"
    flags = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--group-query-attention",
             "--num-query-groups", "4", "--ffn-hidden-size", "2816", "--swiglu", "--vocab-size", "32000",
             "--untie-embeddings-and-output-weights"]
    import contextlib
    import io
    outs = []
    for src in (["--hf-config", str(p)], flags):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(src + common) == 0
        outs.append(json.loads(buf.getvalue()))
    strip = lambda r: [(l["label"], round(l["step_time_s"], 9), round(l["peak_memory_gib"], 6)) for l in r["layouts"]]
    assert strip(outs[0]) == strip(outs[1])
    assert from_hf_config(cfg).total_params == 4 * (1024 * 1024 * 2 + 1024 * 256 * 2 + 3 * 1024 * 2816) + 2 * 32000 * 1024


def test_cli_json_schema(capsys):
    assert main(["--model", "nemotron-diffusion-3b", "--seq-length", "32768", "--block-size", "64", "--gpus", "8",
                 "--hardware", "h100", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"layouts", "best", "best_baseline"} <= set(r)
    for l in r["layouts"]:
        assert {"tp", "cp", "bp", "ep", "dp", "recompute", "step_time_s", "peak_memory_gib", "attn_bytes_per_gpu",
                "flags"} <= set(l)
        assert l["tp"] * l["pp"] * max(l["cp"], l["bp"]) * l["dp"] == 8
        assert l["peak_memory_gib"] <= PRESETS["h100"].memory_gib
    assert r["best"] == r["layouts"][0]
    assert r["best"]["tokens_per_s"] == pytest.approx(max(l["tokens_per_s"] for l in r["layouts"]), rel=1e-6)
    assert r["best_baseline"]["bp"] == 1
    assert any(f.startswith("--block-parallel-size") for f in r["best"]["flags"])


def test_cli_table_and_errors(capsys, tmp_path):
    assert main(["--model", "diffusiongemma-26b-a4b", "--seq-length", "65536", "--block-size", "256", "--gpus", "16",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "best without block parallelism:" in out and "--block-parallel-size" in out
    assert main(["--model", "nemotron-diffusion-3b", "--seq-length", "1000", "--block-size", "64", "--gpus", "8"]) == 2
    assert "multiple of --block-size" in capsys.readouterr().err
    assert main(["--model", "nope", "--seq-length", "1024", "--block-size", "64", "--gpus", "8"]) == 2
    assert main(["--model", "nemotron-diffusion-3b", "--block-size", "64", "--gpus", "8"]) == 2
    assert "--seq-length" in capsys.readouterr().err
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"name": "x", "warp_speed": 9}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_hardware(str(bad))
    assert main(["--model", "nemotron-diffusion-3b", "--seq-length", "1024", "--block-size", "64", "--gpus", "8",
                 "--hardware", "tpu"]) == 2


def test_cpu_benchmark_traffic_predicted_exactly():
    """Validation (b), the part that must hold exactly: predicted bytes == measured bytes."""
    root = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks")
    if not os.path.exists(os.path.join(root, "cpu.json")):
        pytest.skip("docs/benchmarks/cpu.json not generated")
    from megatron_csbp.planner.validate import bench_validation

    bench = json.load(open(os.path.join(root, "cpu.json")))
    rows = bench_validation(bench, PRESETS["h100"].__class__(**{**PRESETS["h100"].to_dict(), "dtype_bytes": 4}))
    assert rows and all(r["predicted_bytes"] == r["measured_bytes"] for r in rows)


def test_window_plan_matches_the_core():
    """The planner's window-exchange rows equal what the core's static plan receives."""
    from megatron_csbp.layout.exchange import WindowExchangePlan
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry

    for L, B, cp, W, ca in ((1024, 16, 4, 64, "block_causal"), (2048, 32, 4, 300, "token_causal"),
                            (512, 16, 2, 100, "block_causal")):
        layout = SequenceLayout(BlockGeometry(L, B, ca), cp, cp)
        geometry = BlockGeometry(L, B, ca, W)
        predicted = [w.exchange_rows for w in rank_work(L, B, cp, cp, "mirrored", ca, W)]
        core = []
        for r in range(cp):
            members = [layout.rows(x) for x in layout.ring_ranks(r)]
            plan = WindowExchangePlan.build(members, layout.ring_clean_rows(r), geometry, layout.ring_of(r)[1])
            core.append(int(sum(plan.recv_counts)))
        assert predicted == core


# ---- hybrid (Gated DeltaNet) models: issue 16 item 5 ------------------------------------------------

def test_planner_imports_without_torch():
    """The planner runs on a login node: importing its model, search and CLI must not import torch
    (layout metadata is read lazily when a plan is computed)."""
    import subprocess
    import sys

    code = ("import sys, megatron_csbp.planner.cost, megatron_csbp.planner.search, megatron_csbp.planner.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


QWEN3_5_TINY = {"model_type": "qwen3_5", "text_config": {
    "model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 8, "full_attention_interval": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attn_output_gate": True,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "intermediate_size": 96, "vocab_size": 128, "tie_word_embeddings": False,
    "hidden_act": "silu"}}


def test_qwen3_5_config_gives_the_hybrid_preset(tmp_path, capsys):
    """--hf-config on a Qwen3.5 config.json (nested text_config, full_attention_interval): 3 GDN : 1
    attention layers, and the parameter count of transformers' own Qwen3_5ForCausalLM built from the
    same config (less its norm weights, which the planner ignores)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    m = from_hf_config(QWEN3_5_TINY)
    assert [l.is_gdn for l in m.layers] == [True, True, True, False] * 2
    assert m.layers[3].q_gate and m.layers[0].gdn_conv_dim == 2 * 2 * 8 + 4 * 8
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5_TINY["text_config"]))
    hf_params = sum(p.numel() for n, p in hf.named_parameters() if "norm" not in n)
    assert m.total_params == hf_params
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN3_5_TINY))
    assert main(["--hf-config", str(p), "--seq-length", "1024", "--block-size", "64", "--gpus", "2",
                 "--hardware", "h100", "--recompute", "none", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "6 Gated DeltaNet / 2 attention layers" in r["model"]
    assert any("linear_attention" in l["time_breakdown_s"] for l in r["layouts"])
    bad = dict(QWEN3_5_TINY["text_config"], linear_num_value_heads=None, layer_types=["linear_attention"] * 8)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        from_hf_config(bad)


def test_gdn_state_bytes_equal_the_layer_accounting():
    """The planner's per-rank GDN bytes (`gdn_rank_work` + `gdn_bytes_sent`) equal the static
    formula of tests/test_hybrid_layouts.py (itself checked against `traffic_counter()` under CP, BP,
    CSBP, BP = k x CP and TP) on every rank, for several layouts and both ownership schedules."""
    import tests.test_hybrid_layouts as th
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.planner.work import gdn_bytes_sent, gdn_rank_work

    saved = th.L, th.B
    try:
        for L, B, cp, bp, sc, tp in ((32, 4, 2, 1, "mirrored", 1), (32, 4, 2, 2, "mirrored", 1),
                                     (32, 4, 2, 4, "mirrored", 1), (32, 4, 4, 1, "mirrored", 1),
                                     (32, 4, 2, 2, "contiguous", 2), (64, 4, 4, 8, "mirrored", 1),
                                     (128, 8, 4, 4, "contiguous", 1), (32, 4, 1, 2, "mirrored", 1)):
            th.L, th.B = L, B
            layout = SequenceLayout(BlockGeometry(L, B), cp, bp, sc)
            got = [gdn_bytes_sent(w, 4 // tp, 8, 8, (2 * 2 * 8 + 4 * 8) // tp, 4, 4, 4, th.BATCH)[0]
                   for w in gdn_rank_work(L, B, cp, bp, sc, "block_causal")]
            assert got == [th.expected_gdn_forward_bytes(layout, r, tp) for r in range(layout.shard_group_size)]
    finally:
        th.L, th.B = saved


HYBRID_L, HYBRID_B, HYBRID_V = 32, 4, 64


def _hybrid_traffic_rank(rank, world, cases):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.attention.accounting import traffic_counter
    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import BD3LMObjective
    from tests.gdn_helpers import build_hybrid_gpt
    import torch

    install_cpu_compat()
    out = []
    for cp, bp in cases:
        bps.initialize_block_parallel(context_parallel_size=cp, block_parallel_size=bp)
        gpt = build_hybrid_gpt((1, 0, 1), HYBRID_V, HYBRID_L)
        layout = SequenceLayout(BlockGeometry(HYBRID_L, HYBRID_B), cp, bp)
        model = BlockDiffusionModel(gpt, BD3LMObjective(HYBRID_B, mask_token_id=HYBRID_V - 1, seed=3), layout,
                                    bps.get_shard_rank(), bps.get_clean_ring_group())
        tokens = torch.randint(0, HYBRID_V - 1, (1, HYBRID_L), generator=torch.Generator().manual_seed(0))
        counter = traffic_counter()
        counter.reset()
        model(tokens, torch.ones_like(tokens), torch.tensor([0])).loss.backward()
        out.append(dict(rank=bps.get_shard_rank(), per_layer=counter.per_layer(), sent=counter.total_sent))
        counter.reset()
        bps.destroy_block_parallel()
    return out


TRAFFIC_CASES = [(2, 1), (2, 2)]  # (CP, BP): the CP baseline and CSBP on 2 gloo ranks


def _traffic_rank(rank, world, cases):
    return {"hybrid": _hybrid_traffic_rank(rank, world, cases), "drafter": _drafter_traffic_rank(rank, world, cases)}


@pytest.fixture(scope="module")
def two_rank_traffic():
    """One spawn of 2 gloo ranks for both measurement checks (hybrid BDLM and DFlash drafter)."""
    return run_distributed(_traffic_rank, 2, TRAFFIC_CASES)


def test_hybrid_traffic_predicted_exactly_on_two_ranks(two_rank_traffic):
    """Measurement check: a tiny hybrid (GDN, attention, GDN; the shapes of tests/gdn_helpers.py) runs
    one forward + backward on 2 gloo ranks under CP and CSBP; per GDN layer the bytes each rank sends
    (forward and backward, as `traffic_counter()` records them) equal the planner's, and the
    planner's whole-model attention bytes equal the counter's total."""
    from megatron_csbp.planner.work import gdn_bytes_sent, gdn_rank_work

    cases = TRAFFIC_CASES
    results = [r["hybrid"] for r in two_rank_traffic]
    layer = LayerShape(4, 2, 8, gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=8, gdn_value_dim=8, gdn_conv_kernel=4,
                       mlp_ffn=64)
    attn = LayerShape(4, 2, 8, mlp_ffn=64)
    model = ModelConfig("tiny-hybrid", 32, HYBRID_V, (layer, attn, layer))
    hw = PRESETS["h100"].__class__(**{**PRESETS["h100"].to_dict(), "dtype_bytes": 4})
    for i, (cp, bp) in enumerate(cases):
        work = gdn_rank_work(HYBRID_L, HYBRID_B, cp, bp, "mirrored", "block_causal")
        est = estimate(model, Layout(1, cp, bp, 1, 1, "none"), Workload(HYBRID_L, HYBRID_B), hw, 8)
        for per_rank in results:
            r = per_rank[i]
            fwd, bwd = gdn_bytes_sent(work[r["rank"]], 4, 8, 8, 64, 4, 4, 4)
            assert fwd > 0 and bwd > 0
            for gdn_layer in (1, 3):
                got = r["per_layer"][gdn_layer]
                assert (got["forward_sent"], got["backward_sent"]) == (fwd, bwd), ((cp, bp), r["rank"], got)
            assert est.attn_bytes_per_gpu == r["sent"], ((cp, bp), r["rank"], est.attn_bytes_per_gpu, r["sent"])


# ---- the DFlash drafter objective: issue 15 item 6 ----------------------------------------------------

def test_drafter_rows_match_the_dflash_layout():
    """Per rank, the planner's draft rows (anchors x B owned, CP padding included) and context rows
    (the CP ring's zigzag shard; under BP the rank's own needed context) equal what
    `attention/dflash.py` assigns, with one document and with documents of 512 tokens."""
    import torch

    from megatron_csbp.attention.dflash import DFlashLayout
    from megatron_csbp.planner.work import drafter_rank_work

    L, B, A = 2048, 16, 48
    for doc in (None, 512):
        D = doc or L
        a = torch.linspace(1, L - 2, A).round().long().unique()
        starts, pos_starts = (a // D) * D, (torch.arange(L) // D) * D
        for cp, bp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 4), (4, 4)):
            layout = DFlashLayout(L, B, cp, bp)
            want = []
            for r in range(layout.shard_group_size):
                rows = layout.rows(r, a, starts, pos_starts)
                draft = int((~rows.is_clean).sum())
                want.append((draft, len(rows) - draft))
            got = [(w.draft_rows, w.context_rows) for w in drafter_rank_work(L, B, A, cp, bp, doc)]
            assert got == want, (doc, cp, bp, got, want)
            if bp > 1:  # every anchor's block is owned exactly once
                assert sum(d for d, _ in got) == len(a) * B


def test_dflash_objective_errors():
    hw, wl = PRESETS["h100"], Workload(4096, 16, objective="dflash", anchors=32)
    with pytest.raises(ValueError, match="drafter model"):
        estimate(load_preset("nemotron-diffusion-3b"), Layout(), wl, hw, 8)
    with pytest.raises(ValueError, match="--objective dflash"):
        estimate(load_preset("dflash-drafter-muse-glimmer"), Layout(), Workload(4096, 16), hw, 8)


def test_planner_considers_the_512k_drafter_recipe():
    """The shipped 8-GPU 512K drafter recipe: the preset has its shape, and the planner's search over
    the recipe's workload (its L, B, anchors and global batch) evaluates its layout (CP 8 x BP 8,
    all-gather, no recompute), finds it feasible, and emits the recipe's parallel flags for it."""
    from megatron_csbp.launch.recipes import load_recipe
    from megatron_csbp.planner.search import find, plan

    root = os.path.join(os.path.dirname(__file__), "..")
    recipe = load_recipe(os.path.join(root, "examples", "recipes", "dflash_drafter_512k_csbp.yaml"))
    model = load_preset("dflash-drafter-muse-glimmer")
    m = recipe["model"]
    layer = model.layers[0]
    assert (model.num_layers, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.mlp_ffn, layer.window) == (
        m["num_layers"], m["num_attention_heads"], m["num_query_groups"], m["kv_channels"], m["ffn_hidden_size"],
        m["sliding_window"] + 1)
    data, par, obj = recipe["data"], recipe["parallelism"], recipe["objective"]
    wl = Workload(data["seq_length"], data["block_size"], recipe["training"]["global_batch_size"],
                  objective="dflash", anchors=obj["dflash_max_anchors"])
    gpus = recipe["launch"]["nnodes"] * recipe["launch"]["nproc_per_node"]
    result = plan(model, wl, gpus, recipe["launch"]["nproc_per_node"], PRESETS["h100"])
    mine = find(result, cp=par["context_parallel_size"], bp=par["block_parallel_size"],
                transport=par["attention_transport"], recompute="none")
    assert mine is not None and mine["feasible"]
    for flag in (f"--context-parallel-size {par['context_parallel_size']}",
                 f"--block-parallel-size {par['block_parallel_size']}", "--objective dflash",
                 f"--dflash-max-anchors {obj['dflash_max_anchors']}"):
        assert flag in mine["flags"]
    # CSBP receives context rows only (inside the windows), CP every rank's rows: less traffic
    cp_only = find(result, cp=par["context_parallel_size"], bp=1, transport=par["attention_transport"],
                   recompute="none")
    assert mine["attn_bytes_per_gpu"] < cp_only["attn_bytes_per_gpu"]


def _drafter_traffic_rank(rank, world, cases):
    import warnings

    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.attention.accounting import traffic_counter
    from tests.test_dflash_layouts import _run_case

    warnings.simplefilter("ignore")
    out = []
    for cp, bp in cases:
        bps.initialize_block_parallel(context_parallel_size=cp, block_parallel_size=bp)
        shard_group, shard_rank = mpu.get_context_parallel_group(), mpu.get_context_parallel_rank()
        ring = bps.get_clean_ring_group() if bp > 1 else shard_group
        _run_case(cp, bp, "ce", "allgather", "uniform", shard_rank, shard_group, ring)
        out.append((shard_rank, traffic_counter().per_layer()))
        traffic_counter().reset()
        bps.destroy_block_parallel()
    return out


def test_drafter_kv_traffic_predicted_exactly_on_two_ranks(two_rank_traffic):
    """Measurement check of the drafter's K/V traffic: the tiny drafter of tests/test_dflash_layouts.py
    (a sliding layer, W = 12, and a full layer) on 2 gloo ranks under CP and CSBP; per layer the
    K/V rows each rank receives in forward (`traffic_counter()`) equal the planner's exchange rows
    for the anchors the objective sampled, times the K and V bytes of a row."""
    import torch

    from megatron_csbp.model.dflash import DrafterShape
    from megatron_csbp.objectives.dflash import DFlashObjective, document_starts
    from megatron_csbp.planner.work import drafter_work_for
    from tests.test_dflash_layouts import L as DL, SHAPE, _data

    cases = TRAFFIC_CASES
    results = [r["drafter"] for r in two_rank_traffic]
    tokens, loss_mask, doc_ids, *_ = _data()
    sample = DFlashObjective(block_size=4, mask_token_id=5, max_anchors=11, sampling="uniform", gamma=3.0,
                             loss="ce", vocab_chunk=16).sample(tokens, loss_mask, doc_ids, 5)
    shape = DrafterShape(**SHAPE)
    kv_row = 2 * SHAPE["num_query_groups"] * SHAPE["kv_channels"] * 4
    for i, (cp, bp) in enumerate(cases):
        for layer in range(SHAPE["num_layers"]):
            work = drafter_work_for(DL, 4, sample.anchors, sample.doc_starts, document_starts(doc_ids.long()), cp, bp,
                                    shape.window(layer))
            for per_rank in results:
                rank, per_layer = per_rank[i]
                got = per_layer[layer + 1]["forward_received"]
                assert got == work[rank].exchange_rows * kv_row > 0, ((cp, bp), layer, rank, got, work[rank])


def test_cli_model_folder_and_no_fit_exit_nonzero(tmp_path, capsys):
    """`--hf-config DIR` reads DIR/config.json (before: IsADirectoryError); a missing file is one line;
    "no layout fits" exits 1 with one line (before: a table saying so, exit 0)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_TINY))
    common = ["--seq-length", "1024", "--block-size", "64", "--gpus", "2", "--hardware", "h100", "--json"]
    assert main(["--hf-config", str(tmp_path)] + common) == 0
    assert "6 Gated DeltaNet / 2 attention layers" in json.loads(capsys.readouterr().out)["model"]
    assert main(["--hf-config", str(tmp_path / "nope")] + common) == 2
    assert capsys.readouterr().err == (f"error: --hf-config {tmp_path / 'nope'}: no such file (give a config.json "
                                       "or the folder that holds it)\n")
    assert main(["--model", "nemotron-diffusion-14b", "--seq-length", "2097152", "--block-size", "256", "--gpus", "1",
                 "--recompute", "none"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "error: no layout fits in memory (1 layouts evaluated for 1 GPUs, --seq-length 2097152): more GPUs, "
        "--recompute full, or a shorter sequence\n")


def test_readme_example_says_why_its_speedup_is_1x(capsys):
    """README.md's own `plan` example prints 1.000x right after the README quotes 1.2-1.6x: the next line
    says why (before: no line)."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    example = " ".join(readme[readme.index("`python -m megatron_csbp.plan --model"):].split("`")[1].split())
    assert main(example.split()[3:]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "predicted speedup of the best layout over the best baseline: 1.000x"
    assert lines[-1] == (
        "why 1.000x: the step times agree to 0.1 % (attention traffic not hidden behind compute: baseline 0.00 s, "
        "CSBP 0.00 s of a 38.59 s step), so CSBP gains traffic (112.5 vs 225.0 GiB/GPU) and peak memory (119.2 vs "
        "120.2 GiB), not time; the paper's 1.2-1.6x is against its own CP baseline: --baseline reference")
    # against the paper's CP baseline the same example predicts a speedup, and no such line
    assert main(example.split()[3:] + ["--baseline", "reference"]) == 0
    assert not capsys.readouterr().out.splitlines()[-1].startswith("why")
