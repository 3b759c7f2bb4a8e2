"""CPU benchmark of pipeline parallelism: PP 2 x CSBP (CP 2 + BP 2) against PP 2 x CP 2 on the same
4 ranks, through the trainer (`Trainer.train_step`: megatron-core's 1F1B schedule, DDP, optimizer).

Per rank: step time (median of the timed steps), attention bytes sent (the transports' counter),
P2P bytes sent between stages (megatron-core's P2P ops, counted at the call), and the live-tensor
peak of one step (`bench.memory.TensorPeakTracker`, an untimed step). Both layouts hold a sample on a
2-rank shard group, so every rank holds 2L/2 = L rows and the P2P tensors are the same size; the
attention traffic inside a stage differs (CP moves all rows' K/V, CSBP the clean rows' only).

    python -m megatron_csbp.bench.pipeline --out docs/benchmarks/pipeline
"""
from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from typing import Dict, List

from megatron_csbp.bench.report import bench_parser, write_out

LAYOUTS = {
    "PP2 x CSBP (CP2 + BP2)": ["--context-parallel-size", "2", "--block-parallel-size", "2"],
    "PP2 x CP2": ["--context-parallel-size", "2"],
}


def _model_flags(seq_length: int) -> List[str]:
    return (f"--mock-data --vocab-size 256 --num-layers 4 --hidden-size 128 --num-attention-heads 4 "
            f"--seq-length {seq_length} --block-size 16 --micro-batch-size 1 --global-batch-size 4 --train-iters 100 "
            f"--lr 1e-3 --pipeline-model-parallel-size 2 --attention-kernel tiled --no-progress-bar").split()


@contextmanager
def _p2p_bytes_sent():
    """A list whose one item counts the bytes this rank sends through megatron-core's pipeline P2P ops."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    from megatron_csbp.compat import swapped

    sent = [0]

    def counted(fn):
        def wrapper(**kw):
            sends = (kw.get("tensor_send_prev"), kw.get("tensor_send_next"))
            sent[0] += sum(t.numel() * t.element_size() for t in sends if t is not None)
            return fn(**kw)
        return wrapper

    with (swapped(p2p, "_batched_p2p_ops", counted(p2p._batched_p2p_ops)),
          swapped(p2p, "_p2p_ops", counted(p2p._p2p_ops))):
        yield sent


def _rank(rank: int, world: int, argv: List[str], steps: int) -> Dict:
    import torch
    from megatron.core import parallel_state as mpu

    from megatron_csbp.attention.accounting import traffic_counter
    from megatron_csbp.bench.memory import TensorPeakTracker
    from megatron_csbp.bench.worker import trainer_of

    torch.set_num_threads(1)
    with trainer_of(argv) as trainer:
        G = trainer.config.batch.global_batch_size
        trainer.train_step(0)  # warm-up (plans, buffers)
        times = []
        for k in range(1, steps + 1):  # bytes: the last step's
            traffic_counter().reset()
            with _p2p_bytes_sent() as sent:
                t0 = time.perf_counter()
                trainer.train_step(k * G)
                times.append(time.perf_counter() - t0)
            attn, p2p = traffic_counter().total, sent[0]
        with TensorPeakTracker() as tracker:
            trainer.train_step((steps + 1) * G)
        return dict(rank=rank, stage=mpu.get_pipeline_model_parallel_rank(),
                    rows=len(trainer.chunks[0].bdlm.plan.local), step_s=statistics.median(times), attn_bytes=attn,
                    p2p_bytes=p2p, peak_tensor_bytes=tracker.peak_bytes)


def run(seq_length: int, steps: int) -> Dict:
    from megatron_csbp.parallel.spawn import spawn

    out = {}
    for i, (name, flags) in enumerate(LAYOUTS.items(), 1):
        print(f"[bench.pipeline] layout {i}/{len(LAYOUTS)}: {name} on 4 ranks, {steps} steps", file=sys.stderr,
              flush=True)
        out[name] = spawn(_rank, 4, _model_flags(seq_length) + flags, steps)
    return out


def report(result: Dict, seq_length: int) -> str:
    lines = [
        "# Pipeline parallelism on CPU: PP 2 x CSBP vs PP 2 x CP",
        "",
        f"4 gloo ranks, the trainer (`Trainer.train_step`: megatron-core's 1F1B schedule, DDP, Adam), a 4-layer "
        f"GPT (hidden 128, 4 heads), L = {seq_length}, block 16, 4 micro-batches of 1 sample per iteration, "
        "fp32, tiled kernel. Per rank: step time (median), attention bytes sent per step (the transports' "
        "counter), P2P bytes sent per step (megatron-core's P2P ops, counted at the call), and the live-tensor "
        "peak of one step (weights, gradients, Adam state, activations of the in-flight micro-batches). Made by "
        "`python -m megatron_csbp.bench.pipeline --out docs/benchmarks/pipeline` (the machine was shared: "
        "times are indicative, bytes and tensor peaks are exact).",
        "",
        "| layout | rank | stage | rows | step s | attention MiB | P2P MiB | tensor peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {name} | {r['rank']} | {r['stage']} | {r['rows']} | {r['step_s']:.3f} | "
              f"{r['attn_bytes'] / 2**20:.2f} | {r['p2p_bytes'] / 2**20:.2f} | {r['peak_tensor_bytes'] / 2**20:.1f} |"
              for name, ranks in result.items() for r in sorted(ranks, key=lambda r: r["rank"])]
    lines += ["", "| layout | step s (slowest rank) | attention MiB / rank | P2P MiB / rank | tensor peak MiB, stage 0 / stage 1 |",
              "|---|---|---|---|---|"]
    for name, ranks in result.items():
        peak = {s: max(r["peak_tensor_bytes"] for r in ranks if r["stage"] == s) / 2**20 for s in (0, 1)}
        lines.append(f"| {name} | {max(r['step_s'] for r in ranks):.3f} | "
                     f"{max(r['attn_bytes'] for r in ranks) / 2**20:.2f} | {max(r['p2p_bytes'] for r in ranks) / 2**20:.2f} | "
                     f"{peak[0]:.1f} / {peak[1]:.1f} |")
    lines += ["", "P2P per step = 4 micro-batches x rows x b x hidden x 4 B, sent forward by stage 0 and backward by "
              "stage 1: the same for both layouts (every rank holds L rows on a 2-rank shard group). Attention "
              "bytes: CP moves every row's K/V around the shard group, CSBP only the clean rows' (half). Stage 0 "
              "holds the embedding and more in-flight micro-batches (1F1B), stage 1 the output layer and logits."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = bench_parser("pipeline", __doc__.split("\n")[0])
    p.add_argument("--out", default="docs/benchmarks/pipeline", help="writes OUT.md and OUT.json")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    result = run(a.seq_length, a.steps)
    write_out(a.out, {"seq_length": a.seq_length, "steps": a.steps, "layouts": result}, report(result, a.seq_length))
    return 0


if __name__ == "__main__":  # utils.cli.run under another name: this module's run() stays what main calls
    from megatron_csbp.utils.cli import run as run_cli

    sys.exit(run_cli(main))
