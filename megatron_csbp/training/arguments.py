"""Command line of `python -m megatron_csbp.train`: Megatron-LM's flag names plus the block-diffusion
ones (the same set `megatron_csbp.megatron_lm.extra_args_provider` adds to Megatron-LM).

Every rule is checked before any process group exists; a violation exits with a message naming
the flag and the rule.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional, Sequence

from megatron_csbp.data.megatron_data import TOKENIZER_TYPES
from megatron_csbp.layout.masks import CLEAN_ATTENTION_VARIANTS
from megatron_csbp.objectives.registry import (add_objective_args, build_objective, objective_class, objective_help,
                                               objective_names, objective_options)

#: Megatron's AttnBackend names -> the block-diffusion attention kernel they select
ATTENTION_BACKENDS = ("auto", "local", "unfused", "flash", "fused")
BACKEND_KERNEL = {"local": "tiled", "unfused": "math", "flash": "flex", "fused": "flex"}


def __getattr__(name):
    if name == "OBJECTIVES":  # `--objective`'s choices: the objective registry's names, in its order
        return objective_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_block_diffusion_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our flags (also used as Megatron-LM's extra_args_provider)."""
    g = parser.add_argument_group("block diffusion")
    g.add_argument("--block-parallel-size", type=int, default=1,
                   help="ranks sharing one sample by noisy blocks (BP); CSBP when --context-parallel-size > 1 "
                        "too. Must be a multiple of --context-parallel-size.")
    g.add_argument("--block-size", type=int, default=16, help="block diffusion block size; must divide --seq-length")
    g.add_argument("--objective", choices=objective_names(), default="bd3lm", help=objective_help())
    add_objective_args(g)  # each objective's flags (megatron_csbp/objectives/), shared ones once
    g.add_argument("--clean-attention", choices=CLEAN_ATTENTION_VARIANTS, default=None,
                   help="clean stream mask (default: token_causal for DiffusionGemma models, block_causal otherwise)")
    g.add_argument("--attention-transport", choices=("allgather", "ring"), default="allgather")
    g.add_argument("--block-ownership", choices=("mirrored", "contiguous"), default="mirrored")
    g.add_argument("--attention-kernel", choices=("auto", "cpu_flash", "tiled", "math", "flex", "flash"),
                   default="auto",
                   help="kernel of the block-diffusion core attention, for every model family (flag-built GPT, "
                        "converted models, DiffusionGemma): auto = flex on CUDA, cpu_flash elsewhere; cpu_flash = "
                        "the flash decomposition on torch's CPU flash attention (CPU only); tiled = "
                        "block-sparse tiles with memory linear in the rows (any device); math = dense reference "
                        "for small cases; flex = FlexAttention from row vectors; flash = flash-attn varlen for the "
                        "noisy block-diagonal and token-causal clean pieces, flex for the rest (needs flash-attn); "
                        "--attention-backend selects it too")
    g.add_argument("--log-json", type=str, default=None, help="append one JSON object per logged iteration")
    return parser


