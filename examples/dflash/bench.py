"""CPU benchmark of a DFlash drafter step (forward + backward) under CP vs CSBP on 2 gloo ranks.

    python examples/dflash/bench.py [--lengths 1024 2048 4096] [--output docs/benchmarks/dflash_cpu.json]

Random features, tokens and verifier weights (the step's cost does not depend on their values);
one sequence of L tokens split into 4 documents, `--anchors` draft blocks of 16 slots, a
2-layer drafter (hidden 128, 4 heads, 2 query groups; layer 0 sliding window 256, layer 1 full).
CP (--context-parallel-size 2): context zigzag-sharded, anchors dealt over both ranks, K/V of
every row exchanged. CSBP (CP = BP = 2): the same shards and anchors, only the context's K/V move.
Per layout: median wall time of `--repeats` steps after one warm-up, attention bytes sent +
received per rank per step (from the transports' own accounting), peak RSS per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

HIDDEN, VOCAB = 128, 1024


def bench_rank(rank, world, cp, bp, L, anchors, repeats):
    import warnings

    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.attention.accounting import traffic_counter
    from megatron_csbp.attention.dflash import DFlashLayout
    from megatron_csbp.model.dflash import DFlashDrafter, DFlashTrainingModel, DrafterShape, drafter_transformer_config
    from megatron_csbp.objectives.dflash import DFlashObjective

    warnings.simplefilter("ignore")
    bps.initialize_block_parallel(context_parallel_size=cp, block_parallel_size=bp)
    shape = DrafterShape(hidden_size=HIDDEN, num_layers=2, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                         ffn_hidden_size=256, target_layer_ids=[1, 3], block_size=16, mask_token_id=4,
                         rotary_base=10000.0, layer_types=["sliding_attention", "full_attention"], sliding_window=255)
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape, drafter_transformer_config(shape, perform_initialization=True))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, VOCAB, (L,), generator=g)
    doc_ids = torch.arange(L) * 4 // L
    features = torch.randn(L, 2 * HIDDEN, generator=g)
    emb, head = torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    obj = DFlashObjective(16, 4, max_anchors=anchors, sampling="uniform", gamma=7.0, vocab_chunk=512)
    layout = DFlashLayout(L, 16, cp, bp)
    ring = bps.get_clean_ring_group() if layout.kind != "cp" else mpu.get_context_parallel_group()
    model = DFlashTrainingModel(drafter, emb, head, obj, layout, shard_rank=mpu.get_context_parallel_rank(),
                                shard_group=mpu.get_context_parallel_group(), ring_group=ring)
    times, nbytes = [], 0
    for i in range(repeats + 1):
        traffic_counter().reset()
        torch.distributed.barrier()
        t = time.perf_counter()
        out = model(features, tokens, None, doc_ids, sample_index=i)
        out.loss.backward()
        torch.distributed.barrier()
        if i:
            times.append(time.perf_counter() - t)
        nbytes = traffic_counter().total
    times.sort()
    return {"time_s": times[len(times) // 2], "bytes": nbytes,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None):
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    from megatron_csbp.parallel.spawn import spawn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks", "dflash_cpu.json"))
    a = p.parse_args(argv)
    rows = []
    for L in a.lengths:
        for name, cp, bp in (("cp", 2, 1), ("csbp", 2, 2)):
            res = spawn(bench_rank, 2, cp, bp, L, a.anchors, a.repeats)
            row = {"layout": name, "seq_length": L, "anchors": a.anchors,
                   "time_s": max(r["time_s"] for r in res), "bytes_per_rank": max(r["bytes"] for r in res),
                   "peak_rss_mib": max(r["peak_rss_mib"] for r in res)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    json.dump(rows, open(a.output, "w"), indent=1)
    return rows


if __name__ == "__main__":
    main()
