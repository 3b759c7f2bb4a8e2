"""Command line of `python -m megatron_csbp.train`: Megatron-LM's flag names plus the block-diffusion
ones (the same set `megatron_csbp.training.megatron_lm.extra_args_provider` adds to Megatron-LM).

Every rule is checked before any process group exists; a violation exits with a message naming
the flag and the rule.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from megatron_csbp.objectives.registry import build_objective, objective_class, objective_options
from megatron_csbp.config.options import (BACKEND_KERNEL, BY_NAME, OPTIONS, add_options, check_options,
                                          moe_layer_pattern)
from megatron_csbp.data.megatron_data import (build_tokenizer, largest_token_id, missing_prefixes, null_tokenizer_rule,
                                              null_tokenizer_vocab_flag)
from megatron_csbp.layout.layout import SequenceLayout, balanced_block_unit
from megatron_csbp.layout.masks import BlockGeometry
from megatron_csbp.objectives.base import ObjectiveInputs
from megatron_csbp.objectives.fast_dllm_v2 import resolve_mask_token
from megatron_csbp.objectives.flags import default_mask_token_id


def add_block_diffusion_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our flags (also used as Megatron-LM's extra_args_provider)."""
    add_options(parser, groups=("bd", "lora"))
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of the declared options (config/options.py)."""
    from megatron_csbp.utils.cli import ArgumentParser, DefaultsHelpFormatter  # an argument error is one line

    p = ArgumentParser(prog="python -m megatron_csbp.train", usage="torchrun --nproc-per-node N -m "
                       "megatron_csbp.train [Megatron-LM flags] [block-diffusion flags]",
                       description="Train a block diffusion LM with Megatron-core (launch with torchrun; "
                                   "without it one process). With no flags at all: the embedded CSBP demo. The "
                                   "flags are Megatron-LM's, in its groups, with the defaults here.",
                       formatter_class=DefaultsHelpFormatter)
    add_options(p)
    return p


@dataclass(frozen=True)
class Resolved:
    """What `validate_args` returns: the flags as given (`flags`, which validation never writes), what
    the rules derive for them (`derived`: an unset flag filled, the tokenizer's vocabulary, ...) and what
    else the flags derive. `resolved.<dest>` is a flag's resolved value (`derived`'s, else as given)."""
    flags: argparse.Namespace = field(default_factory=argparse.Namespace)
    derived: Mapping[str, Any] = field(default_factory=dict)
    world_size: int = 1
    data_parallel_size: int = 1
    num_microbatches: int = 1  # per iteration: --global-batch-size / (--micro-batch-size x data-parallel size)
    virtual_pipeline_model_parallel_size: Optional[int] = None  # interleaved 1F1B (parallel/pipeline.py)
    load_step: Any = None  # what --load [--ckpt-step] loads: an iteration, "release", or None
    model_source: Any = None  # (flag, folder, iteration) of the checkpoint the model comes from (files.model_source)
    model_shape: Any = None  # the --load checkpoint's ModelShape (None: the model is built from the flags)
    shape_unknown: bool = False  # launch --check: --load is not here, so the rules that need its shape are skipped
    eod_token_id: Optional[int] = None  # the tokenizer's
    pad_token_id: Optional[int] = None  # what SFT data pads with (data.sft.sft_pad_id)
    objective_inputs: ObjectiveInputs = ObjectiveInputs()  # what the objective read from its files (dflash)
    check_notes: List[str] = field(default_factory=list)  # launch --check: the rules skipped, and why

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        derived = self.__dict__.get("derived", {})
        return derived[name] if name in derived else getattr(self.__dict__.get("flags"), name)

    def values(self) -> Dict[str, Any]:
        """Every resolved value by name: the flags, then what else they derive."""
        facts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("flags", "derived")}
        return {**vars(self.flags), **self.derived, **facts, **self.objective_inputs.facts}


class _Resolving:
    """The flags during validation: reads see what the rules derived so far, writes go to `derived`
    (the namespace as given is never written)."""

    __getattr__ = Resolved.__getattr__

    def __init__(self, flags: argparse.Namespace):
        object.__setattr__(self, "flags", flags)
        object.__setattr__(self, "derived", {})

    def __setattr__(self, name: str, value) -> None:
        self.derived[name] = value


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Resolved:
    """The flags, checked and resolved (`Resolved`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return validate_args(args, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    except ValueError as exc:
        parser.error(str(exc))


def validate_args(flags: argparse.Namespace, world_size: int, check_only: bool = False) -> Resolved:
    """`check_flags` (what the flags derive); then what the --load checkpoint must be: one at all when
    the run starts from pretrained weights, and trained with the same model flags (its `bdlm_meta.json`).
    `flags` is not written: the resolved values are the returned object's."""
    from megatron_csbp.checkpoint.files import check_model_flags, check_run_folders

    args = _Resolving(flags)
    facts = check_flags(args, world_size, check_only)
    check_pretrained(args, facts)
    if facts.model_source is not None:
        check_model_flags(args, facts.model_source[1], facts.model_source[2], facts.model_source[0])
    if not check_only:  # (launch --check: the run's folders are on another machine)
        resumes = isinstance(facts.load_step, int) and not getattr(args, "finetune", False)
        check_run_folders(args, facts.load_step, facts.load_step if resumes else 0,  # (a DFlash drafter's --load:)
                          load_claimed=args.load in facts.objective_inputs.facts.values())
    return replace(facts, flags=flags, derived=MappingProxyType(dict(args.derived)))


def check_flags(args: _Resolving, world_size: int, check_only: bool = False) -> Resolved:
    """Derive the unset flags a rule fills (onto `args.derived`), refuse bad input with a message
    naming the flag and the rule, and return what else the flags derive.

    `check_only` (`python -m megatron_csbp.launch RECIPE --check`, on a machine that need not hold
    the run's files): a --load checkpoint or tokenizer that is not here, and flags whose values are
    placeholders (`args.placeholders`, a set of dests), skip the rules that need them; every other
    rule runs. What was skipped is listed in `Resolved.check_notes`."""
    from megatron_csbp.parallel.state import check_topology

    placeholders, notes = set(getattr(args, "placeholders", ())), []
    defaults = {o.name: o.default for o in OPTIONS}  # a flag left at its default gives way (dflash: to its features)
    objective = objective_class(args.objective)
    drafter = None
    if objective.loads_drafter and args.load:
        from megatron_csbp.checkpoint.drafter import read_shape

        drafter = read_shape(args.load)
    inputs = objective.prepare_args(args, defaults, check_only, notes, drafter)
    for dest, value in inputs.flags.items():
        setattr(args, dest, value)
    check_counts(args)

    sizes = check_topology(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.context_parallel_size, args.block_parallel_size, args.expert_model_parallel_size)
    dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size * sizes.shard_group_size)
    load_step = shape = source = None
    away = [f"--{d.replace('_', '-')} {getattr(args, d)}" for d in ("load", "pretrained_checkpoint") if check_only
            and getattr(args, d) and (d in placeholders or not os.path.exists(getattr(args, d)))]
    if away:
        notes.append(f"{' and '.join(away)} {'is' if len(away) == 1 else 'are'} not here: the model-shape rules (flags "
                     "vs the checkpoint's shape, MoE and DiffusionGemma requirements) run at launch")
    elif args.load or args.ckpt_step is not None or args.pretrained_checkpoint:
        from megatron_csbp.checkpoint.files import checkpoint_shape, checkpoint_to_load, model_source
        load_step = checkpoint_to_load(args.load, args.ckpt_step)
        source = model_source(args.load, load_step, args.pretrained_checkpoint)
        # (no checkpoint to load: --load's shape file alone still gives the model, e.g. a recipe's check)
        shape = checkpoint_shape(*source[1:]) if source else checkpoint_shape(args.load, None) if args.load else None
        if source and source[0] != "--load":  # (a LoRA checkpoint's recorded base when not given)
            args.pretrained_checkpoint = source[1]
    facts = Resolved(world_size=world_size, data_parallel_size=dp, load_step=load_step, model_source=source,
                     model_shape=shape, shape_unknown=bool(away), objective_inputs=inputs, check_notes=notes)
    if shape is not None:
        apply_model_shape(args, shape, *(source or ("--load", args.load))[:2])
    check_clean_attention(args, shape)
    # The block geometry and the layout of the shard group, as the model will build them: their
    # own rules (whole blocks, zigzag chunks, a block for every block-parallel rank) run here.
    SequenceLayout(BlockGeometry(args.seq_length, args.block_size, args.clean_attention),
                   args.context_parallel_size, args.block_parallel_size, args.block_ownership)
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
                         f"{args.num_attention_heads}")
    if shape is None and args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} must divide --hidden-size {args.hidden_size}")
    tp = args.tensor_model_parallel_size
    if args.num_query_groups % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide --num-query-groups {args.num_query_groups}")
    check_model_options(args, check_only, shape)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM does the same
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size if not args.swiglu else int(8 * args.hidden_size / 3 / 16 + 0.999) * 16
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {dp}")
    facts = replace(facts, num_microbatches=args.global_batch_size // per_step)
    check_run_flags(args)
    check_experts_and_objective(args, facts)
    # Data and tokenizer.
    sources = sum(bool(getattr(args, d, None)) for d in ("mock_data", "data_path", "sft_data_path", "features_path"))
    if sources == 0:
        raise ValueError("give one of --mock-data, --data-path or --sft-data-path")
    if sources > 1:
        raise ValueError("--mock-data, --data-path and --sft-data-path are mutually exclusive")
    if args.data_path and "data_path" not in placeholders:
        from megatron_csbp.objectives.data import check_token_data
        note = check_token_data(args, files_elsewhere=check_only)
        if note:
            notes.append(note)
    if args.fp16 and args.bf16:
        raise ValueError("give --bf16 or --fp16, not both")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError("--grad-reduce-in-bf16 reduces bfloat16 gradients: it needs --bf16")
    if args.sft_trajectory_turns == "all":
        if args.objective != "diffusiongemma-sft":
            raise ValueError("--sft-trajectory-turns all makes one sample per assistant turn for --objective "
                             "diffusiongemma-sft (one response canvas a sample); other objectives supervise every "
                             "turn of a record in one sample")
        if args.pipeline_model_parallel_size > 1:
            raise ValueError("--sft-trajectory-turns all with --pipeline-model-parallel-size > 1: a micro-batch holds "
                             "its records' turn rows, which the pipeline's P2P shapes do not follow")
    if args.pack_sequences and not args.sft_data_path:
        raise ValueError("--pack-sequences packs conversations: it needs --sft-data-path")
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if (args.mock_data and args.tokenizer_model is None) else \
            "SentencePieceTokenizer"
    if args.sft_data_path and "chat_template" not in placeholders:
        from megatron_csbp.data.sft import check_chat_template

        check_chat_template(args.chat_template, args.tokenizer_type == "HuggingFaceTokenizer")
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
    from megatron_csbp.parallel.pipeline import check_pipeline_args
    facts = replace(facts, virtual_pipeline_model_parallel_size=check_pipeline_args(args, facts.num_microbatches))
    if (args.pipeline_model_parallel_size > 1 and args.micro_batch_size > 1
            and not objective.fixed_rows
            and (args.reset_attention_mask or args.reset_position_ids)):
        # Samples with different documents run one by one and a stage sends their hidden states
        # side by side ([rows, b, h]): that needs the same rows in every sample.
        raise ValueError(f"--objective {args.objective} gives each packed sample its own rows: under "
                         "--pipeline-model-parallel-size > 1 with --reset-attention-mask / --reset-position-ids "
                         "use --micro-batch-size 1")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    # Tokenizer facts (cheap to load): vocabulary, EOD, default mask token.
    if check_only and args.tokenizer_type != "NullTokenizer" and (
            "tokenizer_model" in placeholders or (args.tokenizer_model and not os.path.exists(args.tokenizer_model))):
        notes.append(f"--tokenizer-model {args.tokenizer_model} is not here: the vocabulary and mask-token "
                     "rules run at launch")
        return facts
    tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    if (args.vocab_size and args.tokenizer_type != "NullTokenizer" and args.vocab_size != tok.vocab_size
            and shape is None):  # a checkpoint's vocabulary may exceed its tokenizer's (checked below)
        raise ValueError(f"--vocab-size {args.vocab_size} disagrees with the tokenizer's {tok.vocab_size}")
    args.vocab_size = tok.vocab_size  # from here on the tokenizer's vocabulary, EOD included
    from megatron_csbp.data.sft import sft_pad_id

    facts = replace(facts, eod_token_id=tok.eod, pad_token_id=sft_pad_id(tok))
    if shape is not None:
        if tok.vocab_size > shape.vocab_size:
            raise ValueError(f"the tokenizer's vocabulary ({tok.vocab_size}) is larger than the checkpoint's "
                             f"({shape.vocab_size})")
        args.vocab_size = shape.vocab_size  # the model's vocabulary, unpadded
    if args.data_path and "data_path" not in placeholders and not (check_only and missing_prefixes(args.data_path)):
        top, where = largest_token_id(args.data_path, args.vocab_size)
        if top >= args.vocab_size:
            vocab = (f"--tokenizer-type NullTokenizer --vocab-size {null_tokenizer_vocab_flag(args.vocab_size)}"
                     if args.tokenizer_type == "NullTokenizer"
                     else f"--tokenizer-type {args.tokenizer_type} {args.tokenizer_model or ''}".strip())
            raise ValueError(f"--data-path {where} holds token id {top}, outside the vocabulary of {args.vocab_size} "
                             f"ids ({vocab}{', the --load checkpoint' if shape is not None else ''}): give the "
                             "tokenizer the data was preprocessed with")
    if check_only and ({"mask_token", "mask_token_id"} & placeholders
                       or (args.mask_token is not None and facts.shape_unknown)):
        notes.append("the mask token is a placeholder (or needs the --load checkpoint's tokenizer): its "
                     "vocabulary rule runs at launch")
        return facts
    if args.mask_token is not None:
        if args.mask_token_id is not None:
            raise ValueError("give --mask-token-id or --mask-token, not both")
        assets = args.tokenizer_model if args.tokenizer_type == "HuggingFaceTokenizer" else \
            os.path.join(source[1], "hf_assets") if source else None
        try:
            args.mask_token_id = resolve_mask_token(args.mask_token, tokenizer_path=assets,
                                                    vocab_size=args.vocab_size)
        except FileNotFoundError as exc:
            raise ValueError(f"--mask-token: {exc}") from None
    from megatron_csbp.model.builder import embedding_rows

    rows = embedding_rows(args, shape)
    if args.mask_token_id is None and objective.mask_from_tokenizer:
        args.mask_token_id = default_mask_token_id(tok.mask_token_id, tok.vocab_size, rows)
    build_objective(args, rows)  # as the model will build it: its mask token a real id of the vocabulary
    return facts


def check_counts(args) -> None:
    """Each flag's own rule (config/options.py: sizes, counts and intervals positive, ranges);
    an unset --eval-iters takes Megatron-LM's 100 when evaluations are asked for."""
    check_options(args)
    if args.eval_iters is None:
        args.eval_iters = 100 if (getattr(args, "eval_interval", None) or getattr(args, "skip_train", False)) else 0


def check_pretrained(args, facts: Resolved) -> None:
    """An objective that adapts a pretrained model (fast-dllm-v2) and Megatron's --finetune start from
    weights: a --load that holds no checkpoint (a typo) must not start a random model."""
    needs = objective_class(args.objective).needs_pretrained  # (an unknown objective: refused by check_flags)
    why = f"--objective {args.objective} {needs}" if needs else \
        ("--finetune starts from the weights of --load" if getattr(args, "finetune", False) else None)
    if why is None or facts.model_source is not None or facts.shape_unknown:  # (launch --check: --load not here)
        return
    if not args.load:
        raise ValueError(f"{why}: give --load DIR (a checkpoint, e.g. from python -m megatron_csbp.convert "
                         "hf-to-megatron)")
    raise ValueError(f"{why}: --load {args.load} holds no checkpoint (no latest_checkpointed_iteration.txt"
                     f"{'' if os.path.isdir(args.load) else '; the folder does not exist'})")


def apply_model_shape(args: argparse.Namespace, shape, flag: str = "--load", folder: Optional[str] = None) -> None:
    """The model comes from the checkpoint's megatron_csbp_model.json (`flag folder`: --load or
    --pretrained-checkpoint): fill the shape flags from it and refuse flags that contradict it (a
    flag left at its default takes the checkpoint's value)."""
    where = f"{flag} {folder or args.load}"
    from megatron_csbp.model.families import flag_values

    if args.tokenizer_type is None and not args.tokenizer_model:
        args.tokenizer_type = "NullTokenizer"  # pre-tokenized data of the source model's tokenizer
    for dest, value in flag_values(shape).items():
        if dest == "vocab_size" and args.tokenizer_type == "NullTokenizer":
            value = null_tokenizer_vocab_flag(value)  # the flag whose NullTokenizer has the checkpoint's rows
        given = getattr(args, dest)
        if given == BY_NAME[dest].default or given == value:
            setattr(args, dest, value)
            continue
        if dest == "vocab_size" and args.tokenizer_type not in (None, "NullTokenizer"):
            continue  # a tokenizer's vocabulary may be smaller than the model's: checked later
        flag = "--" + dest.replace("_", "-")
        if dest == "vocab_size":  # (NullTokenizer)
            raise ValueError(f"--vocab-size {given} contradicts the checkpoint {where}: its vocabulary of "
                             f"{shape.vocab_size} ids is --vocab-size {value} ({null_tokenizer_rule()}); drop the flag")
        raise ValueError(f"{flag} {given} contradicts the checkpoint {where} ({flag} {value} in its "
                         "megatron_csbp_model.json); drop the flag: the model shape comes from the checkpoint")
    from megatron_csbp.model.families import family_names, get_family

    if shape.is_moe and not get_family(shape.family).trainer_trains_moe:
        trained = [f for f in family_names() if get_family(f).trainer_trains_moe]
        raise ValueError(f"{where} holds a {shape.family} MoE model ({shape.num_experts} experts): "
                         f"python -m megatron_csbp.train trains dense converted models and the MoE of {trained} only "
                         "(train other MoE models through the Megatron-LM hooks)")
    tp = args.tensor_model_parallel_size
    if shape.vocab_size % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide the checkpoint's vocabulary "
                         f"{shape.vocab_size} (converted models are not padded)")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        args.tokenizer_model = os.path.join(folder or args.load, "hf_assets")  # the tokenizer that came with the model