def build_parser() -> argparse.ArgumentParser:
    from megatron_csbp.utils.cli import ArgumentParser  # an argument error is one line, not the usage

    p = ArgumentParser(prog="python -m megatron_csbp.train",
                                description="Train a block diffusion LM with Megatron-core (launch with torchrun). "
                                            "With no flags at all: the embedded CSBP demo.")
    m = p.add_argument_group("model (Megatron-LM names)")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--ffn-hidden-size", type=int, default=None)
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--num-query-groups", type=int, default=None)
    m.add_argument("--kv-channels", type=int, default=None,
                   help="projection size per attention head (default: --hidden-size / --num-attention-heads)")
    m.add_argument("--group-query-attention", action="store_true", help="accepted for Megatron-LM compatibility")
    m.add_argument("--seq-length", type=int, default=128)
    m.add_argument("--max-position-embeddings", type=int, default=None)
    m.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default="RMSNorm")
    m.add_argument("--swiglu", action="store_true", default=True)
    m.add_argument("--no-swiglu", dest="swiglu", action="store_false")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--position-embedding-type", choices=("rope",), default="rope",
                   help="rope only: block diffusion indexes rotary angles by each row's position")
    m.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=False,
                   help="no biases in linear layers (the default here; Megatron-LM's default is with biases)")
    m.add_argument("--add-bias-linear", dest="add_bias_linear", action="store_true",
                   help="biases in the linear layers of a flag-built model")
    m.add_argument("--attention-dropout", type=float, default=0.0,
                   help="must be 0: dropout on attention probabilities would make the loss depend on the layout")
    m.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout after attention and MLP (Megatron's)")
    m.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="Megatron's attention backend names for the block-diffusion core attention (which replaces "
                        "Megatron's): local -> --attention-kernel tiled, unfused -> math, flash/fused -> flex, auto -> "
                        "--attention-kernel; also set as TransformerConfig.attention_backend")
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--rotary-base", type=int, default=10000)
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--bf16", action="store_true")
    # Megatron's fp16 mixed precision: float16 weights with fp32 main weights in the optimizer and a
    # loss scale (dynamic unless --loss-scale is given); a step whose gradients overflow is skipped.
    m.add_argument("--fp16", action="store_true")
    m.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic, with --fp16)")
    m.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    m.add_argument("--min-loss-scale", type=float, default=1.0)
    m.add_argument("--loss-scale-window", type=float, default=1000)
    m.add_argument("--hysteresis", type=int, default=2)
    m.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recomputation (Megatron's TransformerConfig.recompute_granularity)")
    m.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with --recompute-granularity full (default there: uniform)")
    m.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with --recompute-granularity full: layers per recomputed chunk (uniform) or recomputed "
                        "layers (block); default 1")

    t = p.add_argument_group("training (Megatron-LM names)")
    t.add_argument("--micro-batch-size", type=int, default=2)
    t.add_argument("--global-batch-size", type=int, default=None)
    t.add_argument("--train-iters", type=int, default=None, help="default 100 (or --train-samples)")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--min-lr", type=float, default=0.0, help="Megatron-LM's default 0")
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-decay-iters", type=int, default=None)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
                   default="linear", help="Megatron-LM's default linear")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999, help="Megatron-LM's default 0.999")
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--use-distributed-optimizer", action="store_true")
    t.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help="stop the run, naming the iteration, when the loss or the gradient norm is "
                                      "NaN or infinite (the default, as in Megatron-LM)")
    t.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="train on through non-finite losses (a checkpoint is still never saved "
                                              "with non-finite weights)")

    par = p.add_argument_group("parallelism (Megatron-LM names)")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    from megatron_csbp.pipeline import add_pipeline_args
    add_pipeline_args(par)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--expert-model-parallel-size", type=int, default=1)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                     help="default: nccl with CUDA, gloo without")

    c = p.add_argument_group("checkpoints and logs (Megatron-LM names)")
    c.add_argument("--save", type=str, default=None)
    c.add_argument("--load", type=str, default=None)
    c.add_argument("--save-interval", type=int, default=None)
    c.add_argument("--save-initial", action="store_true",
                   help="also save the untrained weights as iteration 0 before the first step (for comparison, "
                        "e.g. python -m megatron_csbp.generate --ckpt-step 0)")
    c.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    c.add_argument("--log-interval", type=int, default=10)
    c.add_argument("--eval-interval", type=int, default=None)
    c.add_argument("--eval-iters", type=int, default=None,
                   help="global batches per evaluation (default: Megatron-LM's 100 when --eval-interval or "
                        "--skip-train asks for evaluations, else 0)")
    c.add_argument("--skip-train", action="store_true")
    c.add_argument("--tensorboard-dir", type=str, default=None)
    c.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit after every iteration that is a multiple of this (Megatron-LM's)")
    c.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit after the first iteration that ends more than this many "
                        "minutes after the program started (Megatron-LM's; all ranks agree)")
    c.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (Slurm's preemption / time limit, torchrun's shutdown), finish the iteration, "
                        "save a checkpoint (with --save) and exit 0 (Megatron-LM's; all ranks agree)")
    c.add_argument("--no-progress-bar", action="store_true")

    d = p.add_argument_group("data (Megatron-LM names)")
    d.add_argument("--data-path", nargs="*", default=None, help="PREFIX or W1 PREFIX1 W2 PREFIX2 ...")
    d.add_argument("--split", type=str, default="969,30,1")
    d.add_argument("--data-cache-path", type=str, default=None)
    d.add_argument("--sft-data-path", type=str, default=None, help="jsonl of conversations or prompt/response pairs")
    d.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    d.add_argument("--tokenizer-model", type=str, default=None,
                   help="sentencepiece .model, or a local Hugging Face tokenizer folder (default with --load and "
                        "HuggingFaceTokenizer: the checkpoint's hf_assets)")
    d.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: Megatron-LM's meaning on the installed megatron-core (0.16: data ids "
                        "0..V-1 plus EOD V; 0.19: V ids, EOD V-1); the model pads the tokenizer's vocabulary to "
                        "--make-vocab-size-divisible-by and the default mask id is the first padding id")
    d.add_argument("--mock-data", action="store_true")
    # Megatron's packed-document flags (same names and meaning; docs/semantics.md "Packed documents")
    d.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart at 0 after every EOD token (each document's own positions)")
    d.add_argument("--reset-attention-mask", action="store_true",
                   help="attention stays inside each EOD-delimited document (the EOD belongs to the document it "
                        "ends); a block cut by a boundary is one block per document")
    d.add_argument("--eod-mask-loss", action="store_true", help="EOD tokens are no loss targets")
    d.add_argument("--pack-sequences", action="store_true",
                   help="with --sft-data-path: first-fit packing of conversations into --seq-length, each its own "
                        "document (--reset-attention-mask / --reset-position-ids then use the conversations)")

    from megatron_csbp.training.megatron_flags import add_model_flags, add_moe_flags, add_run_flags

    add_model_flags(p)
    add_moe_flags(p)
    add_run_flags(p)
    add_block_diffusion_args(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world_size)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def validate_args(args: argparse.Namespace, world_size: int, check_only: bool = False) -> argparse.Namespace:
    """Fill derived values and refuse bad input with a message naming the flag and the rule
    (`check_flags`); then what the --load checkpoint must be: one at all when the run starts from
    pretrained weights, and trained with the same model flags (its `bdlm_meta.json`)."""
    check_flags(args, world_size, check_only)
    check_pretrained(args)
    if args.load_step is not None:
        from megatron_csbp.training.checkpointing import check_model_flags
        check_model_flags(args, args.load, args.load_step)
    return args


def check_flags(args: argparse.Namespace, world_size: int, check_only: bool = False) -> argparse.Namespace:
    """Fill derived values and refuse bad input with a message naming the flag and the rule.

    `check_only` (`python -m megatron_csbp.launch RECIPE --check`, on a machine that need not hold
    the run's files): a --load checkpoint or tokenizer that is not here, and flags whose values are
    placeholders (`args.placeholders`, a set of dests), skip the rules that need them; every other
    rule runs. What was skipped is appended to `args.check_notes`."""
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.parallel_state import check_topology

    placeholders = set(getattr(args, "placeholders", ()))
    args.check_notes = []
    args.shape_unknown = False
    objective_class(args.objective).prepare_args(args, check_only)  # e.g. dflash: sizes from its features
    args.load_step = None  # what --load [--ckpt-step] loads: an iteration, "release", or None
    check_counts(args)

    sizes = check_topology(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.context_parallel_size, args.block_parallel_size, args.expert_model_parallel_size)
    args.world_size = world_size
    shard_group = sizes.shard_group_size
    args.data_parallel_size = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                                             * shard_group)
    args.model_shape = None
    if args.load and check_only and ("load" in placeholders or not os.path.exists(args.load)):
        args.shape_unknown = True
        args.check_notes.append(f"--load {args.load} is not here: the model-shape rules (flags vs the checkpoint's "
                                "shape, MoE and DiffusionGemma requirements) run at launch")
    elif args.load or args.ckpt_step is not None:
        from megatron_csbp.training.checkpointing import checkpoint_shape, checkpoint_to_load
        args.load_step = checkpoint_to_load(args.load, args.ckpt_step)
        args.model_shape = checkpoint_shape(args.load, args.load_step)
    if args.model_shape is not None:
        apply_model_shape(args, args.model_shape)
    check_clean_attention(args)
    # The block geometry and the layout of the shard group, as the model will build them: their
    # own rules (whole blocks, zigzag chunks, a block for every block-parallel rank) run here.
    SequenceLayout(BlockGeometry(args.seq_length, args.block_size, args.clean_attention),
                   args.context_parallel_size, args.block_parallel_size, args.block_ownership)
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
                         f"{args.num_attention_heads}")
    if args.model_shape is None and args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} must divide --hidden-size {args.hidden_size}")
    tp = args.tensor_model_parallel_size
    if args.num_query_groups % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide --num-query-groups {args.num_query_groups}")
    check_model_options(args, check_only)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM does the same
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size if not args.swiglu else int(8 * args.hidden_size / 3 / 16 + 0.999) * 16
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_microbatches = args.global_batch_size // per_step
    from megatron_csbp.training.megatron_flags import check_run_flags

    check_run_flags(args)
    check_experts_and_objective(args)
    # Data and tokenizer.
    sources = [bool(args.mock_data), bool(args.data_path), bool(args.sft_data_path),
               bool(getattr(args, "features_path", None))]
    if sum(sources) == 0:
        raise ValueError("give one of --mock-data, --data-path or --sft-data-path")
    if sum(sources) > 1:
        raise ValueError("--mock-data, --data-path and --sft-data-path are mutually exclusive")
    if args.data_path and "data_path" not in placeholders:
        from megatron_csbp.objectives.data import check_token_data
        note = check_token_data(args, files_elsewhere=check_only)
        if note:
            args.check_notes.append(note)
    if args.fp16 and args.bf16:
        raise ValueError("give --bf16 or --fp16, not both")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ValueError(f"--loss-scale must be positive, got {args.loss_scale}")
    if args.pack_sequences and not args.sft_data_path:
        raise ValueError("--pack-sequences packs conversations: it needs --sft-data-path")
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if (args.mock_data and args.tokenizer_model is None) else \
            "SentencePieceTokenizer"
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        raise ValueError("--tokenizer-type NullTokenizer (and --mock-data without --tokenizer-model) needs --vocab-size")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")
    if args.save_interval and not args.save:
        raise ValueError("--save-interval needs --save DIR")
    if args.save_initial and not args.save:
        raise ValueError("--save-initial needs --save DIR")
    if args.skip_train and not args.eval_iters:
        raise ValueError("--skip-train evaluates only: give --eval-iters > 0")
    from megatron_csbp.pipeline import check_pipeline_args
    check_pipeline_args(args)
    if (args.pipeline_model_parallel_size > 1 and args.micro_batch_size > 1
            and not objective_class(args.objective).fixed_rows
            and (args.reset_attention_mask or args.reset_position_ids)):
        # Samples with different documents run one by one and a stage sends their hidden states
        # side by side ([rows, b, h]): that needs the same rows in every sample.
        raise ValueError(f"--objective {args.objective} gives each packed sample its own rows: under "
                         "--pipeline-model-parallel-size > 1 with --reset-attention-mask / --reset-position-ids "
                         "use --micro-batch-size 1")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    # Tokenizer facts (cheap to load): vocabulary, EOD, default mask token.
    from megatron_csbp.data.megatron_data import build_tokenizer

    if check_only and args.tokenizer_type != "NullTokenizer" and (
            "tokenizer_model" in placeholders or (args.tokenizer_model and not os.path.exists(args.tokenizer_model))):
        args.check_notes.append(f"--tokenizer-model {args.tokenizer_model} is not here: the vocabulary and mask-token "
                                "rules run at launch")
        return args
    tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    if (args.vocab_size and args.tokenizer_type != "NullTokenizer" and args.vocab_size != tok.vocab_size
            and args.model_shape is None):  # a checkpoint's vocabulary may exceed its tokenizer's (checked below)
        raise ValueError(f"--vocab-size {args.vocab_size} disagrees with the tokenizer's {tok.vocab_size}")
    args.vocab_size = tok.vocab_size  # from here on the tokenizer's vocabulary, EOD included
    args.eod_token_id = tok.eod
    if args.model_shape is not None:
        if tok.vocab_size > args.model_shape.vocab_size:
            raise ValueError(f"the tokenizer's vocabulary ({tok.vocab_size}) is larger than the checkpoint's "
                             f"({args.model_shape.vocab_size})")
        args.vocab_size = args.model_shape.vocab_size  # the model's vocabulary, unpadded
    if check_only and ({"mask_token", "mask_token_id"} & placeholders or
                       (args.mask_token is not None and args.shape_unknown)):
        args.check_notes.append("the mask token is a placeholder (or needs the --load checkpoint's tokenizer): its "
                                "vocabulary rule runs at launch")
        return args
    if args.mask_token is not None:
        if args.mask_token_id is not None:
            raise ValueError("give --mask-token-id or --mask-token, not both")
        from megatron_csbp.objectives.fast_dllm_v2 import resolve_mask_token
        assets = args.tokenizer_model if args.tokenizer_type == "HuggingFaceTokenizer" else \
            os.path.join(args.load, "hf_assets") if args.load else None
        try:
            args.mask_token_id = resolve_mask_token(args.mask_token, tokenizer_path=assets,
                                                    vocab_size=args.vocab_size)
        except FileNotFoundError as exc:
            raise ValueError(f"--mask-token: {exc}") from None
    from megatron_csbp.model.builder import embedding_rows

    rows = embedding_rows(args)
    if args.mask_token_id is None and objective_class(args.objective).mask_from_tokenizer:
        from megatron_csbp.objectives.flags import default_mask_token_id

        args.mask_token_id = default_mask_token_id(tok.mask_token_id, tok.vocab_size, rows)
    check_vocab(args, rows)
    return args


