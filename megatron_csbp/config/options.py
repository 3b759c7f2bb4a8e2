"""Every flag of `python -m megatron_csbp.train`, declared once.

An `Option` (utils/option.py) holds a flag's name (Megatron-LM's, with its meaning), type, default,
help, its own rule, and where its value goes: the `TrainerConfig` sections that carry it (`to`;
"model" is `ModelArgs`), the megatron-core `TransformerConfig` field it sets (`config`), the
`GPTModel` keyword (`gpt`), whether a checkpoint saves it (`saved`) and a resume must repeat it
(`tensors`), the `ModelShape` attribute of its name (`shape`) and the Hugging Face config.json key
of a flag-built model (`hf`). Everything else is derived from `OPTIONS`: the trainer's parser
(`add_options`), the config sections (`section_fields`), the flag-built model's config fields
(`config_fields`, `gpt_kwargs`), the per-flag rules (`check_options`), `SHAPE_FLAGS`, the flag text
`convert` prints (`flag_text`), and in model/families/ a shape's flags (`flag_values`), its
TransformerConfig fields and rotary keywords and a flag-built model's Hugging Face config. Rules
that relate several flags live in `training.arguments.check_flags`.

The trainer never fuses kernels (exactness is checked against unfused math,
`model.builder.PORTABLE_CONFIG`): Megatron's `--no-*-fusion` switches are accepted and state what
already holds. Objective flags are Options declared by their objectives (`Objective.flags`,
objectives/); `all_options()` is the table with them.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Tuple

from megatron_csbp.data.megatron_data import TOKENIZER_TYPES
from megatron_csbp.layout.layout import OWNERSHIP_SCHEDULES
from megatron_csbp.layout.masks import CLEAN_ATTENTION_VARIANTS
from megatron_csbp.lora.options import LORA_OPTIONS
from megatron_csbp.utils.option import AT_LEAST_0, POSITIVE, Option, must


def moe_freq_type(x):
    """Megatron's --moe-layer-freq: an int N (one MoE layer every N), or a Python list expression of
    0/1 per layer such as "([1]*3+[0]*1)*3"."""
    if "[" in str(x):
        pattern = eval(str(x), {"__builtins__": {}})  # Megatron-LM evaluates the same expression
        if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
            raise argparse.ArgumentTypeError(f"--moe-layer-freq {x!r} must give a list of 0/1 per layer")
        return pattern
    if int(x) < 1:
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {x!r} must be at least 1 (one MoE layer every N) "
                                         "or a list of 0/1 per layer")
    return int(x)


def moe_layer_pattern(freq, num_layers: int) -> List[int]:
    """Megatron's --moe-layer-freq as 0/1 per layer (1: MoE): the list as given, or an int N's
    every N-th layer from layer 0."""
    return list(freq) if isinstance(freq, list) else [int(i % int(freq) == 0) for i in range(num_layers)]


#: Megatron-LM's --ckpt-format choices; the trainer writes torch_dist only
CKPT_FORMATS = ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")
#: Megatron's load-balancing types (check_moe_flags takes those independent of how a sequence is split)
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
#: Megatron's AttnBackend names -> the block-diffusion attention kernel they select
ATTENTION_BACKENDS = ("auto", "local", "unfused", "flash", "fused")
BACKEND_KERNEL = {"local": "tiled", "unfused": "math", "flash": "flex", "fused": "flex"}
#: Megatron-LM's --exit-signal takes any signal.Signals name; these are the ones a job is sent
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
UNFUSED = "accepted: the trainer never fuses (exactness is checked against unfused math)"

#: the parser's groups, Megatron-LM's (core_v0.16.1's titles and membership), in its --help order; then the plugin's
GROUPS = {"network": "network size", "transformer": "transformer configuration", "regularization": "regularization",
          "training": "training", "init": "RNG and initialization", "lr": "learning rate and weight decay",
          "checkpointing": "checkpointing", "mixed": "mixed precision", "distributed": "distributed",
          "validation": "validation", "data": "data and dataloader", "tokenizer": "tokenizer", "logging": "logging",
          "moe": "moe", "bd": "block diffusion (megatron_csbp)", "lora": "LoRA (megatron_csbp, docs/lora.md)"}

O = Option
OPTIONS: List[Option] = [
    # ---- model ----------------------------------------------------------------------------
    O(("--num-layers",), int, 4, "transformer layers", rule=POSITIVE,
      config="num_layers", shape=True, hf="num_hidden_layers", tensors=True),
    O(("--hidden-size",), int, 128, "hidden size of the transformer", rule=POSITIVE,
      config="hidden_size", shape=True, hf="hidden_size", tensors=True),
    O(("--ffn-hidden-size",), int, None, "MLP hidden size (default: 4 x --hidden-size; with --swiglu 8/3 x "
      "--hidden-size rounded up to a multiple of 16)", config="ffn_hidden_size",
      shape=True, hf="intermediate_size", tensors=True),
    O(("--num-attention-heads",), int, 4, "attention heads per layer", rule=POSITIVE,
      config="num_attention_heads", shape=True, hf="num_attention_heads", tensors=True),
    O(("--num-query-groups",), int, None, "K/V heads (grouped-query attention; default: --num-attention-heads)",
      config="num_query_groups", shape=True, hf="num_key_value_heads", tensors=True),
    O(("--kv-channels",), int, None, "projection size per attention head (default: --hidden-size / "
      "--num-attention-heads)", rule=POSITIVE, config="kv_channels", shape=True, hf="head_dim"),
    O(("--group-query-attention",), None, False, "accepted for Megatron-LM compatibility", group="network", to=()),
    O(("--seq-length",), int, 128, "clean tokens per sample (the model sees 2 x this many rows: noisy and clean)",
      group="data", to=("model", "batch", "data"), rule=POSITIVE, saved=True),
    O(("--max-position-embeddings",), int, None, "longest position the model holds (default: --seq-length)",
      group="network", shape=True, hf="max_position_embeddings"),
    O(("--normalization",), str, "RMSNorm", "normalization layers",
      choices=("RMSNorm", "LayerNorm"), config="normalization", shape=True, tensors=True),
    O(("--swiglu",), None, True, "SwiGLU MLP (the default here)", group="network", off="--no-swiglu",
      off_help="plain GeLU MLP", config="gated_linear_unit", shape=True, tensors=True),
    O(("--untie-embeddings-and-output-weights",), None, False, "an output layer of its own instead of the input "
      "embedding's weights", group="network", shape=True, tensors=True),
    O(("--position-embedding-type",), str, "rope", "rope only: block diffusion indexes rotary angles by each "
      "row's position", group="network", choices=("rope",), gpt="position_embedding_type", shape=True),
    O(("--add-bias-linear",), None, False, "biases in the linear layers of a flag-built model",
      off="--disable-bias-linear", off_help="no biases in linear layers (the default here; Megatron-LM's default "
      "is with biases)", config="add_bias_linear", saved=True),
    O(("--attention-dropout",), float, 0.0, "must be 0: dropout on attention probabilities would make the loss "
      "depend on the layout", rule=lambda f, v: v and (
          f"{f} must be 0 with block-diffusion attention (got {v}): dropout on attention probabilities would make "
          "the loss depend on the layout")),
    O(("--hidden-dropout",), float, 0.0, "dropout after attention and MLP (Megatron's)",
      rule=must(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")),
    O(("--attention-backend",), str, "auto", "Megatron's attention backend names for the block-diffusion core "
      "attention (which replaces Megatron's): local -> --attention-kernel tiled, unfused -> math, flash/fused -> "
      "flex, auto -> --attention-kernel; also set as TransformerConfig.attention_backend", choices=ATTENTION_BACKENDS),
    O(("--init-method-std",), float, 0.02, "standard deviation of the initial weights",
      config="init_method_std", saved=True),
    O(("--rotary-base",), int, 10000, "rope base period", group="network", gpt="rotary_base", shape=True),
    O(("--make-vocab-size-divisible-by",), int, 128, "pad the tokenizer's vocabulary to a multiple of this (the "
      "padding ids hold the default mask id)", group="network", tensors=True),
    O(("--bf16",), None, False, "bfloat16 weights and activations with fp32 main weights in the optimizer",
      to=("model", "optim"), config="bf16"),
    # Megatron's fp16 mixed precision: float16 weights with fp32 main weights in the optimizer and a
    # loss scale (dynamic unless --loss-scale is given); a step whose gradients overflow is skipped.
    O(("--fp16",), None, False, "float16 mixed precision with a loss scale", to=("model", "optim"), config="fp16"),
    O(("--recompute-granularity",), str, None, "activation recomputation (Megatron's "
      "TransformerConfig.recompute_granularity)", choices=("full", "selective")),
    O(("--recompute-method",), str, None, "with --recompute-granularity full (default there: uniform)",
      choices=("uniform", "block")),
    O(("--recompute-num-layers",), int, None, "with --recompute-granularity full: layers per recomputed chunk "
      "(uniform) or recomputed layers (block); default 1"),
    O(("--qk-layernorm",), None, False, "RMSNorm on each head's queries and keys (Qwen3); exported as "
      "Qwen3ForCausalLM", config="qk_layernorm", shape=True),
    O(("--norm-epsilon",), float, 1e-5, "epsilon of every normalization layer",
      config="layernorm_epsilon", rule=POSITIVE, shape=True, hf="rms_norm_eps"),
    O(("--rotary-percent",), float, 1.0, "fraction of each head's dims that rope rotates", group="network",
      gpt="rotary_percent", rule=must(lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"), shape=True),
    O(("--add-qkv-bias",), None, False, "bias on the q/k/v projections only (Qwen2); exported as Qwen2ForCausalLM",
      config="add_qkv_bias", shape=True, hf="attention_bias"),
    O(("--use-rope-scaling",), None, False, "Llama 3.1 rope scaling", group="network", shape=True),
    O(("--rope-scaling-factor",), float, 8.0, "with --use-rope-scaling", group="network", shape=True),
    O(("--rotary-seq-len-interpolation-factor",), int, None, "linear rope interpolation (positions divided by this "
      "factor)", group="network", gpt="seq_len_interpolation_factor", rule=must(lambda v: v >= 1, "must be >= 1"),
      shape=True),
    O(("--transformer-impl",), str, "local", "local only (the default here): block-diffusion attention replaces the "
      "core attention of Megatron's local spec", choices=("local", "transformer_engine"), to=(),
      rule=lambda f, v: v != "local" and (
          f"{f} {v}: the trainer builds Megatron's local spec (block-diffusion attention replaces its core "
          f"attention); use {f} local")),
    *(O((flag,), None, False, UNFUSED, group="training", dest=dest, to=(), config=field, action="store_false")
      for flag, dest, field in (
        ("--no-masked-softmax-fusion", "masked_softmax_fusion", "masked_softmax_fusion"),
        ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "bias_activation_fusion"),
        ("--no-rope-fusion", "apply_rope_fusion", "apply_rope_fusion"),
        ("--no-bias-dropout-fusion", "bias_dropout_fusion", "bias_dropout_fusion"),
        ("--no-persist-layer-norm", "persist_layer_norm", "persist_layer_norm"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", "gradient_accumulation_fusion"))),
    # ---- mixture of experts (TransformerConfig fields of an MoE model: moe_config) -------------
    O(("--num-experts",), int, None, "experts per MoE layer (None: dense)", group="moe", config="num_moe_experts",
      rule=POSITIVE, shape=True),
    O(("--moe-router-topk",), int, 2, "experts per token", config="moe_router_topk", shape=True),
    O(("--moe-ffn-hidden-size",), int, None, "expert FFN size (default --ffn-hidden-size)",
      config="moe_ffn_hidden_size", shape=True),
    O(("--moe-layer-freq",), moe_freq_type, 1, "one MoE layer every N layers, or a 0/1 pattern per layer such as "
      "\"([1]*3+[0]*1)*3\"", group="moe", config="moe_layer_freq", shape=True),
    O(("--moe-router-score-function",), str, "softmax", "router scores over the experts",
      choices=("softmax", "sigmoid"), config="moe_router_score_function", saved=True),
    O(("--moe-router-pre-softmax",), None, False, "softmax over all experts before top-k (default: top-k logits, "
      "then softmax over them)", config="moe_router_pre_softmax", shape=True),
    O(("--moe-router-load-balancing-type",), str, "aux_loss", "the router's load-balancing scheme", group="moe",
      choices=LOAD_BALANCING, config="moe_router_load_balancing_type"),
    O(("--moe-aux-loss-coeff",), float, 0.0, "weight of the load-balancing loss", group="moe",
      config="moe_aux_loss_coeff"),
    O(("--moe-input-jitter-eps",), float, None, "router input jitter (Mixtral)",
      config="moe_input_jitter_eps", shape=True),
    O(("--moe-token-dispatcher-type",), str, "allgather", "how tokens reach their experts across expert-parallel "
      "ranks", choices=("allgather", "alltoall", "flex"), config="moe_token_dispatcher_type"),
    O(("--moe-grouped-gemm",), None, False, "grouped GEMM experts (CUDA)", config="moe_grouped_gemm"),
    # ---- training -------------------------------------------------------------------------
    O(("--micro-batch-size",), int, 2, "samples per micro-batch on each data-parallel replica", group="training",
      to=("batch",), rule=POSITIVE),
    O(("--global-batch-size",), int, None, "samples per iteration over all replicas (default: --micro-batch-size x "
      "data-parallel size)", group="training", to=("batch", "data"), rule=POSITIVE),
    O(("--train-iters",), int, None, "default 100 (or --train-samples)", group="training", to=("batch", "data"),
      rule=AT_LEAST_0),
    O(("--train-samples",), int, None, "train for this many samples instead of --train-iters (a multiple of "
      "--global-batch-size)", group="training", to=()),
    O(("--lr",), float, 3e-3, "peak learning rate", group="lr", to=("optim",)),
    O(("--min-lr",), float, 0.0, "Megatron-LM's default 0", group="lr", to=("optim",)),
    O(("--lr-warmup-iters",), int, 0, "iterations of linear warm-up from 0 to --lr", group="lr", to=("optim",)),
    O(("--lr-warmup-fraction",), float, None, "warm the learning rate up over this fraction of the decay steps "
      "(instead of --lr-warmup-iters)", group="lr", to=("optim",),
      rule=must(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")),
    O(("--lr-decay-iters",), int, None, "iterations over which the learning rate decays to --min-lr (default: "
      "--train-iters)", group="lr", to=("optim",)),
    O(("--lr-decay-style",), str, "linear", "Megatron-LM's default linear", group="lr", to=("optim",),
      choices=("constant", "linear", "cosine", "inverse-square-root", "WSD")),
    O(("--weight-decay",), float, 0.01, "AdamW weight decay", group="regularization", to=("optim",)),
    O(("--adam-beta1",), float, 0.9, "Adam's beta1", group="regularization", to=("optim",)),
    O(("--adam-beta2",), float, 0.999, "Megatron-LM's default 0.999", group="regularization", to=("optim",)),
    O(("--adam-eps",), float, 1e-8, "Adam's epsilon", group="regularization", to=("optim",)),
    O(("--clip-grad",), float, 1.0, "clip the global gradient norm to this (0: no clipping)", group="regularization",
      to=("optim",)),
    O(("--loss-scale",), float, None, "static loss scale (default: dynamic, with --fp16)", group="mixed",
      to=("optim",), rule=POSITIVE),
    O(("--grad-reduce-in-bf16",), None, False, "with --bf16: accumulate and reduce gradients in bfloat16 "
      "(Megatron-LM's; default: fp32 main gradients)", group="mixed", to=("optim",)),
    O(("--initial-loss-scale",), float, 2 ** 32, "--fp16: the first dynamic loss scale", group="mixed", to=("optim",)),
    O(("--min-loss-scale",), float, 1.0, "--fp16: the dynamic loss scale never goes below this", group="mixed",
      to=("optim",)),
    O(("--loss-scale-window",), float, 1000, "--fp16: iterations without overflow before the loss scale doubles",
      group="mixed", to=("optim",)),
    O(("--hysteresis",), int, 2, "--fp16: overflows tolerated before the loss scale halves", group="mixed",
      to=("optim",)),
    O(("--check-for-nan-in-loss-and-grad",), None, True, "stop the run, naming the iteration, when the loss or the "
      "gradient norm is NaN or infinite (the default, as in Megatron-LM)", group="training", to=("optim",),
      off="--no-check-for-nan-in-loss-and-grad", off_help="train on through non-finite losses (a checkpoint is "
      "still never saved with non-finite weights)"),
    O(("--seed",), int, 1234, "seed of the initial weights and of the training noise (drawn per (seed, sample index))",
      group="init", to=("model", "data"), saved=True),
    O(("--use-distributed-optimizer",), None, False, "shard the optimizer state over the data-parallel ranks",
      group="distributed", to=("parallel",)),
    O(("--overlap-grad-reduce",), None, False, "overlap DDP's gradient reduce-scatter/all-reduce with the backward "
      "pass", group="distributed", to=("parallel",)),
    O(("--overlap-param-gather",), None, False, "overlap the distributed optimizer's parameter all-gather with the "
      "next forward (needs --use-distributed-optimizer and --overlap-grad-reduce)", group="distributed",
      to=("parallel",)),
    O(("--num-workers",), int, 0, "DataLoader worker processes reading training samples ahead (default 0 here: in "
      "the training process; Megatron-LM's default is 2)", group="data", to=("data",),
      rule=must(lambda v: v >= 0, "must be >= 0")),
    # ---- parallelism ----------------------------------------------------------------------
    O(("--tensor-model-parallel-size",), int, 1, "tensor-parallel ranks (TP)", to=("model", "parallel")),
    O(("--pipeline-model-parallel-size",), int, 1, "pipeline stages (PP)", to=("model", "parallel")),
    # Megatron-LM's pipeline flags (their rules: parallel/pipeline.check_pipeline_args)
    O(("--decoder-first-pipeline-num-layers",), int, None, "transformer layers on the first pipeline stage "
      "(default: an even split)", group="distributed"),
    O(("--decoder-last-pipeline-num-layers",), int, None, "transformer layers on the last pipeline stage "
      "(default: an even split)", group="distributed"),
    O(("--num-layers-per-virtual-pipeline-stage",), int, None, "interleaved 1F1B: layers per virtual pipeline "
      "stage", group="distributed", to=()),
    O(("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size"), int, None,
      "interleaved 1F1B: model chunks per pipeline rank", group="distributed", to=()),
    O(("--context-parallel-size",), int, 1, "context-parallel ranks (CP): ranks sharing one sample's clean rows; "
      "with --block-parallel-size > 1 too: CSBP", to=("model", "parallel")),
    O(("--expert-model-parallel-size",), int, 1, "expert-parallel ranks (EP)", to=("model", "parallel")),
    O(("--sequence-parallel",), None, False, "split the activations outside attention over the TP ranks (needs TP "
      "> 1)", to=("model", "parallel")),
    O(("--distributed-backend",), str, None, "default: nccl with CUDA, gloo without", group="distributed",
      to=("parallel",), choices=("nccl", "gloo")),
    # ---- checkpoints and logs -------------------------------------------------------------
    O(("--save",), str, None, "folder to write checkpoints to", group="checkpointing", to=("checkpoint",)),
    O(("--load",), str, None, "checkpoint folder to resume (or start) from", group="checkpointing", to=("checkpoint",)),
    O(("--pretrained-checkpoint",), str, None, "Directory containing a pretrained model checkpoint for finetuning "
      "(Megatron-LM's): its weights only, when --load holds no checkpoint; with --lora-rank the frozen base the "
      "adapters train on, loaded before a --load LoRA checkpoint", group="checkpointing", to=("checkpoint",)),
    O(("--save-interval",), int, None, "save a checkpoint every this many iterations (with --save; the last "
      "iteration is saved too)", group="checkpointing", to=("checkpoint",), rule=POSITIVE),
    O(("--save-retain-interval",), int, None, "keep only the checkpoints at multiples of this (and the latest); a "
      "multiple of --save-interval", group="checkpointing", to=("checkpoint",)),
    O(("--save-initial",), None, False, "also save the untrained weights as iteration 0 before the first step (for "
      "comparison, e.g. python -m megatron_csbp.generate --ckpt-step 0)", group="checkpointing", to=("checkpoint",)),
    O(("--ckpt-step",), int, None, "load this iteration instead of the latest", group="checkpointing",
      to=("checkpoint",)),
    O(("--ckpt-format",), str, "torch_dist", "torch_dist only (dist_checkpointing: reshards across every layout)",
      group="checkpointing", to=(), choices=CKPT_FORMATS, rule=lambda f, v: v != "torch_dist" and (
          f"{f} {v}: the trainer writes and reads torch_dist checkpoints only (dist_checkpointing, which reshards "
          "across TP / CP / BP / EP layouts)")),
    O(("--exit-on-missing-checkpoint",), None, True, "refuse a --load that holds no checkpoint (a mistyped path), "
      "unless it is the --save folder of a resumable job's first run (Megatron-LM's flag; on by default here)",
      group="checkpointing", to=(), off="--no-exit-on-missing-checkpoint", off_help="start from scratch when --load holds "
      "no checkpoint (Megatron-LM's default)"),
    O(("--finetune",), None, False, "load the --load checkpoint's weights only: iteration and consumed samples "
      "start at 0, no optimizer, scheduler or RNG state", group="checkpointing", to=("checkpoint",)),
    O(("--no-load-optim",), None, False, "do not load the optimizer and learning-rate scheduler state of the --load "
      "checkpoint", group="checkpointing", to=("checkpoint",)),
    O(("--no-load-rng",), None, False, "accepted: the trainer's checkpoints hold no RNG state (training noise is "
      "keyed by (--seed, sample index))", group="checkpointing", to=()),
    O(("--override-opt_param-scheduler", "--override-opt-param-scheduler"), None, False, "on resume, take the "
      "learning-rate schedule of the flags, not the --load checkpoint's (Megatron-LM's rule; docs/megatron-lm.md "
      "\"Resuming with other learning-rate flags\")", group="lr", to=("checkpoint",)),
    O(("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"), None, False, "on resume, "
      "keep the --load checkpoint's learning-rate schedule whatever the flags say (Megatron-LM's; without either "
      "flag a changed schedule is refused)", group="lr", to=("checkpoint",)),
    O(("--log-interval",), int, 10, "print (and log) every this many iterations", group="logging", to=("log",),
      rule=POSITIVE),
    O(("--eval-interval",), int, None, "evaluate the held-out loss every this many iterations", group="validation",
      to=("eval",), rule=POSITIVE),
    O(("--eval-iters",), int, None, "global batches per evaluation (default: Megatron-LM's 100 when "
      "--eval-interval or --skip-train asks for evaluations, else 0)", group="validation", to=("eval", "data"),
      rule=AT_LEAST_0),
    O(("--skip-train",), None, False, "evaluate only (the --load checkpoint), no training", group="validation",
      to=("batch",)),
    O(("--tensorboard-dir",), str, None, "write TensorBoard scalars here", group="logging", to=("log",)),
    O(("--wandb-project",), str, None, "Weights & Biases project (enables wandb logging)", group="logging",
      to=("log",)),
    O(("--wandb-exp-name",), str, None, "Weights & Biases run name", group="logging", to=("log",)),
    O(("--wandb-save-dir",), str, None, "wandb's folder (default: --save/wandb)", group="logging", to=("log",)),
    O(("--exit-interval",), int, None, "save (with --save) and exit after every iteration that is a multiple of "
      "this (Megatron-LM's)", group="training", to=("batch",), rule=POSITIVE),
    O(("--exit-duration-in-mins",), float, None, "save (with --save) and exit after the first iteration that ends "
      "more than this many minutes after the program started (Megatron-LM's; all ranks agree)", group="training",
      to=("batch",), rule=lambda f, v: not v > 0 and f"{f} must be positive, got {v:g}"),
    O(("--exit-signal-handler",), None, False, "on --exit-signal (SIGTERM: Slurm's preemption / time limit, "
      "torchrun's shutdown) or SIGINT (Ctrl-C), finish the iteration, save a checkpoint (with --save) and exit 0 "
      "(Megatron-LM's; all ranks agree)", group="training", to=("batch",)),
    O(("--exit-signal",), str, "SIGTERM", "the signal --exit-signal-handler saves on besides SIGINT "
      "(Megatron-LM's)", group="training", to=("batch",), choices=EXIT_SIGNALS),
    O(("--no-progress-bar",), None, False, "no progress bar (log lines only)", group="logging", to=("log",)),
    # ---- data -----------------------------------------------------------------------------
    O(("--data-path",), str, None, "PREFIX or W1 PREFIX1 W2 PREFIX2 ...", group="data", to=("data",), nargs="*"),
    O(("--split",), str, "969,30,1", "train,valid,test weights of each --data-path dataset's documents", group="data",
      to=("data",)),
    O(("--data-cache-path",), str, None, "folder for Megatron's dataset index caches (default: beside the data)",
      group="data", to=("data",)),
    O(("--sft-data-path",), str, None, "jsonl of conversations or prompt/response pairs", group="data", to=("data",)),
    O(("--chat-template",), str, "auto", "how --sft-data-path records become tokens: auto (a Hugging Face "
      "tokenizer's own chat template, the plain User:/Assistant: rendering for a tokenizer without one), none (the "
      "plain rendering), a Jinja chat template file, or the template's text (Megatron-LM's meaning); docs/sft.md",
      group="tokenizer", to=("data",), saved=True),
    O(("--sft-trajectory-turns",), str, "record", "diffusiongemma-sft: record (one sample per record) or all (one "
      "sample per assistant turn, its prefix the clean prompt; a record's samples share an optimizer step and "
      "--global-batch-size counts records); docs/sft.md", group="data", to=("data",), choices=("record", "all")),
    O(("--tokenizer-type",), str, None, "Megatron-LM's tokenizer types (default: the shipped sentencepiece tokenizer)",
      group="tokenizer", to=("data",), choices=TOKENIZER_TYPES, saved=True),
    O(("--tokenizer-model",), str, None, "sentencepiece .model, or a local Hugging Face tokenizer folder (default "
      "with --load and HuggingFaceTokenizer: the checkpoint's hf_assets)", group="tokenizer", to=("data",), saved=True),
    O(("--vocab-size",), int, None, "NullTokenizer: Megatron-LM's meaning on the installed megatron-core (0.16: "
      "data ids 0..V-1 plus EOD V; 0.19: V ids, EOD V-1); the model pads the tokenizer's vocabulary to "
      "--make-vocab-size-divisible-by and the default mask id is the first padding id", group="tokenizer",
      to=("model", "data"), shape=True, tensors=True),
    O(("--mock-data",), None, False, "random tokens (Megatron's MockGPTDataset) instead of --data-path", group="data",
      to=("data",)),
    # Megatron's packed-document flags (same names and meaning; docs/semantics.md "Packed documents")
    O(("--reset-position-ids",), None, False, "positions restart at 0 after every EOD token (each document's own "
      "positions)", group="data"),
    O(("--reset-attention-mask",), None, False, "attention stays inside each EOD-delimited document (the EOD "
      "belongs to the document it ends); a block cut by a boundary is one block per document", group="data"),
    O(("--eod-mask-loss",), None, False, "EOD tokens are no loss targets", group="data"),
    O(("--pack-sequences",), None, False, "with --sft-data-path: first-fit packing of conversations into "
      "--seq-length, each its own document (--reset-attention-mask / --reset-position-ids then use the "
      "conversations)", group="data", to=("data",)),
    # ---- block diffusion (also Megatron-LM's extra_args_provider) ---------------------------
    O(("--block-parallel-size",), int, 1, "ranks sharing one sample by noisy blocks (BP); CSBP when "
      "--context-parallel-size > 1 too. Must be a multiple of --context-parallel-size.", group="bd",
      to=("model", "parallel")),
    O(("--block-size",), int, 16, "block diffusion block size; must divide --seq-length", group="bd",
      to=("model", "data"), rule=POSITIVE, saved=True),
    # choices and help: the registry's
    O(("--objective",), str, "bd3lm", "what is trained (each registered objective, objectives/)", group="bd",
      to=("model", "data"), saved=True),
    O(("--clean-attention",), str, None, "clean stream mask (default: token_causal for DiffusionGemma models, "
      "block_causal otherwise)", group="bd", choices=CLEAN_ATTENTION_VARIANTS, saved=True),
    O(("--attention-transport",), str, "allgather", "how K/V move between the ranks of a shard group (ring: "
      "overlapped with compute)", group="bd", choices=("allgather", "ring")),
    O(("--block-ownership",), str, "mirrored", "which noisy blocks each BP rank holds (mirrored balances causal work)",
      group="bd", choices=OWNERSHIP_SCHEDULES),
    O(("--attention-kernel",), str, "auto", "kernel of the block-diffusion core attention, for every model family "
      "(flag-built GPT, converted models, DiffusionGemma): auto = per layer, flex on CUDA (tiled past "
      "head dim 256), cpu_flash elsewhere; cpu_flash = "
      "the flash decomposition on torch's CPU flash attention (CPU only); tiled = block-sparse tiles with memory "
      "linear in the rows (any device); math = dense reference for small cases; flex = FlexAttention from row "
      "vectors; flash = flash-attn varlen for the noisy block-diagonal and token-causal clean pieces, flex for the "
      "rest (needs flash-attn); --attention-backend selects it too", group="bd",
      choices=("auto", "cpu_flash", "tiled", "math", "flex", "flash")),
    O(("--log-json",), str, None, "append one JSON object per logged iteration", group="bd", to=("log",)),
    *LORA_OPTIONS,  # declared in lora/options.py
]
del O
BY_NAME: Dict[str, Option] = {o.name: o for o in OPTIONS}
if any(o.group not in GROUPS for o in OPTIONS):  # add_options would leave such a flag out of the parser
    raise ValueError(f"options in no GROUPS group: {[o.flag for o in OPTIONS if o.group not in GROUPS]}")


def add_options(parser: argparse.ArgumentParser, groups=tuple(GROUPS)) -> None:
    """The declared flags of `groups`, each in its group; the objectives' flags after --objective."""
    from megatron_csbp.objectives.registry import add_objective_args, objective_help, objective_names

    made = {k: parser.add_argument_group(GROUPS[k]) for k in GROUPS if k in groups}
    for o in OPTIONS:
        if o.group in groups and o.name == "objective":
            made[o.group].add_argument(o.flag, choices=objective_names(), default=o.default, help=objective_help())
            add_objective_args(made[o.group])  # each objective's flags (megatron_csbp/objectives/), shared ones once
        elif o.group in groups:
            o.add_to(made[o.group])


