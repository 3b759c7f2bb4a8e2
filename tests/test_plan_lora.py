"""The planner's LoRA (`plan --lora-rank`, planner/lora.py): adapter parameters per rank, the frozen
base's memory and GEMMs, the paper's DiffusionGemma rows next to full fine-tuning."""
import json
import os
from dataclasses import replace

import pytest

from megatron_csbp.planner.cli import main
from megatron_csbp.planner.cost import Layout, Workload, estimate
from megatron_csbp.planner.hardware import PRESETS
from megatron_csbp.planner.lora import LoRAPlan, adapter_count, adapter_params, layer_kept_bytes
from megatron_csbp.planner.model_config import LayerShape, ModelConfig, load_preset

GiB = 2 ** 30
R = 8


def _moe(layers=2):
    """hidden 64, 4 heads of 16 (2 KV groups), gated dense MLP 96 beside 4 experts of 32, top-2."""
    layer = LayerShape(4, 2, 16, None, False, 96, num_experts=4, topk=2, expert_ffn=32)
    return ModelConfig("moe", 64, 256, tuple([layer] * layers), gated_mlp=True)


def test_adapter_params_per_rank_follow_the_base_sharding():
    """Column-parallel qkv / fc1: A [r, in] whole on every TP rank, B [out / TP, r]; row-parallel
    proj / fc2: A [r, in / TP], B [out, r] whole; experts / EP. Counted by hand for _moe()."""
    m, lora = _moe(), LoRAPlan(R)
    qkv, proj, fc1, fc2 = (64, 4 * 16 + 2 * 2 * 16), (64, 64), (64, 2 * 96), (96, 64)
    efc1, efc2 = (64, 2 * 32), (32, 64)
    for tp, ep in ((1, 1), (2, 1), (2, 2), (4, 4)):
        col = lambda io: R * (io[0] + io[1] / tp)
        row = lambda io: R * (io[0] / tp + io[1])
        dense, expert = adapter_params(m, lora, tp=tp, ep=ep)
        assert dense == 2 * (col(qkv) + row(proj) + col(fc1) + row(fc2))
        assert expert == 2 * 4 / ep * (col(efc1) + row(efc2))
    # full shapes: r (in + out) per adapted linear
    full = sum(R * (a + b) for a, b in (qkv, proj, fc1, fc2)) + 4 * sum(R * (a + b) for a, b in (efc1, efc2))
    assert adapter_count(m, lora) == 2 * full
    only_attn = LoRAPlan(R, ("linear_qkv", "linear_proj"))
    assert adapter_count(m, only_attn) == 2 * sum(R * (a + b) for a, b in (qkv, proj))


def test_frozen_base_runs_two_thirds_of_its_gemms():
    """A trained linear runs 3 GEMMs of its forward's FLOPs (forward, input gradient, weight
    gradient), a frozen one 2 (no weight gradient): 2/3; with full recompute 4 -> 3: 3/4. The
    dense, expert and output-layer terms all; the adapters add their own `lora` term."""
    m, hw = _moe(), PRESETS["h100"]
    for rc, ratio in (("none", 2 / 3), ("full", 3 / 4)):
        lay = Layout(2, 2, 2, 2, 2, rc)
        wl = Workload(2048, 64)
        full, lo = (estimate(m, lay, w, hw, 8) for w in (wl, replace(wl, lora=LoRAPlan(R))))
        assert lo.time["gemm"] == pytest.approx(ratio * full.time["gemm"], rel=1e-12)
        assert lo.time["moe_gemm"] == pytest.approx(ratio * full.time["moe_gemm"], rel=1e-12)
        assert lo.time["output_layer"] == pytest.approx(2 / 3 * full.time["output_layer"], rel=1e-12)
        assert lo.time["lora"] > 0 and "lora" not in full.time
        assert lo.time["attention"] == full.time["attention"]