#: integer flags that count something (dest -> smallest allowed value)
COUNTS = {"micro_batch_size": 1, "global_batch_size": 1, "train_iters": 0, "seq_length": 1, "block_size": 1,
          "num_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "log_interval": 1, "eval_iters": 0,
          "exit_interval": 1, "save_interval": 1, "eval_interval": 1}


def check_counts(args) -> None:
    """Sizes, counts and intervals are positive (`--micro-batch-size 0` would divide by zero later);
    an unset --eval-iters takes Megatron-LM's 100 when evaluations are asked for."""
    for dest, least in COUNTS.items():
        value = getattr(args, dest, None)
        if value is not None and value < least:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} must be {'positive' if least == 1 else 'at least 0'}, got {value}")
    minutes = getattr(args, "exit_duration_in_mins", None)
    if minutes is not None and not minutes > 0:
        raise ValueError(f"--exit-duration-in-mins must be positive, got {minutes:g}")
    if args.eval_iters is None:
        args.eval_iters = 100 if (args.eval_interval or args.skip_train) else 0


def check_pretrained(args) -> None:
    """An objective that adapts a pretrained model (fast-dllm-v2) and Megatron's --finetune start from
    weights: a --load that holds no checkpoint (a typo) must not start a random model."""
    needs = objective_class(args.objective).needs_pretrained if args.objective in objective_names() else None
    why = f"--objective {args.objective} {needs}" if needs else \
        ("--finetune starts from the weights of --load" if getattr(args, "finetune", False) else None)
    if why is None or args.load_step is not None or args.shape_unknown:  # (launch --check: --load not here)
        return
    if not args.load:
        raise ValueError(f"{why}: give --load DIR (a checkpoint, e.g. from python -m megatron_csbp.convert "
                         "hf-to-megatron)")
    raise ValueError(f"{why}: --load {args.load} holds no checkpoint (no latest_checkpointed_iteration.txt"
                     f"{'' if os.path.isdir(args.load) else '; the folder does not exist'})")


