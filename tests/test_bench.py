"""The CPU benchmark: the CI-sized run (`--quick`) and the byte accounting it reports.

No wall-clock assertions: timings are measured, not tested. What must hold: attention bytes equal
the design-brief formulas exactly, CSBP moves exactly half of CP, BP moves nothing, every layout's
step-0 loss equals the single-rank loss, and the report files are written.
"""
import json
import os

import pytest

from megatron_csbp.bench.__main__ import config_from_args, main, parse_args
from megatron_csbp.bench.cases import BenchModel, Case, cases_for, formula_bytes_sent, quick_config


def test_formulas():
    m = BenchModel(num_layers=3, hidden_size=128, num_attention_heads=4, num_query_groups=2)
    L, G, d, s = 512, 2, 32, 4
    assert formula_bytes_sent(Case("cp", 4, 1), m, L) == 3 * 8 * L * G * d * s * 3 // 4
    assert formula_bytes_sent(Case("csbp", 4, 4), m, L) == 3 * 4 * L * G * d * s * 3 // 4
    assert formula_bytes_sent(Case("csbp2", 2, 4), m, L) == 3 * 4 * L * G * d * s // 2
    assert formula_bytes_sent(Case("bp", 1, 4), m, L) == 0


@pytest.mark.parametrize("which", ["gpt", "lora"])
def test_a_bench_model_is_one_description_for_the_trainer_and_the_planner(which, monkeypatch):
    """A benchmark's model is declared once (`flags()`): the model the trainer builds from its argv
    and the planner's model of the same flags (`from_flags`) agree in every dimension the planner
    counts (heads, K/V heads, head size, FFN, layers, gating, tied embeddings)."""
    from megatron_csbp.bench.cases import trainer_argv
    from megatron_csbp.bench.lora import LoRABench
    from megatron_csbp.planner.model_config import from_flags
    from megatron_csbp.training.arguments import parse_args as trainer_args
    from megatron_csbp.training.config import TrainerConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    if which == "gpt":
        bench = BenchModel(num_layers=3, hidden_size=96, num_attention_heads=6, num_query_groups=3)
        argv = trainer_argv(dict(bench.flags(), mask_token_id=bench.vocab_size - 1)) + ["--mock-data"]
    else:
        bench = LoRABench(num_layers=3, hidden_size=96, ffn_hidden_size=160)
        argv = bench.argv()
    m = TrainerConfig.from_args(trainer_args(argv)).model
    planned = from_flags(bench.flags(), which)
    assert planned.num_layers == m.num_layers and planned.hidden_size == m.hidden_size
    assert planned.gated_mlp == m.swiglu and planned.tied_embeddings == (not m.untie_embeddings_and_output_weights)
    layer = planned.layers[0]
    assert (layer.num_heads, layer.num_kv_heads, layer.mlp_ffn) == (m.num_attention_heads, m.num_query_groups,
                                                                   m.ffn_hidden_size)
    assert layer.head_dim == (m.kv_channels or m.hidden_size // m.num_attention_heads)


def test_cases_include_their_baselines():
    names = [c.name for c in cases_for(4, ("csbp-ring", "bp"))]
    assert "cp-ring" in names and "cp-allgather" in names
    assert [c.name for c in cases_for(1)] == ["single"]
    assert "csbp-2rings" in [c.name for c in cases_for(4)]
    assert "csbp-2rings" not in [c.name for c in cases_for(2)]
    with pytest.raises(ValueError, match="unknown"):
        cases_for(2, ("cp-allgather", "nope"))


@pytest.mark.parametrize("argv,match", [
    (["--seq-lengths", "100"], "multiple of 2 x P"),
    (["--sizes", "1"], "sizes must be >= 2"),
    (["--num-attention-heads", "3"], "divisible"),
    (["--steps", "0"], "--steps"),
])
def test_bad_flags_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        config_from_args(parse_args(argv))
    assert main(argv + ["--output-dir", "/nonexistent/never"]) == 2


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory):
    from megatron_csbp.bench.report import save
    from megatron_csbp.bench.runner import run

    out = tmp_path_factory.mktemp("bench")
    result = run(quick_config(), log=lambda *a: None)
    files = save(result, str(out), "cpu_quick", "python -m megatron_csbp.bench --quick")
    return result, files