def check_options(args) -> None:
    """Each declared flag's own rule, on the values given (None: not given)."""
    for o in OPTIONS:
        value = getattr(args, o.name, None)
        refusal = o.rule is not None and value is not None and o.rule(o.flag, value)
        if refusal:
            raise ValueError(refusal)


#: model flags (dests) that fix the shapes of the saved tensors: a resume must give the same values
SHAPE_FLAGS = tuple(o.name for o in OPTIONS if o.tensors)


def section_fields(section: str) -> List[Tuple[str, Any, Any]]:
    """(name, type, default) of the options a `TrainerConfig` section carries, in declaration order."""
    return [(o.name, Any, o.default) for o in OPTIONS if section in o.to]


def config_fields(a, moe: bool = False) -> dict:
    """{TransformerConfig field: value} of a flag-built model's options (`moe`: the MoE flags',
    {} for a dense model)."""
    if moe and not a.num_experts:
        return {}
    out = {o.config: getattr(a, o.name, o.default) for o in OPTIONS if o.config and o.moe == moe}
    return dict(out, expert_model_parallel_size=a.expert_model_parallel_size) if moe else out


def gpt_kwargs(a) -> dict:
    """GPTModel keywords of a flag-built model's rotary flags."""
    out = {o.gpt: getattr(a, o.name) for o in OPTIONS if o.gpt and getattr(a, o.name) is not None}
    if a.use_rope_scaling:
        out.update(rope_scaling=True, rope_scaling_factor=a.rope_scaling_factor)
    return out


def all_options() -> List[Option]:
    """`OPTIONS`, then the options of each registered objective (objectives/), a shared one once."""
    from megatron_csbp.objectives.registry import registered_objectives

    out = {o.name: o for o in OPTIONS}
    for cls in registered_objectives().values():
        out.update({o.name: o for o in cls.flags if o.name not in out})
    return list(out.values())


def flag_text(name: str, value) -> str:
    """The command-line text that sets option `name` (or an objective's valued flag) to `value` ("" for a
    switch left off)."""
    o = next(o for o in all_options() if o.name == name)
    if o.action == "store_false":
        return "" if value else o.flag
    if o.type is None and isinstance(o.default, bool):
        return o.flag if value else (o.off or "")
    if o.nargs and isinstance(value, (list, tuple)):  # --lora-target-modules NAME ...
        return f"{o.flag} {' '.join(map(str, value))}"
    if isinstance(value, list):  # --moe-layer-freq's pattern, as the expression Megatron-LM evaluates
        return f"{o.flag} \"([{','.join(map(str, value))}])\""
    return f"{o.flag} {value}"