# Flag (dest) -> what the converted checkpoint's shape says. A flag left at its default takes the
# checkpoint's value; a flag given with another value is refused.
def _shape_values(shape):
    return {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.num_query_groups,
        "kv_channels": shape.kv_channels,
        "rotary_base": shape.rotary_base,
        "untie_embeddings_and_output_weights": not shape.tie_word_embeddings,
        "normalization": "RMSNorm",
        "swiglu": True,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "qk_layernorm": shape.qk_layernorm,
        "norm_epsilon": shape.norm_epsilon,
        "rotary_percent": shape.rotary_percent,
        "add_qkv_bias": shape.add_qkv_bias,
        "use_rope_scaling": (shape.rope_scaling or {}).get("type") == "llama3",
        "rope_scaling_factor": (shape.rope_scaling or {}).get("factor", 8.0)
        if (shape.rope_scaling or {}).get("type") == "llama3" else 8.0,
        "rotary_seq_len_interpolation_factor": (shape.rope_scaling or {}).get("factor")
        if (shape.rope_scaling or {}).get("type") == "linear" else None,
        "num_experts": shape.num_experts,
        "moe_router_topk": shape.moe_router_topk if shape.is_moe else 2,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size if shape.is_moe else None,
        "moe_router_pre_softmax": shape.moe_router_pre_softmax,
        "moe_input_jitter_eps": shape.moe_input_jitter_eps,
        "moe_layer_freq": shape.moe_layer_pattern if shape.moe_layer_pattern is not None else 1,
    }


