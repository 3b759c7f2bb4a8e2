"""`python -m megatron_csbp.explain [trainer flags | --recipe FILE] [--out DIR]`: a layout's rows, tiles
and K/V graph per rank, static (`layout/explain.py`, whose text is --help)."""
from __future__ import annotations

import argparse
import os
import sys

from megatron_csbp.layout.explain import draw, explain, text_report
from megatron_csbp.layout.layout import OWNERSHIP_SCHEDULES
from megatron_csbp.utils.cli import ArgumentParser


def parse_args(argv=None):
    from megatron_csbp.layout import explain as library

    p = ArgumentParser(prog="python -m megatron_csbp.explain", description=library.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=None, help="a recipe (examples/recipes/*.yaml): its trainer flags")
    for flag, default in (("--seq-length", None), ("--block-size", None), ("--context-parallel-size", 1),
                          ("--block-parallel-size", 1)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--block-ownership", choices=OWNERSHIP_SCHEDULES, default="mirrored")
    p.add_argument("--clean-attention", default="block_causal")
    for flag in ("--num-attention-heads", "--num-query-groups", "--kv-channels", "--hidden-size"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--fp32", action="store_true", help="4-byte K/V (default: bf16, 2 bytes)")
    p.add_argument("--tile", type=int, default=None, help="tile rows/keys of the picture (default: 2L / 64)")
    p.add_argument("--out", default=None, help="folder for explain.txt and explain.png")
    p.add_argument("--title", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args, others = p.parse_known_args(argv)  # the trainer's other flags do not change the layout
    if args.recipe:
        from megatron_csbp.launch.recipes import load_recipe, recipe_flags

        args, others = p.parse_known_args(recipe_flags(load_recipe(args.recipe)) + argv)
    from megatron_csbp.training.arguments import build_parser

    trainer_flags = build_parser()._option_string_actions  # a flag neither explain's nor the trainer's: refused
    unknown = [a for a in others if a.startswith("-") and a.split("=")[0] not in trainer_flags]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not args.seq_length or not args.block_size:
        p.error("--seq-length and --block-size are required (or --recipe FILE)")
    return args


def main(argv=None) -> int:
    from megatron_csbp.layout.sizes import layout_kind
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()
    args = parse_args(argv)
    heads = args.num_attention_heads
    groups = args.num_query_groups or heads or 8
    head_dim = args.kv_channels or (args.hidden_size // heads if args.hidden_size and heads else 128)
    tp = args.tensor_model_parallel_size
    try:
        views = explain(args.seq_length, args.block_size, args.context_parallel_size, args.block_parallel_size,
                        args.block_ownership, args.clean_attention, max(1, groups // tp), head_dim,
                        4 if args.fp32 else 2, args.tile)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kind = layout_kind(args.context_parallel_size, args.block_parallel_size).upper()
    title = args.title or (f"{kind}: CP {args.context_parallel_size} x BP {args.block_parallel_size}, "
                           f"L = {args.seq_length}, B = {args.block_size}, K/V {groups // tp} x {head_dim} per rank")
    report = text_report(views, title)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "explain.txt"), "w") as f:
            f.write(report + "\n")
        try:
            draw(views, title, os.path.join(args.out, "explain.png"), args.seq_length)
        except ImportError:
            print("matplotlib not installed: explain.png not drawn", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
