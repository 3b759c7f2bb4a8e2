"""The planner's pipeline parallelism (megatron_csbp/planner/pipeline.py): the 1F1B bubble, the
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
    args = parse_args(flags + ["--mock-data", "--vocab-size", "64", "--num-layers", str(model.num_layers)],
                      world_size=8)
    assert args.pipeline_model_parallel_size == 2 and args.num_microbatches == 4 // args.data_parallel_size