def check_model_options(args, check_only: bool = False, shape=None) -> None:
    """Rules between model flags (each flag's own: config/options.py): rope scaling,
    recomputation, and the attention kernel named by --attention-backend (`shape`: the --load model's)."""
    if args.use_rope_scaling and args.rotary_seq_len_interpolation_factor is not None:
        raise ValueError("give --use-rope-scaling or --rotary-seq-len-interpolation-factor, not both")
    if args.recompute_granularity != "full":
        for flag, value in (("--recompute-method", args.recompute_method),
                            ("--recompute-num-layers", args.recompute_num_layers)):
            if value is not None:
                raise ValueError(f"{flag} {value} needs --recompute-granularity full (got "
                                 f"{args.recompute_granularity}); Megatron recomputes selectively per layer otherwise")
    else:
        layers = 1 if args.recompute_num_layers is None else args.recompute_num_layers  # (model.recompute_options)
        if not 1 <= layers <= args.num_layers:
            raise ValueError(f"--recompute-num-layers {layers} must be between 1 and --num-layers {args.num_layers}")
    implied = BACKEND_KERNEL.get(args.attention_backend)
    if implied is not None:
        if args.attention_kernel not in ("auto", implied):
            raise ValueError(f"--attention-backend {args.attention_backend} selects the {implied} kernel, "
                             f"--attention-kernel {args.attention_kernel} another: give one of them")
        args.attention_kernel = implied
    if args.attention_kernel == "flex" and not args.skip_train and not check_only and not torch.cuda.is_available():
        raise ValueError("--attention-kernel flex (or --attention-backend flash/fused) trains on CUDA only: "
                         "FlexAttention has no backward on CPU; use tiled (--attention-backend local) here")
    if args.attention_kernel == "flash" and not check_only:
        from megatron_csbp.attention.kernels.flash import require_flash_attn
        if not torch.cuda.is_available():
            raise ValueError("--attention-kernel flash runs on CUDA only (flash-attn's kernels); use tiled "
                             "(--attention-backend local) here")
        try:
            require_flash_attn()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    if shape is not None and args.add_bias_linear:
        raise ValueError(f"--add-bias-linear: the model shape comes from the checkpoint --load {args.load}")


