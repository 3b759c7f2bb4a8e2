"""Single-rank block-diffusion training of a tiny Megatron-core GPT on the shipped corpus.

    python -m megatron_csbp.demo [--steps 600] [--output-dir runs/demo]   (--help for every flag)

The corpus (the Python language reference text of `megatron_csbp.data`, or `--corpus`) is tokenized
into Megatron's indexed format with an EOD token after every document, and the last 10% of the
documents are held out (Megatron's `--split`). A stock megatron-core `GPTModel` (local layer spec
with the core attention swapped for `BlockDiffusionAttention`; RMSNorm, SwiGLU, rotary) is trained
by the trainer (`Trainer.train`: Megatron's DDP and Adam, cosine schedule) with the BD3-LM
objective (mask token excluded from the softmax, 1/t weights). Training draws block times from the
clipped range [0.3, 0.8] (BD3-LM's clipped schedule, which cuts the variance of the 1/t weights);
every reported loss is the NELBO with the full range t ~ U[1e-3, 1] (`Trainer.evaluate`): an upper
bound on the model's negative log-likelihood in nats/token. It is compared to the unigram entropy
of the training tokens (the loss of the best context-free model): a held-out NELBO below it means
the model uses context.

Prints the trainer's line every `--log-interval` steps, the unigram entropy and the final train and
held-out losses; writes `loss_curve.png` and `metrics.json` to `--output-dir` (default runs/demo).
One rank (world size 1); CPU, or one GPU when CUDA is available. The library: `training/demo.py`.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Optional, Sequence

from megatron_csbp.utils.cli import ArgumentParser, filter_warnings


def parse_args(argv: Optional[Sequence[str]] = None):
    from megatron_csbp.training.demo import DemoConfig

    p = ArgumentParser(prog="python -m megatron_csbp.demo", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(DemoConfig):
        name, default = str(f.type).replace("Optional[", "").rstrip("]"), f.default
        kind = dict(action=argparse.BooleanOptionalAction) if name == "bool" else \
            dict(type={"int": int, "float": float}.get(name, str))
        p.add_argument("--" + f.name.replace("_", "-"), default=default, help=f"(default: {default})", **kind)
    return DemoConfig(**vars(p.parse_args(argv)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    filter_warnings()  # hide the library warnings a user cannot act on
    cfg = parse_args(argv)
    from megatron_csbp.training.demo import run
    from megatron_csbp.training.trainer import destroy_process_groups

    try:
        run(cfg, log=lambda s: print(s, flush=True))
    finally:
        destroy_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
