"""Packed documents: what CSBP's clean exchange moves and how attention work spreads over ranks,
from the static plans alone (`python -m megatron_csbp.bench.packing`).

For one packed sample (documents of a fixed length, or drawn from a length histogram until the
sequence is full, the last one cut, as Megatron's GPTDataset packs them: `planner.packing`, the
planner's own rule) and a layout, per rank:

- rows received per layer in forward (backward sends as many gradients back): CP baseline (K/V of
  every other rank's rows, as Megatron's CP: it has no notion of documents), CSBP unpacked (every
  other ring member's clean shard, all-gathered) and CSBP packed (the interval plan of
  `layout.exchange.WindowExchangePlan` under the sample's documents: only clean rows some local
  query of the same document may see); these are exactly the rows the transports count (the
  byte-accounting test is tests/test_packing_distributed.py);
- attention work: allowed (query, key) pairs of the rank's queries (`PartialMask.allowed_pairs`),
  unpacked, packed under the layout's ownership, and packed under the per-sample cost-balanced
  ownership the trainer uses (`RowFeeder.packed_plan`), and their spread over the shard group
  (max / mean).

Metadata only, linear in the rows (row vectors, difference arrays, searchsorted): at 256K tokens
on 16 ranks each plan is built from 32K local rows against 16 shards of 16K clean rows.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from megatron_csbp.layout.exchange import WindowExchangePlan
from megatron_csbp.layout.layout import OWNERSHIP_SCHEDULES, SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, Documents, logical_rows
from megatron_csbp.layout.packing import block_costs
from megatron_csbp.layout.rows import PartialMask
from megatron_csbp.planner.packing import pack_starts, read_histogram


def pack_documents(seq_length: int, doc_length: Optional[int] = None, histogram: Optional[Dict[int, float]] = None,
                   seed: int = 0) -> Documents:
    """One packed sample, by the planner's packing rule (`planner.packing.pack_starts`)."""
    return Documents(pack_starts(seq_length, doc_length, histogram, seed), seq_length)


def _received(layout: SequenceLayout, geometry: BlockGeometry, r: int) -> int:
    members = [layout.rows(m) for m in layout.ring_ranks(r)]
    return sum(WindowExchangePlan.build(members, layout.ring_clean_rows(r), geometry, layout.ring_of(r)[1]).recv_counts)


def rank_numbers(layout: SequenceLayout, documents: Optional[Documents]) -> List[dict]:
    """Per shard rank: forward rows received (CP, CSBP unpacked, CSBP packed under the layout's
    ownership and under the trainer's per-sample cost-balanced ownership) and allowed pairs."""
    g = layout.geometry
    packed_g = g.with_documents(documents)
    balanced = (replace(layout, block_costs=block_costs(documents, g.block_size, g.seq_length))
                if documents is not None and layout.kind in ("bp", "csbp") else layout)
    keys = logical_rows(g.seq_length)
    L, P = g.seq_length, layout.ring_size
    out = []
    for r in range(layout.shard_group_size):
        local = layout.rows(r)
        row = dict(rank=r, pairs=PartialMask.of(local, keys, g).allowed_pairs(),
                   packed_pairs=PartialMask.of(local, keys, packed_g).allowed_pairs(),
                   balanced_pairs=PartialMask.of(balanced.rows(r), keys, packed_g).allowed_pairs())
        if P > 1 and layout.kind == "csbp":
            S = layout.shard_group_size  # the CP baseline on the same ranks: K/V of all 2L rows over S
            row["cp_rows"] = 2 * L * (S - 1) // S
            row["csbp_rows"] = L * (P - 1) // P
            row["csbp_packed_rows"] = _received(layout, packed_g, r)
            row["csbp_balanced_rows"] = _received(balanced, packed_g, r)
        out.append(row)
    return out


def summary(seq_length, block_size, cp, bp, documents, schedule="mirrored") -> dict:
    layout = SequenceLayout(BlockGeometry(seq_length, block_size), cp, bp, schedule)
    rows = rank_numbers(layout, documents)
    res = dict(seq_length=seq_length, block_size=block_size, cp=cp, bp=bp, schedule=schedule,
               documents=len(documents) if documents is not None else 1)
    for key in ("pairs", "packed_pairs", "balanced_pairs", "cp_rows", "csbp_rows", "csbp_packed_rows",
                "csbp_balanced_rows"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            res[key] = sum(vals) / len(vals)
            res[key + "_max"] = max(vals)
    for key in ("pairs", "packed_pairs", "balanced_pairs"):
        res[key + "_spread"] = res[key + "_max"] / res[key] if res[key] else 1.0
    return res


def markdown(results: Sequence[dict], kv_bytes_per_row: int) -> str:
    head = ("| L | B | CP x BP | docs | CP rows/rank | CSBP rows/rank | CSBP packed rows/rank (owned as unpacked) | "
            "CSBP packed rows/rank (cost-balanced) | balanced / unpacked | balanced / CP | balanced MiB/layer (fwd) | "
            "pairs spread unpacked | pairs spread packed | pairs spread packed, cost-balanced |\n|" + "---|" * 14)
    lines = [head]
    for r in results:
        cs = (f"{r['cp_rows']:.0f} | {r['csbp_rows']:.0f} | {r['csbp_packed_rows']:.0f} | {r['csbp_balanced_rows']:.0f} | "
              f"{r['csbp_balanced_rows'] / r['csbp_rows']:.3f} | {r['csbp_balanced_rows'] / r['cp_rows']:.3f} | "
              f"{r['csbp_balanced_rows'] * kv_bytes_per_row / 2**20:.1f}") if "cp_rows" in r else "- | - | - | - | - | - | -"
        lines.append(f"| {r['seq_length']} | {r['block_size']} | {r['cp']} x {r['bp']} | {r['documents']} | {cs} | "
                     f"{r['pairs_spread']:.3f} | {r['packed_pairs_spread']:.3f} | {r['balanced_pairs_spread']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    from megatron_csbp.bench.report import bench_parser, write_file

    p = bench_parser("packing", __doc__.split("\n\n")[0])
    p.add_argument("--seq-length", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layouts", default="4x4,2x8,16x16", help="CPxBP,... (CSBP when CP > 1 and BP > 1)")
    p.add_argument("--block-ownership", choices=OWNERSHIP_SCHEDULES, default="mirrored")
    p.add_argument("--doc-length", type=int, default=None, help="fixed document length")
    p.add_argument("--doc-length-histogram", default=None, help="JSON {length: count} or 'length count' lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-bytes-per-row", type=int, default=2 * 8 * 128 * 2,
                   help="K and V bytes of one row of one layer (default: 8 KV heads x 128 x bf16 = 4 KiB)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    hist = read_histogram(a.doc_length_histogram) if a.doc_length_histogram else None
    docs = pack_documents(a.seq_length, a.doc_length, hist, a.seed)
    layouts = [(int(x) for x in spec.lower().split("x")) for spec in a.layouts.split(",")]
    results = [summary(a.seq_length, a.block_size, cp, bp, docs, a.block_ownership) for cp, bp in layouts]
    print(markdown(results, a.kv_bytes_per_row))
    write_file(a.json, results)
    return results


if __name__ == "__main__":
    from megatron_csbp.utils.cli import run

    raise SystemExit(run(main))
