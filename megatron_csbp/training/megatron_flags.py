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
import os

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


# ---- training, checkpoint and logging flags ------------------------------------------------------

#: Megatron-LM's --ckpt-format choices; the trainer writes torch_dist only
CKPT_FORMATS = ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("more training, checkpoint and logging flags (Megatron-LM names)")
    t.add_argument("--train-samples", type=int, default=None,
                   help="train for this many samples instead of --train-iters (a multiple of --global-batch-size)")
    t.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm the learning rate up over this fraction of the decay steps (instead of "
                        "--lr-warmup-iters)")
    t.add_argument("--finetune", action="store_true",
                   help="load the --load checkpoint's weights only: iteration and consumed samples start at 0, "
                        "no optimizer, scheduler or RNG state")
    t.add_argument("--no-load-optim", action="store_true",
                   help="do not load the optimizer and learning-rate scheduler state of the --load checkpoint")
    t.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume, take the learning-rate schedule of the flags, not the --load checkpoint's "
                        "(Megatron-LM's rule; docs/megatron-lm.md \"Resuming with other learning-rate flags\")")
    t.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume, keep the --load checkpoint's learning-rate schedule whatever the flags say "
                        "(Megatron-LM's; without either flag a changed schedule is refused)")
    t.add_argument("--no-load-rng", action="store_true",
                   help="accepted: the trainer's checkpoints hold no RNG state (training noise is keyed by "
                        "(--seed, sample index))")
    t.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap DDP's gradient reduce-scatter/all-reduce with the backward pass")
    t.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with the next forward "
                        "(needs --use-distributed-optimizer and --overlap-grad-reduce)")
    t.add_argument("--num-workers", type=int, default=0,
                   help="DataLoader worker processes reading training samples ahead (default 0 here: in the "
                        "training process; Megatron-LM's default is 2)")
    t.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
                   help="torch_dist only (dist_checkpointing: reshards across every layout)")
    t.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep only the checkpoints at multiples of this (and the latest); a multiple of "
                        "--save-interval")
    t.add_argument("--wandb-project", type=str, default=None, help="Weights & Biases project (enables wandb logging)")
    t.add_argument("--wandb-exp-name", type=str, default=None, help="Weights & Biases run name")
    t.add_argument("--wandb-save-dir", type=str, default=None, help="wandb's folder (default: --save/wandb)")


def check_run_flags(args: argparse.Namespace) -> None:
    """Rules of the flags above; fills --train-iters from --train-samples. Runs after
    --global-batch-size is known."""
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise ValueError("give --train-iters or --train-samples, not both")
        if args.train_samples <= 0 or args.train_samples % args.global_batch_size:
            raise ValueError(f"--train-samples {args.train_samples} must be a positive multiple of "
                             f"--global-batch-size {args.global_batch_size}")
        args.train_iters = args.train_samples // args.global_batch_size
    elif args.train_iters is None:
        args.train_iters = 100
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise ValueError("give --lr-warmup-iters or --lr-warmup-fraction, not both")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.ckpt_format != "torch_dist":
        raise ValueError(f"--ckpt-format {args.ckpt_format}: the trainer writes and reads torch_dist checkpoints only "
                         "(dist_checkpointing, which reshards across TP / CP / BP / EP layouts)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("give --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, not both "
                         "(Megatron-LM's rule)")
    if (args.finetune or args.no_load_optim) and not args.load:
        flag = "--finetune" if args.finetune else "--no-load-optim"
        raise ValueError(f"{flag} needs --load CHECKPOINT")
    if args.overlap_param_gather:
        if not args.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (Megatron's rule)")
        if not args.overlap_grad_reduce:
            raise ValueError("--overlap-param-gather needs --overlap-grad-reduce (Megatron's rule)")
    if args.save_retain_interval is not None:
        if not args.save_interval:
            raise ValueError("--save-retain-interval needs --save-interval")
        if args.save_retain_interval <= 0 or args.save_retain_interval % args.save_interval:
            raise ValueError(f"--save-retain-interval {args.save_retain_interval} must be a positive multiple of "
                             f"--save-interval {args.save_interval}")
    if args.wandb_project:
        if not args.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name (Megatron's rule)")
        if not (args.wandb_save_dir or args.save):
            raise ValueError("--wandb-project needs --wandb-save-dir or --save (wandb writes to --save/wandb)")
        args.wandb_save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs the wandb package (pip install wandb; WANDB_MODE=offline "
                             "logs without an account)")


# ---- MoE -----------------------------------------------------------------------------------------

#: Megatron's load-balancing types; the trainer takes those whose loss does not depend on how the
#: sequence is split over ranks (see check_moe_flags)
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def moe_freq_type(x):
    """Megatron's --moe-layer-freq: an int N (one MoE layer every N), or a Python list expression of
    0/1 per layer such as "([1]*3+[0]*1)*3"."""
    if "[" in str(x):
        pattern = eval(str(x), {"__builtins__": {}})  # Megatron-LM evaluates the same expression
        if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
            raise argparse.ArgumentTypeError(f"--moe-layer-freq {x!r} must give a list of 0/1 per layer")
        return pattern
    return int(x)


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts (Megatron-LM names)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (None: dense)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="expert FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="one MoE layer every N layers, or a 0/1 pattern per layer such as \"([1]*3+[0]*1)*3\"")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before top-k (default: top-k logits, then softmax over them)")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING, default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="weight of the load-balancing loss")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None, help="router input jitter (Mixtral)")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"), default="allgather")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="grouped GEMM experts (CUDA)")


