"""CPU benchmark of LoRA against full fine-tuning at the same layout: peak memory and step time side
by side in one run, through the trainer (`Trainer.train_step`: forward, backward, Megatron DDP, Adam).

On the same gloo ranks (CSBP: CP 2 x BP 2 by default), each rank builds the full fine-tuning
trainer and tracks one step's live-tensor peak (`bench.memory.TensorPeakTracker`), frees it, does
the same with `--lora-rank R` (the same model, seed and tokens), then builds both and times their
steps alternately, so the load of other jobs falls on both alike. Per rank: median step seconds
(wall and main-thread CPU), the tensor peak, the static tensors at the step's start (weights,
gradient buffers, optimizer state) and the trained parameters. How to read it: docs/lora.md,
"Memory, time and the planner".

    python -m megatron_csbp.bench.lora --steps 8 --profile docs/benchmarks/cpu_profile.json --out docs/benchmarks/lora
    python -m megatron_csbp.bench.lora --quick --out /tmp/lora_quick
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List

import torch

from megatron_csbp.bench.cases import trainer_argv
from megatron_csbp.bench.memory import step_memory
from megatron_csbp.bench.report import bench_parser, write_out
from megatron_csbp.bench.worker import slowest_rank_s, trainer_of

LAYOUTS = {"csbp": ["--context-parallel-size", "2", "--block-parallel-size", "2"],
           "cp": ["--context-parallel-size", "2"]}


@dataclass(frozen=True)
class LoRABench:
    layout: str = "csbp"
    seq_length: int = 512
    num_layers: int = 4
    hidden_size: int = 256
    ffn_hidden_size: int = 1024
    vocab_size: int = 512
    rank: int = 8
    steps: int = 3

    def flags(self) -> Dict:
        """The model as flags by dest: what the trainer builds (SwiGLU, tied embeddings, 4 heads) and
        the planner reads (`planner.model_config.from_flags`)."""
        return dict(vocab_size=self.vocab_size, num_layers=self.num_layers, hidden_size=self.hidden_size,
                    ffn_hidden_size=self.ffn_hidden_size, num_attention_heads=4, swiglu=True)

    def argv(self) -> List[str]:
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout {self.layout}: choose from {', '.join(LAYOUTS)}")
        return trainer_argv(dict(self.flags(), seq_length=self.seq_length, block_size=16, micro_batch_size=1,
                                 global_batch_size=1, train_iters=100, lr=1e-3, attention_kernel="tiled")) + LAYOUTS[self.layout]


QUICK = LoRABench(seq_length=128, num_layers=2, hidden_size=128, ffn_hidden_size=512, vocab_size=256, rank=4,
                  steps=1)
CASES = ("full", "lora")


def _trainer(argv: List[str]):
    trainer = trainer_of(argv).build()
    trainer.train_step(0)  # warm-up: plans, buffers, the optimizer's state
    return trainer


def _memory(argv: List[str]) -> Dict:
    """One case alone in the process: the live-tensor peak of its second step, the tensors live
    at that step's start, its parameters."""
    trainer = _trainer(argv)
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    peak, static, _ = step_memory(lambda: trainer.train_step(1))  # after the earlier case's reference cycles
    out = dict(peak_tensor_bytes=peak, static_tensor_bytes=static,
               params=sum(p.numel() for p in params), trained_params=sum(p.numel() for p in params if p.requires_grad))
    del trainer, params
    gc.collect()
    return out


def _times(trainers: Dict, steps: int) -> Dict:
    """Both cases' steps alternated (full, LoRA, full, ...), so the load of other jobs falls on
    both alike: per case the slowest rank's wall and main-thread CPU seconds of each step."""
    out = {case: {"step_times_s": [], "thread_cpu_times_s": []} for case in trainers}
    for k in range(2, steps + 2):
        for case, trainer in trainers.items():
            wall_s, cpu_s, _ = slowest_rank_s(lambda: trainer.train_step(k))  # a step lasts as long as its slowest rank
            out[case]["step_times_s"].append(wall_s)
            out[case]["thread_cpu_times_s"].append(cpu_s)
    for x in out.values():
        x.update(step_s=statistics.median(x["step_times_s"]), thread_cpu_s=statistics.median(x["thread_cpu_times_s"]))
    return out