def test_quick_bench_bytes_match_formulas(quick_result):
    result, _ = quick_result
    rows = result["rows"]
    kinds = {r["kind"] for r in rows}
    assert {"single", "cp", "bp", "csbp"} <= kinds
    for r in rows:
        # every rank sends exactly the formula's bytes, and receives as many
        assert r["attn_bytes_sent_per_rank"] == [r["formula_bytes_sent"]] * r["P"], r["case"]
        assert r["attn_bytes_received"] == r["attn_bytes_sent"]
        if r["kind"] == "csbp" and r["cp"] == r["P"]:
            assert r["traffic_vs_cp"] == 0.5
        if r["kind"] == "bp":
            assert r["attn_bytes_sent"] == 0 and r["traffic_vs_cp"] == 0.0
        if r["kind"] == "cp":
            assert r["traffic_vs_cp"] == 1.0


# fp32 error model of a layout's step-0 loss against one rank's (the benchmark runs fp32: it times
# the kernels users run; float64 equality of the layouts is pinned in the exactness tests). A layout
# computes the same sums in another order: attention partials merged over key chunks (K <= 2L = 256
# keys at the quick sizes), the loss's sums all-reduced over 2 ranks. A reordered K-term sum moves by
# ~sqrt(K) u sum|terms| (random-walk rounding, u = 2^-24: 1e-6 at K = 256; the worst case K u = 1.5e-5
# needs every rounding in one direction), and the loss, a mean of per-row log-sum-exps, averages
# independent row errors further down. Bound 1e-5 relative: 10x the model; measured (docs/benchmarks/
# cpu.md, every layout): equal in all 7 printed digits.
LAYOUT_LOSS_REL = 1e-5


def test_quick_bench_same_loss_every_layout(quick_result):
    rows = quick_result[0]["rows"]
    single = {r["seq_length"]: r["loss_step0"] for r in rows if r["kind"] == "single"}
    for r in rows:
        assert r["loss_step0"] == pytest.approx(single[r["seq_length"]], rel=LAYOUT_LOSS_REL), r["case"]


def test_quick_bench_measures_memory_and_time(quick_result):
    for r in quick_result[0]["rows"]:
        assert len(r["step_times_s"]) == quick_config().steps and r["median_step_s"] > 0
        assert r["tokens_per_s"] > 0
        assert all(p > s > 0 for p, s in zip(r["peak_tensor_bytes_per_rank"], r["static_tensor_bytes_per_rank"]))
        assert len(r["rows_per_rank"]) == r["P"]
        # CP and CSBP hold 2L/P rows on every rank
        if r["kind"] in ("cp", "csbp"):
            assert r["rows_per_rank"] == [2 * r["seq_length"] // r["P"]] * r["P"]
        # CPU time of each rank's step beside wall time; collectives' time in flight covers their waits
        assert all(t["thread_cpu_s"] > 0 and t["process_cpu_s"] > 0 for t in r["timing_per_rank"])
        assert r["thread_cpu_s"] == max(t["thread_cpu_s"] for t in r["timing_per_rank"])
        assert all(t["in_flight_comm_s"] >= t["exposed_comm_s"] >= 0 for t in r["timing_per_rank"])
        if r["kind"] in ("cp", "csbp"):  # forward and backward collectives of every layer, every rank
            assert r["transfers"] >= 2 * r["P"] and 0 <= r["hidden_comm_share"] <= 1
        else:
            assert r["transfers"] == 0 and r["in_flight_comm_s"] == 0 and r["hidden_comm_share"] is None


def test_quick_bench_report_files(quick_result):
    _, files = quick_result
    for key in ("markdown", "json", "traffic vs sequence length", "time vs sequence length", "peak memory per rank"):
        assert os.path.getsize(files[key]) > 0, key
    md = open(files["markdown"]).read()
    assert "python -m megatron_csbp.bench --quick" in md
    # the report's table: one line per measured row, whose formula and measured/formula columns are
    # the row's own byte counts (measured = formula exactly: "1.000"; no traffic: "–")
    header = [c.strip() for c in next(line for line in md.splitlines() if "measured/formula" in line).split("|")[1:-1]]
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in md.splitlines()
             if line.startswith("| ") and line.count("|") == len(header) + 1 and "measured/formula" not in line]
    by_case = {(int(c[0]), c[1], int(c[2]), int(c[3])): dict(zip(header, c)) for c in table}
    for r in quick_result[0]["rows"]:
        cells = by_case[(r["seq_length"], r["case"], r["cp"], r["bp"])]
        assert cells["formula MiB"] == f"{r['formula_bytes_sent'] / 2 ** 20:.3f}", r["case"]
        assert cells["measured/formula"] == ("1.000" if r["formula_bytes_sent"] else "–"), r["case"]
    assert "half or less" in md
    data = json.load(open(files["json"]))
    assert data["command"] == "python -m megatron_csbp.bench --quick" and data["rows"]