def check_clean_attention(args, shape=None) -> None:
    """Fills the --clean-attention default; the family of a --load model (`shape`) may fix it
    (DiffusionGemma's clean stream is token-causal: `Family.clean_attention`)."""
    from megatron_csbp.model.families import get_family

    fixed = get_family(shape.family).clean_attention if shape is not None else None
    if args.clean_attention is None:
        args.clean_attention = fixed or "block_causal"
    if fixed is not None and args.clean_attention != fixed:
        raise ValueError(f"--clean-attention {args.clean_attention}: a {shape.family} model's clean stream is {fixed}")


def check_experts_and_objective(args, facts: Resolved) -> None:
    """Expert parallelism needs an MoE model; the objective's own rules (`Objective.validate`, e.g.
    DiffusionGemma's SFT needs DiffusionGemma and SFT data)."""
    shape, unknown = facts.model_shape, facts.shape_unknown  # unknown: launch --check without the checkpoint
    check_moe_flags(args, shape)
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
        unit = balanced_block_unit(args.block_parallel_size, args.block_ownership)
        blocks = args.seq_length // args.block_size
        if args.block_parallel_size > 1 and blocks % unit:
            raise ValueError(f"--expert-model-parallel-size {ep} with --block-parallel-size {args.block_parallel_size}: "
                             f"--seq-length / --block-size = {blocks} blocks must be a multiple of {unit} so every "
                             f"block-parallel rank owns as many noisy blocks ({args.block_ownership} ownership); the "
                             "MoE token dispatcher needs equal row counts across expert ranks")
    resume_objective_flags(args, facts)
    objective_class(args.objective).validate(args, facts)


