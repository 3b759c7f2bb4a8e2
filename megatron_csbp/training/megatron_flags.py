"""Megatron-LM model flags the trainer takes beyond its core set, with Megatron's names and
meanings: the ones `convert hf-to-megatron` prints as "flags that rebuild this model" (a test keeps
that list and this parser in agreement: tests/test_megatron_flags.py).

- `--qk-layernorm`, `--norm-epsilon`, `--rotary-percent`, `--add-qkv-bias`, `--use-rope-scaling`
  / `--rope-scaling-factor`, `--rotary-seq-len-interpolation-factor`: shape the flag-built model
  (TransformerConfig / GPTModel fields of the same names) and, with `--load` of a converted model,
  must agree with its `megatron_csbp_model.json`.
- `--transformer-impl local`: the trainer builds Megatron's local spec (its core attention replaced
  by block-diffusion attention); `transformer_engine` is refused by name.
- `--no-masked-softmax-fusion`, `--no-bias-swiglu-fusion`, `--no-rope-fusion`,
  `--no-bias-dropout-fusion`, `--no-persist-layer-norm`, `--no-gradient-accumulation-fusion`:
  Megatron's switches that turn fused kernels off. The trainer never fuses (exactness is checked
  against unfused math, `model.builder.PORTABLE_CONFIG`), so each states what already holds.
"""
from __future__ import annotations

import argparse

#: fusion switches (flag, dest): accepted, the trainer runs unfused whatever they say
FUSION_FLAGS = (("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                ("--no-rope-fusion", "apply_rope_fusion"),
                ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
                ("--no-persist-layer-norm", "persist_layer_norm"),
                ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"))


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("more model flags (Megatron-LM names)")
    m.add_argument("--qk-layernorm", action="store_true",
                   help="RMSNorm on each head's queries and keys (Qwen3); exported as Qwen3ForCausalLM")
    m.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of every normalization layer")
    m.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of each head's dims that rope rotates")
    m.add_argument("--add-qkv-bias", action="store_true",
                   help="bias on the q/k/v projections only (Qwen2); exported as Qwen2ForCausalLM")
    m.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1 rope scaling")
    m.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling")
    m.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="linear rope interpolation (positions divided by this factor)")
    m.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="local only (the default here): block-diffusion attention replaces the core attention of "
                        "Megatron's local spec")
    for flag, dest in FUSION_FLAGS:
        m.add_argument(flag, dest=dest, action="store_false", default=False,
                       help="accepted: the trainer never fuses (exactness is checked against unfused math)")


def check_model_flags(args: argparse.Namespace) -> None:
    """Rules of the flags above (before any process group exists)."""
    if args.transformer_impl != "local":
        raise ValueError(f"--transformer-impl {args.transformer_impl}: the trainer builds Megatron's local spec "
                         "(block-diffusion attention replaces its core attention); use --transformer-impl local")
    if not args.norm_epsilon > 0:
        raise ValueError(f"--norm-epsilon must be positive, got {args.norm_epsilon}")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.rotary_seq_len_interpolation_factor is not None and args.rotary_seq_len_interpolation_factor < 1:
        raise ValueError(f"--rotary-seq-len-interpolation-factor must be >= 1, got "
                         f"{args.rotary_seq_len_interpolation_factor}")
    if args.use_rope_scaling and args.rotary_seq_len_interpolation_factor is not None:
        raise ValueError("give --use-rope-scaling or --rotary-seq-len-interpolation-factor, not both")


def rope_scaling(args) -> dict:
    """GPTModel's rope keywords of the flags."""
    out = dict(rotary_percent=args.rotary_percent)
    if args.use_rope_scaling:
        out.update(rope_scaling=True, rope_scaling_factor=args.rope_scaling_factor)
    if args.rotary_seq_len_interpolation_factor is not None:
        out.update(seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor)
    return out