SAVED = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks")


def _measured(row, rank):
    """One rank's record as `bench.worker` returns it, from a saved row's per-rank measurements."""
    per_layer = row["attn_bytes_per_layer_rank0"] if rank == 0 else {}
    if "attn_bytes_sent_per_layer_per_rank" in row:
        per_layer = {k: {"forward_sent": v} for k, v in row["attn_bytes_sent_per_layer_per_rank"][rank].items()}
    timing = row["timing_per_rank"][rank] if "timing_per_rank" in row else {}
    return dict(**timing, case=row["case"], cp=row["cp"], bp=row["bp"], transport=row["transport"], schedule=row["schedule"],
                attention=row.get("attention"), seq_length=row["seq_length"], median_step_s=row["median_step_s"],
                step_times_s=row["step_times_s"], loss_step0=row["loss_step0"], rows=row["rows_per_rank"][rank],
                attn_bytes_sent=row["attn_bytes_sent_per_rank"][rank], attn_bytes_received=row["attn_bytes_received"],
                attn_bytes_per_layer=per_layer, peak_tensor_bytes=row["peak_tensor_bytes_per_rank"][rank],
                static_tensor_bytes=row["static_tensor_bytes_per_rank"][rank],
                rss_high_water_bytes=row["rss_high_water_bytes_per_rank"][rank])


def rerender_saved(name, out_dir):
    """(markdown, rows) of a committed report rebuilt by the code from its measurements alone:
    formulas, ratios, headline and every line of the markdown come from `bench.runner` and
    `bench.report` as they are now, not from the derived fields saved with the run."""
    from megatron_csbp.bench.cases import BenchConfig, BenchModel, DiffusionGemmaBenchModel
    from megatron_csbp.bench.report import dg_headline, load, markdown, plots
    from megatron_csbp.bench.runner import add_ratios, aggregate

    saved = load(os.path.join(SAVED, f"{name}.json"))
    c = saved["config"]
    model = (DiffusionGemmaBenchModel if c["model"].get("arch") == "diffusiongemma-hybrid" else BenchModel)(**c["model"])
    cfg = BenchConfig(model=model, seq_lengths=tuple(c["seq_lengths"]), sizes=tuple(c["sizes"]),
                      layouts=tuple(c["layouts"]), warmup=c["warmup"], steps=c["steps"], seed=c["seed"],
                      measure_memory=c["measure_memory"])
    rows = []
    for P in dict.fromkeys(r["P"] for r in saved["rows"]):  # worlds in run order
        world = [r for r in saved["rows"] if r["P"] == P]
        rows += aggregate(cfg, [[_measured(r, rank) for r in world] for rank in range(P)])
    add_ratios(rows)
    result = dict(config=c, environment=saved["environment"], rows=rows)
    if isinstance(model, DiffusionGemmaBenchModel):
        result["headline"] = dg_headline(rows)
    return markdown(result, saved["command"], plots(result, str(out_dir), name)), result