def _rank(rank: int, world: int, bench: LoRABench) -> Dict:
    torch.set_num_threads(1)
    argv = {"full": bench.argv(), "lora": bench.argv() + ["--lora-rank", str(bench.rank)]}
    memory = {case: _memory(argv[case]) for case in CASES}  # each case alone
    times = _times({case: _trainer(argv[case]) for case in CASES}, bench.steps)
    return {"rank": rank, **{case: {**memory[case], **times[case]} for case in CASES}}


def run(bench: LoRABench, log=print, profile: str = None) -> Dict:
    from megatron_csbp.parallel.spawn import spawn

    log(f"[bench.lora] {bench.layout} on 2 ranks: full fine-tuning and LoRA rank {bench.rank}, the peak of each "
        f"alone, then {bench.steps} timed steps each, alternated")
    t0 = time.perf_counter()
    per_rank = sorted(spawn(_rank, 2, bench), key=lambda r: r["rank"])
    result = {"config": asdict(bench), "ranks": per_rank, "wall_s": time.perf_counter() - t0,
              "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "torch": torch.__version__}
    if profile:
        result["profile"], result["predicted"] = profile, predicted(bench, profile)
    result["summary"] = summary(result)
    return result


def predicted(bench: LoRABench, profile: str) -> Dict:
    """The planner's step seconds, peak and static bytes of both cases (`plan --lora-rank`'s cost
    model on the hardware profile FILE, tiled kernel, no reserve), the model as the trainer builds
    it from the flags (`LoRABench.flags`)."""
    from megatron_csbp.planner.cost import Layout, Workload, estimate
    from megatron_csbp.planner.hardware import GiB, load_hardware
    from megatron_csbp.planner.lora import LoRAPlan
    from megatron_csbp.planner.model_config import from_flags

    hw = replace(load_hardware(profile), reserved_gib=0.0, attention_kernel="tiled")
    model = from_flags(bench.flags(), "lora-bench")
    lay = Layout(1, 2, 2 if bench.layout == "csbp" else 1, 1, 1, distributed_optimizer=False)
    wl = Workload(bench.seq_length, 16, global_batch_size=1)
    out = {}
    for case, w in (("full", wl), ("lora", replace(wl, lora=LoRAPlan(bench.rank)))):
        e = estimate(model, lay, w, hw, 2)
        out[case] = {"step_s": e.step_time_s, "peak_tensor_bytes": e.peak_memory_gib * GiB,
                     "static_tensor_bytes": e.memory_gib["weights_grads_optimizer"] * GiB}
    return out


def summary(result: Dict) -> Dict:
    """Per case: the slowest rank's step, the largest rank's tensor peak and static tensors; and
    LoRA / full of each."""
    ranks = result["ranks"]
    keys = ("step_s", "peak_tensor_bytes", "static_tensor_bytes")
    out = {case: {**{k: max(r[case][k] for r in ranks) for k in ("step_s", "thread_cpu_s") + keys[1:]},
                  "trained_params": ranks[0][case]["trained_params"], "params": ranks[0][case]["params"]}
           for case in CASES}
    out["ratio"] = {k: out["lora"][k] / out["full"][k] for k in keys + ("thread_cpu_s",)}
    if "predicted" in result:
        p = result["predicted"]
        out["predicted_ratio"] = {k: p["lora"][k] / p["full"][k] for k in keys}
    return out


def report(result: Dict) -> str:
    c, s = result["config"], result["summary"]
    mib = lambda b: f"{b / 2 ** 20:.2f}"
    lines = [
        f"# LoRA vs full fine-tuning on CPU: {c['layout'].upper()} on 2 gloo ranks",
        "",
        f"The trainer (`Trainer.train_step`: forward, backward, Megatron DDP, Adam), a {c['num_layers']}-layer GPT "
        f"(hidden {c['hidden_size']}, FFN {c['ffn_hidden_size']}, 4 heads, vocabulary {c['vocab_size']}), L = "
        f"{c['seq_length']}, block 16, fp32, tiled kernel; LoRA rank {c['rank']} on linear_qkv, linear_proj, "
        f"linear_fc1, linear_fc2, in the same processes. Tensor peak = live-tensor high-water mark of a step with "
        "the case alone in the process (`bench.memory.TensorPeakTracker`), static = tensors live at that step's "
        "start (weights, gradient buffers, optimizer state); then both trainers built, their steps alternated "
        f"(full, LoRA, full, ...): step time = median of {c['steps']} each after a warm-up (the slowest rank's; "
        "CPU s: its main thread's CPU seconds). Times depend on the shared machine; bytes do not.",
        "",
        "| case | trained params | step s | CPU s | tensor peak MiB | static MiB |", "|---|---|---|---|---|---|"]
    lines += [f"| {case} | {s[case]['trained_params']:,} of {s[case]['params']:,} | {s[case]['step_s']:.3f} | "
              f"{s[case]['thread_cpu_s']:.3f} | {mib(s[case]['peak_tensor_bytes'])} | "
              f"{mib(s[case]['static_tensor_bytes'])} |" for case in CASES]
    r = s["ratio"]
    lines += ["", f"LoRA / full: step time {r['step_s']:.3f} (CPU s {r['thread_cpu_s']:.3f}), tensor peak "
              f"{r['peak_tensor_bytes']:.3f}, static {r['static_tensor_bytes']:.3f}."]
    if "predicted" in result:
        p, pr = result["predicted"], s["predicted_ratio"]
        lines += ["", f"The planner (`plan --lora-rank`'s cost model, profile `{result['profile']}`, tiled kernel, "
                  "no reserve), same model and layout:", "",
                  "| case | step s | peak MiB | static MiB |", "|---|---|---|---|"]
        lines += [f"| {case} | {p[case]['step_s']:.3f} | {mib(p[case]['peak_tensor_bytes'])} | "
                  f"{mib(p[case]['static_tensor_bytes'])} |" for case in CASES]
        lines += ["", f"Predicted LoRA / full: step time {pr['step_s']:.3f}, peak {pr['peak_tensor_bytes']:.3f}, "
                  f"static {pr['static_tensor_bytes']:.3f}."]
    lines += ["", "Per rank:", "",
              "| rank | case | step s | tensor peak MiB | static MiB |", "|---|---|---|---|---|"]
    lines += [f"| {rk['rank']} | {case} | {rk[case]['step_s']:.3f} | {mib(rk[case]['peak_tensor_bytes'])} | "
              f"{mib(rk[case]['static_tensor_bytes'])} |" for rk in result["ranks"] for case in CASES]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = bench_parser("lora", __doc__.split("\n")[0])
    p.add_argument("--out", default="docs/benchmarks/lora", help="writes OUT.md and OUT.json")
    p.add_argument("--quick", action="store_true", help="the CI-sized configuration (the other sizes ignored)")
    p.add_argument("--layout", default="csbp", choices=sorted(LAYOUTS))
    sizes = ("seq_length", "num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "rank", "steps")
    for name in sizes:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(LoRABench(), name))
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="a hardware profile (plan --profile FILE): the planner's prediction beside the measurement")
    a = p.parse_args(argv)
    bench = replace(QUICK if a.quick else LoRABench(**{name: getattr(a, name) for name in sizes}), layout=a.layout)
    result = run(bench, log=lambda m: print(m, file=sys.stderr, flush=True), profile=a.profile)
    write_out(a.out, result, report(result))
    return 0


if __name__ == "__main__":
    from megatron_csbp.utils.cli import run as run_cli

    sys.exit(run_cli(main))