def resume_objective_flags(args: argparse.Namespace, facts: Resolved) -> None:
    """Fill the unset objective flags whose rule changed (`Flag.before`): a resume of a checkpoint of
    the same objective keeps the rule it was trained with (its `bdlm_meta.json`; `before` where it
    predates the flag), anything else gets the flag's `fallback`."""
    flags = [f for f in objective_class(args.objective).flags if f.before is not None and getattr(args, f.dest, None) is None]
    saved = {}
    if flags and facts.load_step is not None and not getattr(args, "finetune", False):
        from megatron_csbp.checkpoint.files import saved_model_args

        saved = saved_model_args(args.load, facts.load_step) or {}
    for f in flags:
        resumed = saved.get("objective") == args.objective
        setattr(args, f.dest, (saved.get(f.dest) or f.before) if resumed else f.fallback)


def check_run_flags(args: argparse.Namespace) -> None:
    """Rules between Megatron-LM's training, checkpoint and logging flags; fills --train-iters from
    --train-samples. Runs after --global-batch-size is known."""
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise ValueError("give --train-iters or --train-samples, not both")
        if args.train_samples <= 0 or args.train_samples % args.global_batch_size:
            raise ValueError(f"--train-samples {args.train_samples} must be a positive multiple of "
                             f"--global-batch-size {args.global_batch_size}")
        args.train_iters = args.train_samples // args.global_batch_size
    elif args.train_iters is None:
        args.train_iters = 100
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ValueError("give --lr-warmup-iters or --lr-warmup-fraction, not both")
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
        if importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs the wandb package (pip install wandb; WANDB_MODE=offline "
                             "logs without an account)")