@pytest.mark.parametrize("name", ["cpu", "diffusiongemma", "cpu_1k_8k"])
def test_saved_report_is_what_the_code_renders(name, tmp_path):
    """The committed reports (docs/benchmarks/NAME.md) equal what the code renders from the
    measurements: a change to the formulas, the ratios or the report shows up as a diff here
    (refresh with `python -m megatron_csbp.bench --from-json docs/benchmarks/NAME.json
    --output-dir docs/benchmarks`)."""
    md, result = rerender_saved(name, tmp_path)
    committed = open(os.path.join(SAVED, f"{name}.md")).read()
    assert md.splitlines() == committed.splitlines()
    rows = result["rows"]
    if name.startswith("cpu"):  # measured = formula everywhere; CSBP with CP = BP = P moves half of CP or less
        assert all(r["attn_bytes_sent"] == r["formula_bytes_sent"] for r in rows)
        csbp = [r for r in rows if r["kind"] == "csbp" and r["cp"] == r["P"]]
        assert csbp and all(r["traffic_vs_cp"] <= 0.5 for r in csbp)
        if name == "cpu_1k_8k":  # the memory claim: CSBP's peak <= CP's, same transport, from L = 2K
            from megatron_csbp.bench.report import memory_vs_cp

            cmp = memory_vs_cp(rows)
            assert len(cmp) == 18 and all(c["ratio"] <= 1.0 for c in cmp)
    else:  # >= 10x ratio of ratios at every L; measured = formula wherever there is one
        assert result["headline"] and all(h["bytes_ratio_of_ratios"] >= 10 for h in result["headline"])
        assert all(r["attn_bytes_sent"] == r["formula_bytes_sent"] for r in rows if r["formula_bytes_sent"] is not None)


def test_report_rerenders_from_json(quick_result, tmp_path):
    _, files = quick_result
    assert main(["--from-json", files["json"], "--output-dir", str(tmp_path), "--no-plots"]) == 0
    again = (tmp_path / "cpu_quick.md").read_text().split("## Plots")[0].rstrip()
    assert again == open(files["markdown"]).read().split("## Plots")[0].rstrip()


# --- `--model diffusiongemma-hybrid`: 5 sliding : 1 full layers vs the same weights all full ---

def test_diffusiongemma_flags():
    from megatron_csbp.bench.cases import DiffusionGemmaBenchModel, dg_cases_for

    cfg = config_from_args(parse_args(["--model", "diffusiongemma-hybrid", "--quick", "--sliding-window", "5"]))
    assert isinstance(cfg.model, DiffusionGemmaBenchModel) and cfg.model.sliding_window == 5
    assert cfg.model.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert [c.name for c in dg_cases_for(2)] == ["cp-hybrid", "csbp-hybrid", "cp-full", "csbp-full"]
    assert [c.baseline_name() for c in dg_cases_for(2)] == ["cp-hybrid", "cp-hybrid", "cp-full", "cp-full"]
    # the GPT default is untouched
    assert config_from_args(parse_args([])) == config_from_args(parse_args(["--model", "gpt"]))
    with pytest.raises(ValueError, match="--layouts"):
        config_from_args(parse_args(["--model", "diffusiongemma-hybrid", "--layouts", "bp"]))
    with pytest.raises(ValueError, match="--sliding-window"):
        config_from_args(parse_args(["--sliding-window", "3"]))


@pytest.fixture(scope="module")
def dg_quick_result(tmp_path_factory):
    from megatron_csbp.bench.cases import dg_quick_config
    from megatron_csbp.bench.report import save
    from megatron_csbp.bench.runner import run

    out = tmp_path_factory.mktemp("bench_dg")
    result = run(dg_quick_config(), log=lambda *a: None)
    command = "python -m megatron_csbp.bench --model diffusiongemma-hybrid --quick"
    return result, save(result, str(out), "diffusiongemma_quick", command)


@pytest.mark.slow  # suite budget (37 s): test_quick_bench_bytes_match_formulas runs the bench by default
def test_diffusiongemma_quick_cases_and_losses(dg_quick_result):
    rows = dg_quick_result[0]["rows"]
    assert sorted(r["case"] for r in rows) == sorted(
        ["single-hybrid", "single-full", "cp-hybrid", "csbp-hybrid", "cp-full", "csbp-full"])
    single = {r["attention"]: r["loss_step0"] for r in rows if r["kind"] == "single"}
    assert single["hybrid"] != pytest.approx(single["full"], rel=1e-3)  # the windows do change the model
    for r in rows:
        assert r["loss_step0"] == pytest.approx(single[r["attention"]], rel=LAYOUT_LOSS_REL), r["case"]
        assert len(r["step_times_s"]) == 2 and r["median_step_s"] > 0
        assert all(p > s > 0 for p, s in zip(r["peak_tensor_bytes_per_rank"], r["static_tensor_bytes_per_rank"]))