def apply_model_shape(args: argparse.Namespace, shape) -> None:
    """The model comes from the checkpoint's megatron_csbp_model.json: fill the shape flags from it
    and refuse flags that contradict it."""
    defaults = build_parser()
    if args.tokenizer_type is None and not args.tokenizer_model:
        args.tokenizer_type = "NullTokenizer"  # pre-tokenized data of the source model's tokenizer
    for dest, value in _shape_values(shape).items():
        if dest == "vocab_size" and args.tokenizer_type == "NullTokenizer":
            from megatron_csbp.data.megatron_data import null_tokenizer_vocab_flag

            value = null_tokenizer_vocab_flag(value)  # the flag whose NullTokenizer has the checkpoint's rows
        given = getattr(args, dest)
        if given == defaults.get_default(dest) or given == value:
            setattr(args, dest, value)
            continue
        if dest == "vocab_size" and args.tokenizer_type not in (None, "NullTokenizer"):
            continue  # a tokenizer's vocabulary may be smaller than the model's: checked later
        flag = "--" + dest.replace("_", "-")
        if dest == "vocab_size":  # (NullTokenizer)
            from megatron_csbp.data.megatron_data import NULL_TOKENIZER_RULE

            raise ValueError(f"--vocab-size {given} contradicts the checkpoint --load {args.load}: its vocabulary of "
                             f"{shape.vocab_size} ids is --vocab-size {value} ({NULL_TOKENIZER_RULE}); drop the flag")
        raise ValueError(f"{flag} {given} contradicts the checkpoint --load {args.load} ({flag} {value} in its "
                         "megatron_csbp_model.json); drop the flag: the model shape comes from the checkpoint")
    from megatron_csbp.model.families import family_names, get_family

    if shape.is_moe and not get_family(shape.family).trainer_trains_moe:
        trained = [f for f in family_names() if get_family(f).trainer_trains_moe]
        raise ValueError(f"--load {args.load} holds a {shape.family} MoE model ({shape.num_experts} experts): "
                         f"python -m megatron_csbp.train trains dense converted models and the MoE of {trained} only "
                         "(train other MoE models through the Megatron-LM hooks)")
    tp = args.tensor_model_parallel_size
    if shape.vocab_size % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide the checkpoint's vocabulary "
                         f"{shape.vocab_size} (converted models are not padded)")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        args.tokenizer_model = os.path.join(args.load, "hf_assets")  # the tokenizer that came with the model


