"""The planner's pipeline parallelism (megatron_csbp/planner/cost.py (`estimate_pipelined`)): the 1F1B bubble, the
in-flight micro-batches' activations per stage, P2P bytes of this rank's rows, and the flags."""
import pytest

from megatron_csbp.planner.cost import Layout, Workload, estimate
from megatron_csbp.planner.hardware import PRESETS
from megatron_csbp.planner.model_config import load_preset
from megatron_csbp.planner.search import candidate_layouts, layout_flags
from megatron_csbp.planner.work import rank_work

GiB = 2 ** 30


def test_pipelined_estimate_terms():
    model, hw = load_preset("nemotron-diffusion-3b"), PRESETS["h200"]
    L, B, m = 32768, 64, 8
    wl = Workload(L, B, global_batch_size=m)
    flat = estimate(model, Layout(1, 2, 2, 1, 1, "full"), wl, hw, 8)
    pp2 = estimate(model, Layout(1, 2, 2, 1, 1, "full", pp=2), wl, hw, 8)
    info = pp2.pipeline
    assert info["bubble_fraction"] == pytest.approx(1 / (m + 1))
    assert info["in_flight_micro_batches"] == [2, 1]  # 1F1B: the first stage holds P micro-batches
    rows = max(w.rows for w in rank_work(L, B, 2, 2, "mirrored", model.clean_attention, None))
    assert rows == L // 2 + L // 2  # CSBP: noisy L / BP + the ring's clean shard L / CP
    assert info["p2p_bytes_per_micro_batch"] == rows * model.hidden_size * hw.dtype_bytes
    # each stage does half the layers: per-micro-batch work halves, (m + P - 1) slots of it
    assert pp2.step_time_s < flat.step_time_s * (m + 1) / m
    assert pp2.time["pipeline_bubble"] > 0 and pp2.time["p2p_exposed"] > 0
    assert len(info["stage_peak_gib"]) == 2 and pp2.peak_memory_gib == pytest.approx(max(info["stage_peak_gib"]))
    assert pp2.memory_gib["weights_grads_optimizer"] < flat.memory_gib["weights_grads_optimizer"]
    assert pp2.attn_bytes_per_gpu == pytest.approx(flat.attn_bytes_per_gpu / 2, rel=1e-9)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 5 must divide"):
        estimate(model, Layout(1, 2, 2, 1, 1, "full", pp=5), wl, hw, 8)


def test_search_offers_pp_and_emits_flags():
    from megatron_csbp.training.arguments import parse_args

    model = load_preset("cpu-bench-tiny")
    wl = Workload(256, 16, global_batch_size=4)
    lays = candidate_layouts(model, wl, 8, 8)
    assert {l.pp for l in lays} >= {1, 2}
    assert all(l.gpus == 8 and model.num_layers % l.pp == 0 for l in lays)
    lay = next(l for l in lays if l.pp == 2 and l.cp == 2 and l.bp == 2)
    flags = " ".join(layout_flags(lay, wl)).replace("--bf16", "").split()
    assert "--pipeline-model-parallel-size" in flags and flags[flags.index("--pipeline-model-parallel-size") + 1] == "2"
    args = facts = parse_args(flags + ["--mock-data", "--vocab-size", "64", "--num-layers", str(model.num_layers)],
                             world_size=8)
    assert args.pipeline_model_parallel_size == 2 and facts.num_microbatches == 4 // facts.data_parallel_size


# ---- interleaved 1F1B (virtual stages) ----------------------------------------------------------