def moe_pattern(args):
    """1 where layer i is MoE (Megatron's moe_layer_freq as a list)."""
    freq = args.moe_layer_freq
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(args.num_layers)]


def check_moe_flags(args: argparse.Namespace) -> None:
    """Rules of the MoE flags of a flag-built model."""
    if args.num_experts is None:
        return
    if args.model_shape is not None:
        return  # a converted model's MoE comes from its shape (apply_model_shape compares the flags)
    if args.num_experts < 1:
        raise ValueError(f"--num-experts must be positive, got {args.num_experts}")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ValueError(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts "
                         f"{args.num_experts}")
    pattern = moe_pattern(args)
    if len(pattern) != args.num_layers or not any(pattern):
        raise ValueError(f"--moe-layer-freq {args.moe_layer_freq}: {len(pattern)} entries for --num-layers "
                         f"{args.num_layers}, at least one MoE layer")
    if args.moe_token_dispatcher_type == "flex":
        raise ValueError("--moe-token-dispatcher-type flex needs DeepEP (CUDA): use allgather or alltoall")
    if args.moe_grouped_gemm:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--moe-grouped-gemm needs CUDA (grouped GEMM kernels); on CPU leave it off "
                             "(SequentialMLP experts, the same weights)")
    if args.moe_aux_loss_coeff and args.moe_router_load_balancing_type not in ("none",):
        # Megatron's load-balancing losses are computed from the tokens each rank routes: under CP /
        # BP / CSBP a rank routes its rows (noisy and clean copies, a layout-dependent subset), so the
        # loss would depend on the layout. Refused rather than silently layout-dependent.
        raise ValueError(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} with --moe-router-load-balancing-type "
                         f"{args.moe_router_load_balancing_type}: the load-balancing loss is computed per rank from "
                         "its rows, which block/context parallelism splits differently; train with "
                         "--moe-aux-loss-coeff 0 (the default) or --moe-router-load-balancing-type none")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size


def moe_config(a) -> dict:
    """TransformerConfig fields of the MoE flags (ModelArgs `a`; {} for a dense model)."""
    if not a.num_experts:
        return {}
    return dict(num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
                moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_layer_freq=a.moe_layer_freq,
                moe_router_score_function=a.moe_router_score_function,
                moe_router_pre_softmax=a.moe_router_pre_softmax,
                moe_router_load_balancing_type=a.moe_router_load_balancing_type,
                moe_aux_loss_coeff=a.moe_aux_loss_coeff, moe_input_jitter_eps=a.moe_input_jitter_eps,
                moe_token_dispatcher_type=a.moe_token_dispatcher_type, moe_grouped_gemm=a.moe_grouped_gemm,
                expert_model_parallel_size=a.expert_model_parallel_size)