def check_model_options(args, check_only: bool = False) -> None:
    """Megatron model flags with rules of their own: head size, dropout, recomputation, and the
    attention kernel named by --attention-backend."""
    from megatron_csbp.training.megatron_flags import check_model_flags

    check_model_flags(args)
    if args.kv_channels is not None and args.kv_channels <= 0:
        raise ValueError(f"--kv-channels must be positive, got {args.kv_channels}")
    if args.attention_dropout:
        raise ValueError(f"--attention-dropout must be 0 with block-diffusion attention (got {args.attention_dropout}): "
                         "dropout on attention probabilities would make the loss depend on the layout")
    if not 0.0 <= args.hidden_dropout < 1.0:
        raise ValueError(f"--hidden-dropout must be in [0, 1), got {args.hidden_dropout}")
    if args.recompute_granularity != "full":
        for flag, value in (("--recompute-method", args.recompute_method),
                            ("--recompute-num-layers", args.recompute_num_layers)):
            if value is not None:
                raise ValueError(f"{flag} {value} needs --recompute-granularity full (got "
                                 f"{args.recompute_granularity}); Megatron recomputes selectively per layer otherwise")
    else:
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = 1 if args.recompute_num_layers is None else args.recompute_num_layers
        if not 1 <= args.recompute_num_layers <= args.num_layers:
            raise ValueError(f"--recompute-num-layers {args.recompute_num_layers} must be between 1 and "
                             f"--num-layers {args.num_layers}")
    implied = BACKEND_KERNEL.get(args.attention_backend)
    if implied is not None:
        if args.attention_kernel not in ("auto", implied):
            raise ValueError(f"--attention-backend {args.attention_backend} selects the {implied} kernel, "
                             f"--attention-kernel {args.attention_kernel} another: give one of them")
        args.attention_kernel = implied
    if args.attention_kernel == "flex" and not args.skip_train and not check_only:
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--attention-kernel flex (or --attention-backend flash/fused) trains on CUDA only: "
                             "FlexAttention has no backward on CPU; use tiled (--attention-backend local) here")
    if args.attention_kernel == "flash" and not check_only:
        import torch
        from megatron_csbp.attention.flash import require_flash_attn
        if not torch.cuda.is_available():
            raise ValueError("--attention-kernel flash runs on CUDA only (flash-attn's kernels); use tiled "
                             "(--attention-backend local) here")
        try:
            require_flash_attn()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    if args.model_shape is not None and args.add_bias_linear:
        raise ValueError(f"--add-bias-linear: the model shape comes from the checkpoint --load {args.load}")