@pytest.mark.slow  # suite budget: the committed DiffusionGemma run re-renders by default (test_saved_report_is_what_the_code_renders) and tests/test_kv_source_exchange.py counts the K=V layer's bytes
def test_diffusiongemma_quick_bytes(dg_quick_result):
    rows = {r["case"]: r for r in dg_quick_result[0]["rows"]}
    for name, r in rows.items():
        assert r["attn_bytes_received"] == r["attn_bytes_sent"], name
        for per_layer in r["attn_bytes_sent_per_layer_per_rank"]:
            for layer, want in r["formula_bytes_per_layer"].items():
                if want is not None:  # exact wherever there is a formula: all but windowed CSBP layers
                    assert per_layer.get(layer, 0) == want, (name, layer)
    # CP: K and V of every row on every layer, windows or not
    assert rows["cp-hybrid"]["attn_bytes_sent_per_rank"] == rows["cp-full"]["attn_bytes_sent_per_rank"]
    assert rows["cp-full"]["attn_bytes_sent"] == rows["cp-full"]["formula_bytes_sent"]
    assert rows["csbp-full"]["attn_bytes_sent"] == rows["csbp-full"]["formula_bytes_sent"]
    # the K=V full layer (6): CSBP moves raw k of half the rows, a quarter of CP's K+V, with or without windows
    for rank in range(2):
        cp6 = rows["cp-hybrid"]["attn_bytes_sent_per_layer_per_rank"][rank]["6"]
        for name in ("csbp-hybrid", "csbp-full"):
            assert 4 * rows[name]["attn_bytes_sent_per_layer_per_rank"][rank]["6"] == cp6
    hybrid, full = rows["csbp-hybrid"]["traffic_vs_cp"], rows["csbp-full"]["traffic_vs_cp"]
    assert full / hybrid >= 10, (hybrid, full)
    assert all(r["bp"] == 1 or r["traffic_vs_cp"] < 0.5 for r in rows.values() if r["P"] > 1)


@pytest.mark.slow  # suite budget: the committed DiffusionGemma run re-renders by default (test_saved_report_is_what_the_code_renders) and tests/test_kv_source_exchange.py counts the K=V layer's bytes
def test_diffusiongemma_quick_report(dg_quick_result, tmp_path):
    _, files = dg_quick_result
    for key in ("markdown", "json", "traffic vs sequence length", "time vs sequence length", "peak memory per rank"):
        assert os.path.getsize(files[key]) > 0, key
    md = open(files["markdown"]).read()
    assert "--model diffusiongemma-hybrid --quick" in md and "## Headline: CSBP / CP" in md
    data = json.load(open(files["json"]))
    (head,) = data["headline"]
    assert head["P"] == 2 and head["seq_length"] == 128 and head["bytes_ratio_of_ratios"] >= 10
    assert main(["--from-json", files["json"], "--output-dir", str(tmp_path), "--no-plots"]) == 0
    again = (tmp_path / "diffusiongemma_quick.md").read_text().split("## Plots")[0].rstrip()
    assert again == md.split("## Plots")[0].rstrip()