def check_moe_flags(args: argparse.Namespace, shape=None) -> None:
    """Rules of the MoE flags of a flag-built model (`shape`: the --load model's)."""
    if args.num_experts is None or shape is not None:
        return  # dense; or a converted model, whose MoE comes from its shape (apply_model_shape compares the flags)
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ValueError(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts "
                         f"{args.num_experts}")
    pattern = moe_layer_pattern(args.moe_layer_freq, args.num_layers)  # 1 where layer i is MoE
    if len(pattern) != args.num_layers or not any(pattern):
        raise ValueError(f"--moe-layer-freq {args.moe_layer_freq}: {len(pattern)} entries for --num-layers "
                         f"{args.num_layers}, at least one MoE layer")
    if args.moe_token_dispatcher_type == "flex":
        raise ValueError("--moe-token-dispatcher-type flex needs DeepEP (CUDA): use allgather or alltoall")
    if args.moe_grouped_gemm and not torch.cuda.is_available():
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


def model_args(args, **overrides):
    """ModelArgs of the resolved flags (`Resolved`, or Megatron-LM's namespace: every field it names,
    the --load shape, the EOD, ...), then `overrides`; carrying the objective's own flags and
    `Resolved.objective_inputs.facts` along (ModelArgs need not name them)."""
    from megatron_csbp.training.model import ModelArgs

    names = ModelArgs.__dataclass_fields__
    margs = ModelArgs(**{**{k: getattr(args, k) for k in names if hasattr(args, k)}, **overrides})
    inputs = getattr(args, "objective_inputs", ObjectiveInputs())
    for dest, value in {**objective_options(args), **inputs.facts}.items():
        setattr(margs, dest, value)
    return margs