def check_clean_attention(args) -> None:
    """Fills the --clean-attention default; a family may fix it (DiffusionGemma's clean stream is
    token-causal: `Family.clean_attention`)."""
    from megatron_csbp.model.families import get_family

    shape = args.model_shape
    fixed = get_family(shape.family).clean_attention if shape is not None else None
    if args.clean_attention is None:
        args.clean_attention = fixed or "block_causal"
    if fixed is not None and args.clean_attention != fixed:
        raise ValueError(f"--clean-attention {args.clean_attention}: a {shape.family} model's clean stream is {fixed}")


def check_experts_and_objective(args) -> None:
    """Expert parallelism needs an MoE model; the objective's own rules (`Objective.validate`, e.g.
    DiffusionGemma's SFT needs DiffusionGemma and SFT data)."""
    from megatron_csbp.training.megatron_flags import check_moe_flags

    check_moe_flags(args)
    shape = args.model_shape
    # launch --check without the checkpoint: the rules that need its shape are skipped
    unknown = getattr(args, "shape_unknown", False)
    ep = args.expert_model_parallel_size
    # the experts: a converted model's (its shape), else the flags' (--num-experts)
    experts = shape.num_experts if shape is not None and shape.is_moe else (
        args.num_experts if shape is None else None)
    if experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ValueError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} on an MoE model needs "
                         "--sequence-parallel (Megatron's rule for MoE layers under tensor parallelism)")
    if ep != 1:
        if not unknown and not experts:
            raise ValueError(f"--expert-model-parallel-size {ep} needs an MoE model: --num-experts, or --load a "
                             "converted MoE checkpoint (DiffusionGemma / Gemma 4, Qwen3-MoE, Mixtral)")
        if not unknown and experts % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} must divide the {experts} experts")
        if args.block_parallel_size > 1 and args.context_parallel_size == 1:
            # BP ranks hold different numbers of rows (each recomputes the clean prefix it needs);
            # Megatron's allgather token dispatcher needs equal token counts across expert ranks.
            raise ValueError(f"--expert-model-parallel-size {ep} with --block-parallel-size "
                             f"{args.block_parallel_size} and --context-parallel-size 1 (plain BP) is not supported: "
                             "BP ranks hold different row counts, which the MoE token dispatcher cannot exchange; "
                             "use CSBP (--context-parallel-size > 1) or CP")
        from megatron_csbp.layout.layout import balanced_block_unit

        unit = balanced_block_unit(args.block_parallel_size, args.block_ownership)
        blocks = args.seq_length // args.block_size
        if args.block_parallel_size > 1 and blocks % unit:
            raise ValueError(f"--expert-model-parallel-size {ep} with --block-parallel-size {args.block_parallel_size}: "
                             f"--seq-length / --block-size = {blocks} blocks must be a multiple of {unit} so every "
                             f"block-parallel rank owns as many noisy blocks ({args.block_ownership} ownership); the "
                             "MoE token dispatcher needs equal row counts across expert ranks")
    objective_class(args.objective).validate(args)


def check_vocab(args, vocab_size: int) -> None:
    """After the tokenizer is known: the objective, built from the flags as the model will build it
    (its mask token a real id of the vocabulary)."""
    build_objective(args, vocab_size)


def model_args(args):
    """ModelArgs of the flags, carrying the objective's own flags along (ModelArgs need not name them)."""
    from megatron_csbp.training.model import ModelArgs

    fields = ModelArgs.__dataclass_fields__
    margs = ModelArgs(**{k: getattr(args, k) for k in fields if hasattr(args, k)})
    for dest, value in objective_options(args).items():
        setattr(margs, dest, value)
    return margs


DEMO_ARGV: List[str] = []  # filled in by megatron_csbp.training.demo