@pytest.mark.parametrize("P,V,m", [(2, 2, 4), (2, 4, 8), (4, 2, 8), (4, 5, 4)])
def test_interleaved_bubble_closed_form(P, V, m):
    """Megatron's interleaved schedule: bubble (P - 1) / (V m) of the ideal time, V x the P2P hops,
    first-rank activations P (1 + (P - 1) / (P V)) micro-batches' worth (its memory penalty)."""
    from megatron_csbp.planner.cost import in_flight_chunks

    model, hw = load_preset("llama-70b-like"), PRESETS["h200"]  # 80 identical layers
    wl = Workload(8192, 64, global_batch_size=m)
    one = estimate(model, Layout(8, 1, 1, 1, 1, "full", pp=P), wl, hw, 8)
    vp = estimate(model, Layout(8, 1, 1, 1, 1, "full", pp=P, vp=V), wl, hw, 8)
    rest = one.time["grad_reduce_exposed"] + one.time["optimizer"]
    assert vp.time["grad_reduce_exposed"] + vp.time["optimizer"] == pytest.approx(rest, rel=1e-12)
    # 1F1B: (m + P - 1) slots of the slowest rank's micro-batch time t1 (p2p: 2 hops a micro-batch)
    t1 = (one.step_time_s - rest) / (m + P - 1)
    hop = one.time["p2p_exposed"] / (m + P - 1)
    # same layers per rank (identical layers; embedding on rank 0, output layer on rank P-1):
    # only the P2P differs, V times the hops
    tV = t1 - hop + V * hop
    ideal = m * tV
    assert vp.step_time_s - rest == pytest.approx(ideal * (1 + (P - 1) / (V * m)), rel=1e-9)
    assert vp.time["pipeline_bubble"] == pytest.approx(ideal * (P - 1) / (V * m), rel=1e-9)
    assert vp.pipeline["bubble_fraction"] == pytest.approx((P - 1) / V / (m + (P - 1) / V), rel=1e-12)
    assert vp.pipeline["schedule"] == "interleaved 1F1B" and vp.pipeline["virtual_stages"] == V
    flights = vp.pipeline["in_flight_micro_batches"]
    assert flights[0] == pytest.approx(min(P * (1 + (P - 1) / (P * V)), m))  # Megatron's penalty
    assert flights[-1] == pytest.approx(min(((V - 1) * P + 1) / V, m))
    assert in_flight_chunks(0, m, P, V) <= m * V
    assert vp.attn_bytes_per_gpu == one.attn_bytes_per_gpu


def test_interleaving_rules_named():
    model, hw = load_preset("llama-70b-like"), PRESETS["h200"]
    with pytest.raises(ValueError, match="multiple of --pipeline-model-parallel-size 4"):
        estimate(model, Layout(8, 1, 1, 1, 1, "full", pp=4, vp=2), Workload(8192, 64, global_batch_size=6), hw, 8)
    with pytest.raises(ValueError, match="--num-virtual-stages-per-pipeline-rank 3 must divide the 40 layers"):
        estimate(model, Layout(8, 1, 1, 1, 1, "full", pp=2, vp=3), Workload(8192, 64, global_batch_size=4), hw, 8)


def test_search_chooses_interleaving_where_the_bubble_costs_more_than_its_hops():
    from megatron_csbp.planner.search import plan

    model = load_preset("llama-70b-like")  # 80 layers: PP 2 x VP 2 / 4 admissible
    r = plan(model, Workload(32768, 256, global_batch_size=8), 16, 8, PRESETS["h200"], pipelines=(2,),
             transports=("ring",), recompute=("full",))
    best = r["best"]
    assert best["pp"] == 2 and best["vp"] == 4 and "PP2xVP4" in best["label"]
    flat = next(l for l in r["layouts"] if l["vp"] == 1 and l["tp"] == best["tp"] and l["cp"] == best["cp"]
                and l["bp"] == best["bp"])
    assert best["step_time_s"] < flat["step_time_s"]
    assert "--num-layers-per-virtual-pipeline-stage 10" in " ".join(best["flags"])
    # at 3 micro-batches (not a multiple of PP 2) the trainer refuses interleaving: none offered
    r3 = plan(model, Workload(32768, 256, global_batch_size=3), 16, 8, PRESETS["h200"], pipelines=(2,),
              transports=("ring",), recompute=("full",))
    assert r3["evaluated"] and all(l["vp"] == 1 for l in r3["layouts"])


def test_search_keeps_plain_1f1b_where_the_extra_hops_cost_more():
    """A tiny model: a micro-batch's compute is microseconds, each extra P2P hop 2 x 20 us of latency."""
    from dataclasses import replace

    from megatron_csbp.planner.search import plan

    tiny = load_preset("cpu-bench-tiny")
    model = replace(tiny, layers=tiny.layers * 4)  # 8 layers: PP 2 x VP 2 / 4 admissible
    r = plan(model, Workload(256, 16, global_batch_size=8), 8, 8, PRESETS["h200"], pipelines=(2,))
    assert any(l["vp"] > 1 for l in r["layouts"])  # offered ...
    assert r["best"]["pp"] == 2 and r["best"]["vp"] == 1  # ... not chosen
    assert "--num-layers-per-virtual-pipeline-stage" not in " ".join(r["best"]["flags"])


