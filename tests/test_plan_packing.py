"""The planner's packing input (--doc-length / --doc-length-histogram): per-rank attention pairs
and CSBP's packed clean exchange equal the static plans' (bench/packing.py: `PartialMask` pairs and
`WindowExchangePlan` rows under the ownership the trainer uses: BP cost-balanced per sample, CSBP
the layout's own) and a brute-force count on
the dense mask with document ids; the CLI plans a packed 256K sample and prints the packing flags."""
import json
from dataclasses import replace

import pytest
import torch

from megatron_csbp.bench.packing import rank_numbers
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, Documents, dense_reference_mask
from megatron_csbp.layout.packing import block_costs
from megatron_csbp.planner.cli import main
from megatron_csbp.planner.cost import Layout, Workload, estimate
from megatron_csbp.planner.hardware import PRESETS
from megatron_csbp.planner.model_config import load_preset
from megatron_csbp.planner.packing import pack_starts, read_histogram
from megatron_csbp.planner.work import rank_work

HIST = {5: 3.0, 16: 2.0, 40: 1.0}


def test_pack_starts_rule_and_errors(tmp_path):
    assert pack_starts(100, doc_length=30) == (0, 30, 60, 90)
    a = pack_starts(4096, histogram=HIST, seed=3)
    assert a == pack_starts(4096, histogram=HIST, seed=3) != pack_starts(4096, histogram=HIST, seed=4)
    assert a[0] == 0 and all(b - x in HIST for x, b in zip(a, a[1:]))  # only the last one is cut
    p = tmp_path / "h.txt"
    p.write_text("# len count\n16 2\n40 1\n")
    assert read_histogram(str(p)) == {16: 2.0, 40: 1.0}
    p.write_text("16 2 7\n")
    with pytest.raises(ValueError, match=r"--doc-length-histogram .*:1: expected 'length count'"):
        read_histogram(str(p))
    with pytest.raises(ValueError, match="--doc-length must be positive"):
        pack_starts(100, doc_length=0)


@pytest.mark.parametrize("cp,bp", [(1, 1), (4, 1), (1, 4), (2, 2), (2, 4), (4, 4)])
def test_packed_work_equals_the_static_plans(cp, bp):
    L, B = 512, 8
    for starts in (pack_starts(L, histogram=HIST, seed=1), pack_starts(L, doc_length=24)):
        docs = Documents(starts, L)
        layout = SequenceLayout(BlockGeometry(L, B), cp, bp)
        ref = rank_numbers(layout, docs)
        got = rank_work(L, B, cp, bp, "mirrored", "block_causal", None, starts)
        pairs = "balanced_pairs" if layout.kind == "bp" else "packed_pairs"  # RowFeeder.packed_plan
        assert [w.sparse_pairs for w in got] == [r[pairs] for r in ref]
        if layout.kind == "csbp":
            assert [w.exchange_rows for w in got] == [r["csbp_packed_rows"] for r in ref]
            assert [w.kv_rows_gathered for w in got] == [r["csbp_packed_rows"] for r in ref]
            assert max(w.exchange_rows for w in got) < ref[0]["csbp_rows"]  # packing moves fewer rows
        elif layout.kind == "cp":  # Megatron's CP has no notion of documents
            assert [w.exchange_rows for w in got] == [2 * L * (cp - 1) // cp] * cp  # every other rank's K/V


def test_packed_pairs_brute_force_on_the_dense_mask():
    """Independent of the predicate: the [2L, 2L] table with document ids, summed per rank's rows."""
    L, B = 96, 8
    for clean_attention in ("block_causal", "token_causal"):
        starts = pack_starts(L, histogram={3: 1.0, 11: 1.0, 30: 1.0}, seed=2)
        ids = Documents(starts, L).index_of(torch.arange(L)).tolist()
        mask = dense_reference_mask(L, B, clean_attention, document_ids=ids)
        for cp, bp in ((1, 1), (2, 2), (1, 4)):
            got = rank_work(L, B, cp, bp, "mirrored", clean_attention, None, starts)
            layout = SequenceLayout(BlockGeometry(L, B, clean_attention), cp, bp)
            if layout.kind == "bp":
                layout = replace(layout, block_costs=block_costs(Documents(starts, L), B, L))
            for r, w in enumerate(got):
                rows = layout.rows(r)
                logical = rows.position + L * rows.is_clean.long()  # [noisy ; clean] order
                assert w.sparse_pairs == int(mask[logical].sum()), (clean_attention, cp, bp, r)


def test_packed_plan_cuts_csbp_traffic_and_memory():
    model = load_preset("nemotron-diffusion-3b")
    hw = PRESETS["h200"]
    L, B = 16384, 64
    lay = Layout(tp=1, cp=4, bp=4, recompute="full")
    unpacked = estimate(model, lay, Workload(L, B), hw, 8)
    packed = estimate(model, lay, Workload(L, B, documents=pack_starts(L, doc_length=1024)), hw, 8)
    assert packed.attn_bytes_per_gpu < unpacked.attn_bytes_per_gpu / 4
    assert packed.time["attention"] < unpacked.time["attention"] / 4
    assert packed.peak_memory_gib < unpacked.peak_memory_gib
    cp = Layout(tp=1, cp=16, recompute="full")  # CP moves the same bytes packed or not
    assert (estimate(model, cp, Workload(L, B, documents=pack_starts(L, doc_length=1024)), hw, 8).attn_bytes_per_gpu
            == estimate(model, cp, Workload(L, B), hw, 8).attn_bytes_per_gpu)


def test_cli_packed_256k_recipe(capsys):
    """The packed-SFT recipe's shape planned with the SFT histogram: predictions and flags."""
    args = ["--model", "qwen3-27b-like", "--seq-length", "262144", "--block-size", "256", "--gpus", "16",
            "--doc-length-histogram", "docs/benchmarks/sft_doc_lengths.txt", "--recompute", "full",
            "--transports", "allgather"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "packed: " in out and "documents (--doc-length-histogram docs/benchmarks/sft_doc_lengths.txt, seed 0)" in out
    assert "--reset-attention-mask --reset-position-ids" in out and "tok/s" in out
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["packing"]["documents"] > 1 and res["best"]["flags"][-2:] == ["--reset-attention-mask",
                                                                            "--reset-position-ids"]
    assert main(args + ["--doc-length", "4096"]) == 2
    assert "give one of --doc-length or --doc-length-histogram, not both" in capsys.readouterr().err


@pytest.mark.parametrize("extra,line", [
    (["--doc-length-histogram", "/nonexistent/h.txt"], "--doc-length-histogram /nonexistent/h.txt: cannot read it"),
    (["--doc-length", "0"], "--doc-length must be positive, got 0"),
    (["--doc-length-histogram", "docs/benchmarks/sft_doc_lengths.txt", "--doc-length-seed", "-1"],
     "--doc-length-seed must be >= 0"),
    (["--doc-length", "512", "--model", "qwen3.5-27b-like"], "has Gated DeltaNet layers"),
])
def test_cli_packing_bad_input(capsys, extra, line):
    args = ["--seq-length", "4096", "--block-size", "64", "--gpus", "4"] + extra
    if "--model" not in extra:
        args += ["--model", "qwen3-27b-like"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert line in err and len(err.strip().splitlines()) == 1, err