def test_lora_static_memory_is_weights_plus_the_adapters_training_state():
    """Frozen base: bf16 weights only (2 B each, experts / EP, all / TP); adapters: bf16 weights +
    fp32 main gradients (6 B) and the distributed optimizer's fp32 main copy + Adam m, v (12 B)
    sharded over DP x CP/BP (experts' over that / EP)."""
    m, hw = _moe(), PRESETS["h100"]
    tp, cp, bp, ep, dp = 2, 2, 2, 2, 2
    lay = Layout(tp, cp, bp, ep, dp)
    est = estimate(m, lay, Workload(2048, 64, lora=LoRAPlan(R)), hw, 8)
    D = dp * 2  # DP x shard group (CP = BP = 2: 2 ranks)
    dense, expert = adapter_params(m, LoRAPlan(R), tp=tp, ep=ep)
    base = 2 * (m.dense_params / tp + m.expert_params / (tp * ep))
    want = base + 6 * (dense + expert) + 12 * (dense / D + expert / (D // ep))
    assert est.memory_gib["weights_grads_optimizer"] * GiB == pytest.approx(want, rel=1e-12)
    full = estimate(m, lay, Workload(2048, 64), hw, 8)
    assert full.memory_gib["weights_grads_optimizer"] > est.memory_gib["weights_grads_optimizer"]


def test_kept_activations_per_adapted_linear():
    """Per row: + r for each adapted linear's z (a row-parallel layer's / TP, reduce-scattered under
    SP; experts: per routed copy); a frozen linear without
    adapter keeps no input: qkv and fc1 lose h, fc2 its ffn (proj's input stays: attention keeps it);
    dropout keeps a 1-byte mask of each adapted input."""
    m, s, tp = _moe(), 2, 2
    layer = m.layers[0]
    assert layer_kept_bytes(m, layer, LoRAPlan(R), tp, s) == (1 + 1 / tp + 1 + 1 / tp + 2 * 2) * s * R
    only_qkv = LoRAPlan(R, ("linear_qkv",))
    assert layer_kept_bytes(m, layer, only_qkv, tp, s) == s * R - s * (0 + 64 + 96 + 2 * (64 + 32)) / tp
    with_dropout = LoRAPlan(R, ("linear_qkv",), dropout=0.1)
    assert layer_kept_bytes(m, layer, with_dropout, tp, s) - layer_kept_bytes(m, layer, only_qkv, tp, s) == 64 / tp


def test_pipeline_stages_hold_their_layers_adapters():
    """PP 2: each stage's static memory counts its own layers' adapters (and its frozen weights: the
    embedding on the first, the output layer on the last); the stages' adapters sum to the model's."""
    layer = LayerShape(16, 4, 64, None, False, 4096)
    m, hw, lora = ModelConfig("dense", 1024, 32000, (layer,) * 4), PRESETS["h100"], LoRAPlan(R)
    wl = Workload(4096, 64, global_batch_size=4, lora=lora)
    lay = Layout(1, 2, 2, 1, 1, pp=2)
    est, full = (estimate(m, lay, w, hw, 8) for w in (wl, replace(wl, lora=None)))
    halves = [sum(adapter_params(m, lora, m.layers[i * 2:(i + 1) * 2])) for i in range(2)]
    assert sum(halves) == adapter_count(m, lora)
    static = 2 * (2 * m.layer_dense_params(layer) + m.vocab_size * 1024) + 6 * halves[0] + 12 * halves[0] / 2
    assert est.memory_gib["weights_grads_optimizer"] * GiB == pytest.approx(static, rel=1e-12)
    assert all(a < b for a, b in zip(est.pipeline["stage_peak_gib"], full.pipeline["stage_peak_gib"]))


def _plan_json(capsys, L, *extra):
    rc = main(["--model", "diffusiongemma-26b-a4b", "--seq-length", str(L), "--block-size", "256", "--gpus", "16",
               "--hardware", "h200", "--recompute", "full", "--transports", "allgather", "--lora-rank", "16",
               "--layouts", "DP2/EP2/CP8", "DP2/EP2/CP8/BP8", "--json", *extra])
    out = json.loads(capsys.readouterr().out)
    return rc, out


def test_plan_reports_the_papers_diffusiongemma_rows_with_lora_next_to_full(capsys):
    """The paper's DiffusionGemma 26B-A4B rows (16 H200, DP2/EP2/CP8 -> +BP8, B = 256) at 256K and
    512K with a chunked loss: LoRA's peak is below full fine-tuning's at every layout (the frozen
    base drops 16 of its 18 bytes per parameter), its step shorter (no base weight gradients); at
    512K full fine-tuning does not fit a 141 GB H200 at either layout, LoRA does."""
    for L in (262144, 524288):
        rc, out = _plan_json(capsys, L, "--loss-chunk-rows", "4096")
        assert rc == 0
        assert out["lora"]["adapter_params"] == adapter_count(load_preset("diffusiongemma-26b-a4b"), LoRAPlan(16))
        rows = {l["label"].split(" (")[0]: l for l in out["layouts"] + out["layouts_not_fitting"]}
        assert set(rows) == {"DP2/EP2/CP8", "DP2/EP2/CP8/BP8"}
        for l in rows.values():
            full = l["full_fine_tuning"]
            assert l["feasible"] and l["peak_memory_gib"] < full["peak_memory_gib"] / 1.5
            assert l["step_time_s"] < full["step_time_s"]
            assert full["feasible"] == (L == 262144)
    # the table: both columns side by side
    assert main(["--model", "diffusiongemma-26b-a4b", "--seq-length", "524288", "--block-size", "256", "--gpus", "16",
                 "--hardware", "h200", "--lora-rank", "16", "--loss-chunk-rows", "4096",
                 "--layouts", "DP2/EP2/CP8/BP8"]) == 0
    text = capsys.readouterr().out
    assert "full: step s  peak GiB  fits" in text and "LoRA rank 16" in text and " no" in text


@pytest.mark.parametrize("flags,needle", [
    (["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "q_proj"], "--lora-target-modules q_proj"),
    (["--lora-rank", "-1"], "--lora-rank -1"),
    (["--layouts", "DP3/CP5"], "--layouts DP3/CP5"),
])
def test_bad_lora_flags_are_one_line(capsys, flags, needle):
    rc = main(["--model", "nemotron-diffusion-3b", "--seq-length", "8192", "--block-size", "64", "--gpus", "8",
               *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


# ---- against the real model: the adapters the trainer builds (megatron_csbp.lora) ------------------

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16"]


def _planner_model(c) -> ModelConfig:
    """The planner's shape of a megatron-core TransformerConfig (its attribute names)."""
    d = c.kv_channels or c.hidden_size // c.num_attention_heads
    experts = c.num_moe_experts or 0
    layer = LayerShape(c.num_attention_heads, c.num_query_groups or c.num_attention_heads, d,
                       mlp_ffn=(c.moe_shared_expert_intermediate_size or 0) if experts else c.ffn_hidden_size,
                       num_experts=experts, topk=c.moe_router_topk if experts else 0,
                       expert_ffn=(c.moe_ffn_hidden_size or c.ffn_hidden_size) if experts else 0)
    return ModelConfig("megatron", c.hidden_size, 64, (layer,) * c.num_layers, gated_mlp=c.gated_linear_unit)


def _adapters_built(rank, world_size, runs):
    """Per run: the planner's model of the built config and this rank's adapter elements."""
    from megatron_csbp.lora import is_adapter
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    out = []
    for argv in runs:
        t = Trainer(TrainerConfig.from_args(parse_args(list(argv)))).build()
        model = t.chunks[0]
        out.append((_planner_model(model.bdlm.gpt.config),
                    sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))))
        del t
    return out


def test_adapter_count_equals_the_real_models_dense_and_moe():
    """`plan --lora-rank`'s adapter parameters = the `is_adapter` elements of the model the trainer
    builds with the same flags, for a dense GPT and an MoE (experts adapted too), one rank."""
    from tests.distributed import run_distributed
    from tests.train_helpers import TINY

    lora = ["--lora-rank", "4"]
    runs = [TINY + lora, TINY + MOE + lora, TINY + MOE + lora + ["--lora-target-modules", "linear_qkv", "linear_fc2"]]
    targets = [LoRAPlan(4), LoRAPlan(4), LoRAPlan(4, ("linear_qkv", "linear_fc2"))]
    got = run_distributed(_adapters_built, 1, runs)[0]
    for (model, built), plan in zip(got, targets):
        assert built > 0 and adapter_count(model, plan) == built, (model, plan, built)
    assert got[1][1] > got[0][1]  # the experts' adapters counted


def test_adapters_per_rank_equal_the_real_models_under_tp():
    """Per rank under TP 2 + SP: column A whole, B's rows / 2; row A's columns / 2, B whole; the
    experts' adapters sharded with them over expert TP: the planner's `adapter_params` = the rank's
    `is_adapter` elements."""
    from tests.distributed import run_distributed
    from tests.train_helpers import TINY

    argv = TINY + MOE + ["--lora-rank", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    for (model, built), in run_distributed(_adapters_built, 2, [argv]):
        assert sum(adapter_params(model, LoRAPlan(4), tp=2)) == built, (model, built)


@pytest.mark.slow
def test_adapters_per_rank_equal_the_real_models_under_ep():
    """EP 2: half the experts' adapters on each rank."""
    from tests.distributed import run_distributed
    from tests.train_helpers import TINY

    argv = TINY + MOE + ["--lora-rank", "4", "--expert-model-parallel-size", "2"]
    for (model, built), in run_distributed(_adapters_built, 2, [argv]):
        assert sum(adapter_params(model, LoRAPlan(4), ep=2)) == built, (model, built)


# ---- the benchmark (bench/lora.py): LoRA vs full fine-tuning at the same layout, quick mode -------

def test_lora_benchmark_peak_is_below_full_fine_tunings(tmp_path):
    """`python -m megatron_csbp.bench.lora --quick` (CSBP on 2 ranks, both cases in one run). Why
    LoRA's tensor peak must be lower: at the step's start full fine-tuning holds, per parameter, the
    fp32 weight, its DDP gradient and Adam's m and v (16 B on CPU: no separate main copy), LoRA the
    frozen weight (4 B) and 16 B per adapter parameter, so its static tensors are smaller by exactly
    12 P - 16 A (P base, A adapter parameters); during the step LoRA adds only the adapters' rank-r
    intermediates (and their gradients) and drops the base weight gradients and their Adam update,
    so the peaks differ by at least 12 P - 16 A minus those intermediates."""
    from megatron_csbp.bench import lora as bench

    profile = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "cpu_profile.json")
    assert bench.main(["--quick", "--profile", profile, "--out", str(tmp_path / "lora")]) == 0
    result = json.loads((tmp_path / "lora.json").read_text())
    c = result["config"]
    layer = LayerShape(4, 4, c["hidden_size"] // 4, mlp_ffn=c["ffn_hidden_size"])
    model = ModelConfig("bench", c["hidden_size"], c["vocab_size"], (layer,) * c["num_layers"], gated_mlp=True)
    rows = c["seq_length"]  # CSBP on 2 ranks: 2L / 2 rows per rank
    intermediates = 2 * 4 * c["num_layers"] * rows * c["rank"] * 4  # z and its gradient, 4 linears a layer
    for rk in result["ranks"]:
        full, lo = rk["full"], rk["lora"]
        P, A = full["params"], lo["trained_params"]
        assert A == adapter_count(model, LoRAPlan(c["rank"])) and lo["params"] == P + A
        assert abs(full["static_tensor_bytes"] - lo["static_tensor_bytes"] - (12 * P - 16 * A)) <= 4096
        assert full["peak_tensor_bytes"] - lo["peak_tensor_bytes"] >= 12 * P - 16 * A - intermediates
    assert result["summary"]["ratio"]["peak_tensor_bytes"] < 1
    assert result["summary"]["predicted_ratio"]["peak_tensor_bytes"] < 1  # the planner agrees
    assert (tmp_path / "lora.md").read_text().startswith("# LoRA vs full fine-tuning on CPU")


def test_plan_prints_the_trainers_lora_flags(capsys):
    """The best layout's command line carries the LoRA flags the trainer takes (parsed by it)."""
    from megatron_csbp.training.arguments import parse_args

    assert main(["--model", "nemotron-diffusion-3b", "--seq-length", "8192", "--block-size", "64", "--gpus", "8",
                 "--lora-rank", "8", "--lora-target-modules", "linear_qkv", "linear_fc2", "--lora-dropout", "0.1",
                 "--json"]) == 0
    flags = " ".join(json.loads(capsys.readouterr().out)["best"]["flags"]).split()
    args = parse_args(flags + ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                               "--vocab-size", "64", "--train-iters", "1", "--lr", "1e-3"])
    assert (args.lora_rank, args.lora_target_modules, args.lora_dropout) == (8, ["linear_qkv", "linear_fc2"], 0.1)
