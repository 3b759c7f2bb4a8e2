"""`python -m megatron_csbp.bench`: single rank, CP, BP and CSBP on CPU gloo ranks, one run.

Default (a few minutes on two cores): 2 layers, L = 256, 512, 1024, P = 2 and 4, every layout.
`--quick`: the CI-sized configuration used by the test suite.
`--model diffusiongemma-hybrid`: a tiny DiffusionGemma with 5 sliding-window : 1 full layers;
single rank, CP and CSBP (CP = BP = P = 2) on it and on the same weights with every layer full
attention, L = 128, 256, 512 (`--quick`: L = 128). Report: diffusiongemma.md (or _quick).
`--long-context`: one step of a 2-layer, hidden-64 GPT under single, CP and CSBP (P = 2) at
L = 2K-32K, tiled kernel vs the dense math kernel (up to `--old-max-length`): peak memory per rank,
step and attention time, allowed pairs (`bench.long_context`). Report: long_context.md.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from dataclasses import replace

from megatron_csbp.bench.cases import ALL_LAYOUTS, MODEL_FLAGS, BenchConfig, dg_config, dg_quick_config, quick_config

MODELS = ("gpt", "diffusiongemma-hybrid")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_csbp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-sized configuration (overrides the size flags)")
    p.add_argument("--model", choices=MODELS, default="gpt",
                   help="gpt (default): the tiny GPT; diffusiongemma-hybrid: 5 sliding : 1 full layers, "
                        "hybrid vs every layer full attention")
    p.add_argument("--sliding-window", type=int, default=None, help="diffusiongemma-hybrid only")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=None, help="clean tokens L per sample")
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="shard-group sizes P (>= 2); --long-context: world sizes to run (1 and/or 2)")
    p.add_argument("--layouts", nargs="+", default=None, choices=ALL_LAYOUTS)
    for name in MODEL_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per case")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case (median reported)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory-tracking step")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--output-dir", default="docs/benchmarks")
    p.add_argument("--name", default=None, help="basename of the report files (default: cpu or cpu_quick)")
    p.add_argument("--from-json", metavar="FILE", help="re-render the report and plots of a saved run (no run)")
    p.add_argument("--long-context", action="store_true",
                   help="the long-context benchmark (bench.long_context); takes --seq-lengths, --old-max-length, "
                        "--output-dir, --name, --from-json, --no-plots")
    p.add_argument("--attention-scaling", action="store_true",
                   help="--long-context: only time one layer's attention on the single-rank plan (thread CPU "
                        "time) per kernel and L; written next to the report and shown in it")
    p.add_argument("--old-max-length", type=int, default=None,
                   help="--long-context: longest L run with the dense math kernel (default 4096)")
    return p.parse_args(argv)


def config_from_args(args) -> BenchConfig:
    dg = args.model == "diffusiongemma-hybrid"
    if dg and args.layouts:
        raise ValueError("--layouts: the diffusiongemma-hybrid model runs single, CP and CSBP (all-gather) only")
    if not dg and args.sliding_window is not None:
        raise ValueError("--sliding-window applies to --model diffusiongemma-hybrid only")
    cfg = ((dg_quick_config if args.quick else dg_config) if dg else (quick_config if args.quick else BenchConfig))()
    overrides = {k: getattr(args, k) for k in MODEL_FLAGS + ("sliding_window",) if getattr(args, k) is not None}
    cfg = replace(cfg, model=replace(cfg.model, **overrides), measure_memory=not args.no_memory,
                  **{k: tuple(getattr(args, k)) for k in ("seq_lengths", "sizes", "layouts") if getattr(args, k)},
                  **{k: getattr(args, k) for k in ("warmup", "steps") if getattr(args, k) is not None})
    cfg.check()
    return cfg


def main(argv=None) -> int:
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = ("python -m megatron_csbp.bench " + shlex.join(argv)).strip()
    from megatron_csbp.bench import long_context
    from megatron_csbp.bench.report import load, save

    if args.long_context:
        files = long_context.main(args, command)
    elif args.from_json:
        result = load(args.from_json)
        name = args.name or os.path.splitext(os.path.basename(args.from_json))[0]
        files = save(result, args.output_dir, name, result["command"], with_plots=not args.no_plots)
    else:
        try:
            cfg = config_from_args(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        from megatron_csbp.bench.runner import run

        result = run(cfg)
        base = "diffusiongemma" if args.model == "diffusiongemma-hybrid" else "cpu"
        name = args.name or (f"{base}_quick" if args.quick else base)
        files = save(result, args.output_dir, name, command, with_plots=not args.no_plots)
    for kind, path in files.items():
        print(f"[bench] wrote {kind}: {path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