def test_alternate_pairs_ratios_and_op_counts():
    """`bench.alternate`: the two layouts run A B, B A in one world; the op counter is the same in
    every pair (deterministic, unlike time), the step-0 loss the same under both layouts, and the
    summary's ratios are B / A of the recorded CPU times."""
    from dataclasses import replace

    from megatron_csbp.bench.alternate import alternate, render

    cfg = replace(quick_config(), seq_lengths=(64,), sizes=(2,), layouts=("cp-ring", "csbp-ring"), warmup=0, steps=1,
                  measure_memory=False, count_ops=True)
    result = alternate(cfg, ["cp-ring", "csbp-ring"], 2, log=lambda *a: None)
    runs = result["runs"]
    assert [r["layout"] for r in runs] == ["cp-ring", "csbp-ring", "csbp-ring", "cp-ring"]
    for name in ("cp-ring", "csbp-ring"):
        a, b = [r for r in runs if r["layout"] == name]
        assert a["op_counts"] == b["op_counts"] and sum(a["ops_per_step"]) == sum(a["op_counts"].values()) > 0
    assert abs(runs[0]["loss_step0"] - runs[1]["loss_step0"]) < 1e-5 * abs(runs[0]["loss_step0"])
    get = {(r["pair"], r["layout"]): r for r in runs}
    s = result["summary"]
    for p in (0, 1):
        assert s["ratio_sum"]["per_pair"][p] == sum(get[p, "csbp-ring"]["thread_cpu_s"]) / sum(get[p, "cp-ring"]["thread_cpu_s"])
        assert s["ratio_max"]["per_pair"][p] == max(get[p, "csbp-ring"]["thread_cpu_s"]) / max(get[p, "cp-ring"]["thread_cpu_s"])
        fast = {name: get[p, name]["thread_cpu_min_s"] for name in ("cp-ring", "csbp-ring")}
        assert s["ratio_sum_min"]["per_pair"][p] == sum(fast["csbp-ring"]) / sum(fast["cp-ring"])
        assert s["ratio_max_min"]["per_pair"][p] == max(fast["csbp-ring"]) / max(fast["cp-ring"])
    md = render(result, "python -m megatron_csbp.bench.alternate --pairs 2")
    assert "python -m megatron_csbp.bench.alternate --pairs 2" in md and "aten op calls per step" in md


def test_median_interval_is_the_binomial_order_statistics():
    """The 95 % interval of a median over n pairs: ranks k and n + 1 - k with
    P(Binomial(n, 1/2) <= k - 1) <= 2.5 %, checked against the textbook ranks (n = 6: 1 and 6,
    n = 10: 2 and 9, n = 20: 6 and 15, n = 30: 10 and 21) and against the tail sums themselves."""
    import math

    from megatron_csbp.bench.alternate import median_ci

    for n, k in ((6, 1), (10, 2), (20, 6), (30, 10)):
        x = [float(i) for i in range(n, 0, -1)]  # unsorted on purpose
        assert median_ci(x) == [float(k), float(n + 1 - k)]
        tail = lambda j: sum(math.comb(n, i) for i in range(j)) / 2 ** n  # noqa: E731  P(B <= j - 1)
        assert tail(k) <= 0.025 < tail(k + 1)
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # no 95 % interval from 5 pairs


@pytest.mark.parametrize("argv,line", [
    (["--pairs", "0"], "--pairs must be >= 1, got 0"),
    (["--layouts", "cp-ring", "cp-ring"], "--layouts must name two different layouts, got cp-ring twice"),
    (["--seq-length", "100"], "--seq-length 100 must be a multiple of 2 x --size x block size = 128 "
                              "(zigzag chunks and balanced mirrored block pairs)"),
])
def test_alternate_bad_flags(argv, line, capsys):
    from megatron_csbp.bench.alternate import main as alternate_main

    with pytest.raises(SystemExit) as e:
        alternate_main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(line)


def test_saved_alternate_run_is_what_the_code_renders():
    """docs/benchmarks/cpu_1024_p4.md holds the alternate run's tables as the code renders them
    from the saved measurements (docs/benchmarks/cpu_1024_p4_alternate.json), and the claims made
    from it hold on those numbers: op counts the same in every pair (deterministic), CSBP's ring
    makes fewer aten calls per step than CP's, and the medians quoted are the saved pairs' medians."""
    from megatron_csbp.bench.alternate import render, summary

    saved = json.load(open(os.path.join(SAVED, "cpu_1024_p4_alternate.json")))
    a, b = saved["layouts"]
    assert (a, b, saved["P"], saved["seq_length"]) == ("cp-ring", "csbp-ring", 4, 1024) and saved["pairs"] >= 6
    assert summary(saved["runs"], a, b) == saved["summary"]
    md = open(os.path.join(SAVED, "cpu_1024_p4.md")).read()
    for line in render(saved, saved["command"]).splitlines():
        assert line in md.splitlines(), line
    for name in (a, b):
        counts = [r["op_counts"] for r in saved["runs"] if r["layout"] == name]
        assert all(c == counts[0] for c in counts)
    ops = {r["layout"]: sum(r["op_counts"].values()) for r in saved["runs"]}
    assert ops[b] < ops[a]