def test_interleaved_flags_pass_the_trainers_parser():
    from dataclasses import replace

    from megatron_csbp.training.arguments import parse_args

    tiny = load_preset("cpu-bench-tiny")
    model = replace(tiny, layers=tiny.layers * 4)
    wl = Workload(256, 16, global_batch_size=8)
    lay = next(l for l in candidate_layouts(model, wl, 8, 8) if l.pp == 2 and l.vp == 2 and l.cp == 2 and l.bp == 2)
    with pytest.raises(ValueError, match="layer count"):
        layout_flags(lay, wl)
    flags = " ".join(layout_flags(lay, wl, model.num_layers)).replace("--bf16", "").split()
    assert flags[flags.index("--num-layers-per-virtual-pipeline-stage") + 1] == "2"
    args = facts = parse_args(flags + ["--mock-data", "--vocab-size", "64", "--num-layers", str(model.num_layers)],
                             world_size=8)
    assert args.pipeline_model_parallel_size == 2 and facts.virtual_pipeline_model_parallel_size == 2
    assert facts.num_microbatches % 2 == 0


#: a layout for every flag `layout_flags` prints
FLAG_LAYOUTS = {
    "tp-sp": (Layout(tp=2, dp=2, distributed_optimizer=False), Workload(256, 16)),
    "pp-vp": (Layout(pp=2, vp=2, dp=2), Workload(256, 16, global_batch_size=8)),
    "cp-bp-ring": (Layout(cp=2, bp=4, transport="ring", schedule="contiguous"), Workload(256, 16)),
    "ep": (Layout(ep=2, dp=2), Workload(256, 16)),
    "recompute": (Layout(recompute="full", dp=4), Workload(256, 16, global_batch_size=8)),
    "dflash": (Layout(dp=2, distributed_optimizer=False), Workload(256, 16, objective="dflash", anchors=7)),
    "packed": (Layout(dp=2), Workload(256, 16, documents=(0, 100))),
    "bf16-grads": (Layout(dp=2), Workload(256, 16, grad_bytes=2)),
}


@pytest.mark.parametrize("name", FLAG_LAYOUTS)
def test_printed_flags_are_the_trainers(name):
    """The flags the planner prints parse with `python -m megatron_csbp.train`'s own parser (a misspelt or
    renamed flag is refused) and give the layout's values back."""
    from megatron_csbp.training.arguments import build_parser

    lay, wl = FLAG_LAYOUTS[name]
    parser = build_parser()
    parser.allow_abbrev = False  # a shortened name is a misspelt one (Megatron-LM's parser takes none)
    a = parser.parse_args(" ".join(layout_flags(lay, wl, 16)).split())
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size,
            a.block_parallel_size, a.expert_model_parallel_size) == (lay.tp, lay.pp, lay.cp, lay.bp, lay.ep)
    assert a.num_layers_per_virtual_pipeline_stage == (16 // (lay.pp * lay.vp) if lay.vp > 1 else None)
    assert (a.sequence_parallel, a.use_distributed_optimizer) == (lay.tp > 1, lay.distributed_optimizer)
    assert (a.attention_transport, a.block_ownership) == (lay.transport, lay.schedule)
    full = lay.recompute == "full"
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == (
        ("full", "uniform", 1) if full else (None, None, None))
    assert a.objective == wl.objective and (wl.objective != "dflash" or a.dflash_max_anchors == wl.anchors)
    assert (a.seq_length, a.block_size, a.micro_batch_size, a.global_batch_size, a.bf16) == (
        wl.seq_length, wl.block_size, 1, wl.global_batch_size or lay.dp, True)
    assert a.reset_attention_mask == a.reset_position_ids == wl.packed
    assert a.grad_reduce_in_bf16 == (wl.grad_bytes == 2)
