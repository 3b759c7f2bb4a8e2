"""Megatron-LM integration without forking it (checked against Megatron-LM tag core_v0.16.1,
commit 55ac7082517c3878ae653c07c09c534b8aed49f6, on megatron-core 0.16.1, and tag core_v0.19.0 on
megatron-core 0.19.2).

`extra_args_provider`, `rewrite_argv`, `install()` (initialisation and validation hooks, the CPU
shim), `model_provider`, `forward_step`; where the tags differ, one function each. What each piece
does and why: docs/megatron-lm.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from functools import lru_cache, partial
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from megatron_csbp.checkpoint.files import CheckpointError
from megatron_csbp.compat import replace_once, swapped
from megatron_csbp.layout.packing import Packing
from megatron_csbp.layout.sizes import check_parallel_sizes, shard_group_size
from megatron_csbp.objectives.flags import check_mask_token_id, default_mask_token_id
from megatron_csbp.objectives.registry import objective_class
from megatron_csbp.lora import LoRAConfig, is_adapter
from megatron_csbp.training.arguments import add_block_diffusion_args, model_args
from megatron_csbp.utils.cli import UsageError


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_block_diffusion_args(parser)
    parser.add_argument("--bdlm-context-parallel-size", type=int, default=None,
                        help="(set by megatron_csbp.training.megatron_lm.rewrite_argv) the clean-ring size; Megatron's "
                             "--context-parallel-size holds max(CP, BP)")
    parser.add_argument("--allow-mask-token-in-vocab", action="store_true",
                        help="accept a --mask-token-id that the tokenizer can produce (default: refused, since data "
                             "tokens equal to it would read as masks; such tokens are then never loss targets)")
    return parser


_PIPELINE_SPLIT = "stages are cut by --decoder-first/last-pipeline-num-layers or an even split " \
    "(megatron_csbp/parallel/pipeline.py)"
# Megatron-LM flags (dests) whose values the plugin cannot honour: (dest, allowed values, why).
_REFUSED_MEGATRON_FLAGS = (
    ("position_embedding_type", ("rope", "none"),
     "the layouts place a position's noisy and clean rows on different ranks and pass each row's position "
     "to the rotary embedding; Megatron's default learned_absolute embedding reads positions 0..L-1 of the "
     "local rows instead. Pass --position-embedding-type rope"),
    ("attention_dropout", (0.0,), "dropout on attention probabilities would make the loss depend on the layout "
     "(ranks draw different masks for the same row). Pass --attention-dropout 0"),
    ("hidden_dropout", (0.0,),
     "dropout masks are drawn per rank, so the loss would depend on the layout. Pass --hidden-dropout 0"),
    ("pipeline_model_parallel_layout", (None,), _PIPELINE_SPLIT),
    ("account_for_embedding_in_pipeline_split", (False,), _PIPELINE_SPLIT),
    ("account_for_loss_in_pipeline_split", (False,), _PIPELINE_SPLIT),
)


def default_eval_interval(args) -> None:
    """`--eval-interval` unset means "no evaluation during training" (Megatron-LM's ValidationConfig),
    but Megatron-LM (0.16.1 and 0.19.0) itself then fails after its argument dump: its
    `get_train_valid_test_num_samples` computes `train_iters // eval_interval` (TypeError on None).
    Give it that meaning: `--train-iters + 1` (no iteration 1..train_iters is a multiple of it, and
    the validation dataset holds the `--eval-iters` batches of the evaluation after training).
    With `--train-samples` (no `--train-iters`) the flag is demanded."""
    if getattr(args, "eval_interval", 0) is not None or getattr(args, "skip_train", False):
        return
    if not args.train_iters:
        raise ValueError("--eval-interval is unset: Megatron-LM divides --train-iters by it when sizing the "
                         "validation set (and fails after its argument dump); pass --eval-interval N "
                         "(with --eval-iters 0 for no evaluation)")
    args.eval_interval = args.train_iters + 1
    if getattr(args, "rank", 0) == 0:
        print(f"> block diffusion: --eval-interval unset: set to {args.eval_interval} (--train-iters + 1: no "
              "evaluation during training; Megatron-LM fails on an unset --eval-interval)", flush=True)


class MegatronLMFlagError(UsageError, ValueError):
    """A Megatron-LM flag the plugin cannot honour (the message names it); `pretrain_bdlm` prints it as
    one line (`megatron_csbp.utils.cli`), a library caller can catch it as a ValueError."""


def _requirements_of_this_machine(args) -> None:
    """What Megatron-LM itself would only find out after its argument dump, deep in a traceback."""
    from megatron_csbp.compat.device import cuda_absent

    if cuda_absent() and getattr(args, "distributed_backend", "gloo") != "gloo":
        raise ValueError(f"--distributed-backend {args.distributed_backend} needs CUDA GPUs and this machine has "
                         "none: pass --distributed-backend gloo (docs/megatron-lm.md lists the other flags of a "
                         "CPU run)")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            raise ValueError("--transformer-impl transformer_engine (Megatron-LM's default) needs Transformer "
                             "Engine, which is not installed: pass --transformer-impl local")


#: Megatron-LM's data flags; without any of them its dataset builder fails deep in pretrain()
DATA_SOURCES = ("mock_data", "data_path", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
                "per_split_data_args_path", "sft_data_path")


def validate_megatron_args(args) -> None:
    """Refuse what the plugin cannot honour (the flag named), on Megatron-LM's parsed arguments BEFORE
    its own `validate_args` (which ends in the ~700-line argument dump): every rule here reads flags
    as given, none needs Megatron's derived values."""
    default_eval_interval(args)
    for dest, allowed, why in _REFUSED_MEGATRON_FLAGS:
        value = getattr(args, dest, allowed[0])
        if value not in allowed:
            raise ValueError(f"--{dest.replace('_', '-')} {value} is not supported with block diffusion: {why}")
    _requirements_of_this_machine(args)
    if not args.skip_train and not any(getattr(args, a, None) for a in DATA_SOURCES):
        raise ValueError("no training data: pass --data-path PREFIX (a .bin/.idx pair that python -m "
                         "megatron_csbp.data.preprocess writes) or --mock-data")
    objective = objective_class(args.objective)
    if objective.megatron_lm_refusal is not None:
        raise ValueError(f"--objective {args.objective} {objective.megatron_lm_refusal}")
    objective.validate(args)  # its flags' rules (noise schedule, ...), before any process group
    if args.mask_token is not None:
        raise ValueError("--mask-token (a string of a converted checkpoint's tokenizer) is for python -m "
                         "megatron_csbp.train; with Megatron-LM pass --mask-token-id or leave it unset (default: "
                         "the first padding id of the vocabulary)")
    if not args.calculate_per_token_loss:
        raise ValueError("block diffusion needs --calculate-per-token-loss (rewrite_argv adds it)")


def _tokenizer_mask_id(tokenizer) -> Optional[int]:
    """The tokenizer's own mask token, or None (Megatron's tokenizers raise NotImplementedError or
    return -1 when they have none)."""
    try:
        mask = tokenizer.mask
    except (AttributeError, NotImplementedError):
        return None
    return int(mask) if isinstance(mask, int) and mask >= 0 else None


def resolve_mask_token_id(args, tokenizer) -> Optional[int]:
    """The mask id, chosen so that it cannot collide with data (sets args.mask_token_id).

    Unset: `objectives.flags.default_mask_token_id` (the tokenizer's own mask token, else the first
    padding id; the trainer's rule too) over Megatron's padded vocabulary. Given: it must be an embedding
    row, and an id the tokenizer can produce (other than its mask token) needs --allow-mask-token-in-vocab."""
    if objective_class(args.objective).mask_token_needed is None:
        return args.mask_token_id
    vocab, padded = int(tokenizer.vocab_size), int(args.padded_vocab_size)
    own = _tokenizer_mask_id(tokenizer)
    if args.mask_token_id is None:
        args.mask_token_id = default_mask_token_id(own, vocab, padded)
        if args.mask_token_id is None:
            raise ValueError(f"--mask-token-id is unset and the padded vocabulary ({padded}) has no id past the "
                             f"tokenizer's {vocab}: pass --mask-token-id, or raise --make-vocab-size-divisible-by")
        return args.mask_token_id
    mid = int(args.mask_token_id)
    check_mask_token_id(mid, padded, vocabulary="padded vocabulary")
    if mid < vocab and mid != own and not args.allow_mask_token_in_vocab:
        raise ValueError(f"--mask-token-id {mid} is an id the tokenizer can produce (its vocabulary is [0, {vocab})): "
                         f"data tokens equal to it would be read as masks. Leave --mask-token-id unset (default "
                         f"{vocab if padded > vocab else 'none free'}: the first padding id), pass an id in "
                         f"[{vocab}, {padded}), or pass --allow-mask-token-in-vocab")
    return mid


def validation_module():
    """The module whose `validate_args` and `set_global_variables` Megatron-LM's argument parsing calls:
    `megatron.training.initialize` (core_v0.16.1: `initialize_megatron` parses and validates) or
    `megatron.training.arguments` (core_v0.19.0: `parse_and_validate_args`, called before `pretrain`)."""
    from megatron.training import arguments, initialize

    return initialize if hasattr(initialize, "validate_args") else arguments


def install_validation_hook() -> None:
    """Megatron-LM's argument parsing then runs `validate_megatron_args` right BEFORE its own
    `validate_args` (and its argument dump), and resolves the mask id right after building the
    tokenizer (which sets `padded_vocab_size`), before any process group or model exists. A refusal
    is a `MegatronLMFlagError`."""
    def validate(validate_args):
        def validated(args, defaults={}):
            try:
                validate_megatron_args(args)
            except ValueError as e:
                raise MegatronLMFlagError(str(e)) from None
            return validate_args(args, defaults)
        return validated

    def set_globals(set_global_variables):
        def with_mask_token(args, build_tokenizer=True):
            out = set_global_variables(args, build_tokenizer)
            if build_tokenizer:
                from megatron.training import get_tokenizer
                try:
                    mask = resolve_mask_token_id(args, get_tokenizer())
                except ValueError as e:
                    raise MegatronLMFlagError(str(e)) from None
                if args.rank == 0 and mask is not None:
                    print(f"> block diffusion: --objective {args.objective}, mask token id {mask}", flush=True)
            return out
        return with_mask_token

    replace_once(validation_module(), "validate_args", validate)
    replace_once(validation_module(), "set_global_variables", set_globals)


def flag_value(argv: Sequence[str], name: str) -> Optional[str]:
    """The value of flag `name` in argv (either spelling: `name value`, `name=value`), or None."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _set_flag(argv: List[str], name: str, value) -> List[str]:
    """`argv` without `name` (and its value), then `name value`."""
    kept = [a for i, a in enumerate(argv)
            if a != name and not a.startswith(name + "=") and (i == 0 or argv[i - 1] != name)]
    return kept + [name, str(value)]


def rewrite_argv(argv: Sequence[str]) -> List[str]:
    """Megatron-LM argv with CP = max(CP, BP), the true CP recorded, per-token loss on."""
    argv = list(argv)
    cp = int(flag_value(argv, "--context-parallel-size") or 1)
    bp = int(flag_value(argv, "--block-parallel-size") or 1)
    try:
        check_parallel_sizes(cp, bp)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if "--bdlm-context-parallel-size" not in " ".join(argv):
        argv = _set_flag(argv, "--bdlm-context-parallel-size", cp)
        argv = _set_flag(argv, "--context-parallel-size", shard_group_size(cp, bp))
    if "--calculate-per-token-loss" not in argv:
        argv.append("--calculate-per-token-loss")
    return argv


def _true_cp(args) -> int:
    return args.bdlm_context_parallel_size or args.context_parallel_size


def install_initialize_hook() -> None:
    """After this, Megatron-LM's `mpu.initialize_model_parallel(...)` also builds the plugin groups."""
    from megatron.core import parallel_state as mpu

    def hook(original):
        def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                      virtual_pipeline_model_parallel_size=None, *args, **kwargs):
            from megatron.training import get_args
            from megatron_csbp.parallel import state as bps

            a = get_args()
            seq = kwargs.pop("context_parallel_size", 1)
            ep = kwargs.pop("expert_model_parallel_size", 1)
            cp, bp = _true_cp(a), a.block_parallel_size
            if shard_group_size(cp, bp) != seq:
                raise ValueError(f"Megatron's --context-parallel-size is {seq}, expected max(CP {cp}, BP {bp}); "
                                 "launch through megatron_csbp.training.megatron_lm.rewrite_argv "
                                 "(examples/megatron_lm/pretrain_bdlm.py)")
            with swapped(mpu, "initialize_model_parallel", original):  # initialize_block_parallel calls Megatron's
                bps.initialize_block_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, cp, bp, ep,
                                              virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                                              **kwargs)
        return initialize_model_parallel

    replace_once(mpu, "initialize_model_parallel", hook)


def _eod_token_id(args) -> Optional[int]:
    """The tokenizer's EOD (Megatron-LM's packed-document flags read documents from it)."""
    if not (args.reset_attention_mask or args.reset_position_ids or args.eod_mask_loss):
        return None
    from megatron.training import get_tokenizer

    return int(get_tokenizer().eod)


def _model_args_from_megatron(args):
    """ModelArgs of Megatron-LM's arguments (the same names): the embedding's rows are its padded
    vocabulary, the clean ring its true CP (`_true_cp`)."""
    return model_args(args, vocab_size=args.padded_vocab_size, make_vocab_size_divisible_by=1,
                      context_parallel_size=_true_cp(args), clean_attention=args.clean_attention or "block_causal",
                      eod_token_id=_eod_token_id(args))


class _AdapterState:
    """A LoRA chunk under pretrain(): Megatron-LM's checkpoints hold its adapters (and their optimizer
    state) only, as the trainer's (docs/lora.md#checkpoints); the frozen base comes from
    --pretrained-checkpoint (`install_checkpoint_hook`)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return {k: v for k, v in state.items() if is_adapter(k)}


@lru_cache(maxsize=None)
def adapter_chunk() -> type:
    """`TrainableBDLM` with `_AdapterState`'s checkpoint state (built on first use: megatron-core)."""
    from megatron_csbp.training.model import TrainableBDLM

    return type("AdapterChunk", (_AdapterState, TrainableBDLM), {})


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None):
    """Megatron-LM model provider: GPTModel (Megatron-LM's config and spec choice) as a BDLM, through
    `model.assemble` (the trainer's weights under pipeline parallelism)."""
    import contextlib

    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_csbp.lora.spec import adapted
    from megatron_csbp.model import assemble
    from megatron_csbp.parallel import pipeline
    from megatron_csbp.training.model import TrainableBDLM

    args = get_args()
    stage = pipeline.Stage(pre_process, post_process, vp_stage)
    config = config or core_transformer_config_from_args(args)
    if not config.calculate_per_token_loss:
        raise ValueError("block diffusion needs --calculate-per-token-loss (rewrite_argv adds it)")
    margs = _model_args_from_megatron(args)
    lora = LoRAConfig.of(margs)
    if margs.mask_token_id is None and objective_class(margs.objective).mask_token_needed is not None:
        raise ValueError(f"--objective {margs.objective} needs a mask id: run through pretrain_bdlm (its validation "
                         "hook picks the first padding id) or pass --mask-token-id")

    def build():
        # the trainer's layer spec (a --moe-layer-freq pattern places the MoE layers, as in Megatron-LM's
        # own GPT builder), with TransformerEngine's layers under --transformer-impl transformer_engine
        spec = assemble.layer_spec(margs, config, vp_stage, args.transformer_impl == "transformer_engine")
        # Megatron-LM seeds each stage with --seed + 100 x PP rank: a chunk is built from --seed instead
        # (the trainer's weights), leaving Megatron-LM's generator state as it was.
        with contextlib.nullcontext() if stage.whole else torch.random.fork_rng(devices=[]):
            return assemble.flag_built_gpt(margs, config, spec, stage, args.padded_vocab_size,
                                           args.max_position_embeddings, seed=None if stage.whole else args.seed,
                                           redraw_experts=False, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                                           parallel_output=True)

    gpt = adapted(lora, build, args.seed)  # LoRA: adapters, base frozen before Megatron-LM's DDP
    bdlm = assemble.wrap(margs, gpt)
    if config.pipeline_model_parallel_size > 1:
        # Megatron-LM's schedules send [decoder_seq_length (else seq_length) / CP, b, h]: this
        # rank's rows cross the stage boundary (megatron_csbp/parallel/pipeline.py).
        args.decoder_seq_length = pipeline.p2p_seq_length(bdlm)
        config.variable_seq_lengths = pipeline.variable_rows(bdlm.objective)
    return (TrainableBDLM if lora is None else adapter_chunk())(config, bdlm)


#: Evaluation samples are keyed EVAL_SAMPLE_INDEX_BASE + (their index in the validation stream), so
#: they never share a noise draw with a training sample (training indices stay below 2**62).
EVAL_SAMPLE_INDEX_BASE = 1 << 62


class _SampleCounter:
    """Global sample indices from Megatron-LM's consumed-sample counters (its sampler's arithmetic).

    Megatron-LM advances `consumed_train_samples` (after each training step) and
    `consumed_valid_samples` (after each evaluation step) by the global batch size; micro-batch m of
    data-parallel rank r then holds samples consumed + m * mbs * DP + r * mbs .. + mbs. Training and
    evaluation keep separate micro-batch positions (the model's train()/eval() mode says which), so
    an evaluation never moves the training noise: training losses do not depend on whether or how
    often evaluation runs. Under interleaved pipelining each model chunk reads every micro-batch
    once, so the positions are kept per chunk (`chunk`). State: two (consumed, micro) pairs per chunk."""

    def __init__(self):
        self.state = {}

    def indices(self, args, micro_batch_size: int, training: bool = True, chunk: int = 0):
        from megatron.core import parallel_state as mpu

        consumed = args.consumed_train_samples if training else args.consumed_valid_samples
        seen, micro = self.state.get((training, chunk), (None, 0))
        if seen != consumed:
            micro = 0
        self.state[(training, chunk)] = (consumed, micro + 1)
        dp, r = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        start = consumed + micro * micro_batch_size * dp + r * micro_batch_size
        if not training:
            start += EVAL_SAMPLE_INDEX_BASE
        return torch.arange(start, start + micro_batch_size)


_COUNTER = _SampleCounter()


def loss_func(out, denominator_share, output_tensor):
    report = torch.stack([out.weighted_sum.float(), denominator_share.float()])
    return output_tensor, denominator_share.to(torch.int), {"lm loss": report}


def bdlm_batch(batch, mask_token_id: Optional[int], packing: Optional[Packing] = None, target_shift: int = 0):
    """(clean sequence, supervised-token mask) from Megatron-LM's GPT batch.

    Megatron's `loss_mask` is defined on `labels` (text[1:], the next-token targets): it is 0 at EOD
    tokens under --eod-mask-loss, at padding, and wherever the dataset says so. A BDLM's targets are
    the tokens of the sequence itself, so the plugin diffuses `labels`: `loss_mask` then applies
    position by position, and consecutive samples (text[kL : (k+1)L + 1]) tile the corpus without
    overlap. Unsupervised positions stay clean context and are never noised. A label equal to the
    mask id (only possible with --allow-mask-token-in-vocab) is not a target either: the mask
    token's logit is excluded from the softmax, so its cross entropy would be infinite. The BD3-LM
    denominator is the number of supervised tokens in the global batch."""
    clean = batch["labels"]
    supervised = batch["loss_mask"].to(torch.float32)
    if packing is not None and packing.eod_mask_loss:
        # Megatron's --eod-mask-loss zeroes loss_mask where its *input* token (text[:-1]) is EOD:
        # there its target is the next document's first token. Here position i reads and
        # predicts labels[i] itself, so the rule applied to the sequence the model reads is
        # "labels[i] is EOD" (`Packing.loss_mask`, as in the plugin's trainer). Positions Megatron
        # masked only for the shifted rule get their mask back, unless the sample is masked whole.
        kept = (supervised.sum(dim=1, keepdim=True) > 0).to(supervised.dtype)
        shifted_only = (batch["tokens"] == packing.eod_token_id) & (clean != packing.eod_token_id)
        supervised = torch.where(shifted_only, kept.expand_as(supervised), supervised)
    from megatron_csbp.model.bdlm import supervised_mask

    return clean, supervised_mask(clean, supervised, packing, mask_token_id, target_shift)


def batch_on_every_stage(data_iterator):
    """`tokens`, `labels` and `loss_mask` of Megatron-LM's GPT batch on every rank of the TP group and
    every pipeline stage: TP rank 0 of each stage reads its own iterator (`pretrain_bdlm` builds the
    datasets on every stage) and broadcasts them over TP (megatron-core's `broadcast_data`).
    Megatron-LM's `get_batch_on_this_tp_rank` gives the first stage `tokens` and the last `labels` /
    `loss_mask`, while every stage of a BDLM needs the clean sequence (`labels`) and `loss_mask` (noise,
    rows and targets are rebuilt from them on each stage); it also changed between the tags
    (core_v0.16.1: `megatron.training.utils`, from the iterator; core_v0.19.0: megatron-core's
    `utils.get_batch_on_this_tp_rank(batch, has_cu_seqlens, ...)`), so the plugin reads the batch itself."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    data = next(data_iterator) if mpu.get_tensor_model_parallel_rank() == 0 else None
    batch = tensor_parallel.broadcast_data(["tokens", "labels"], data, torch.int64)
    batch.update(tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32))
    return batch


def forward_step(data_iterator, model):
    """Megatron-LM forward step: whole samples on every rank of the shard group (and every pipeline
    stage; a stage before the last returns its hidden states, megatron_csbp/parallel/pipeline.py)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args

    args = get_args()
    batch = batch_on_every_stage(data_iterator)  # no get_batch_on_this_cp_rank: the layout places rows
    inner = unwrap_model(model)  # the TrainableBDLM inside DDP and Float16Module
    tokens, loss_mask = bdlm_batch(batch, inner.bdlm.objective.mask_token_id, inner.bdlm.packing,
                                   inner.bdlm.objective.target_shift)
    sample_index = _COUNTER.indices(args, tokens.shape[0], training=model.training,
                                    chunk=inner.gpt.vp_stage or 0)
    # Sum of w * CE over this rank's own targets (denominator 1); Megatron divides the gradients by
    # the token count summed over DP x CP x BP: count each sample's supervised tokens once.
    share = inner.bdlm.objective.denominator(loss_mask)
    if mpu.get_context_parallel_rank() != 0:
        share = torch.zeros_like(share)
    # through the wrappers (Float16Module casts, DDP's hooks): the chunk's forward is its training_loss,
    # or stage_output on a pipeline stage before the last (model/contract.ModelChunk)
    out = model(tokens, loss_mask, sample_index, torch.ones((), device=tokens.device))
    if not inner.last_stage:
        return out, None
    return out.loss, partial(loss_func, out, share.to(tokens.device))


def use_prebuilt_dataset_helpers() -> bool:
    """Megatron-LM's `initialize_megatron` runs `make` in megatron/core/datasets to build the C++
    index helpers. The megatron-core wheel ships them prebuilt (`helpers_cpp`) and has no Makefile,
    so with Megatron-LM's training package on top of the wheel that `make` fails. When the prebuilt
    module imports, compiling is skipped; a source checkout of megatron/core is left as it was."""
    from megatron.core.datasets import utils as dataset_utils

    here = os.path.dirname(os.path.abspath(dataset_utils.__file__))
    if os.path.exists(os.path.join(here, "Makefile")) or importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return False
    dataset_utils.compile_helpers = lambda: None
    return True


def install() -> None:
    """Everything a Megatron-LM script needs before `pretrain()` (after importing megatron.training):
    the fixes for missing TE/apex (every device), the CPU shim (a no-op with CUDA), the initialisation and validation hooks, and the wheel's
    prebuilt dataset helpers."""
    from megatron_csbp.compat.libraries import install_library_fixes
    from megatron_csbp.compat.megatron_lm import install_megatron_lm_cpu_compat

    install_library_fixes()  # every device: torch norms under SP, MoE and torch Adam without TE/apex
    install_megatron_lm_cpu_compat()
    install_initialize_hook()
    install_validation_hook()
    install_schedule_hook()
    install_checkpoint_hook()
    use_prebuilt_dataset_helpers()


def install_schedule_hook() -> None:
    """Megatron-LM's `train_step` calls the schedule with `seq_length=args.seq_length` (the L tokens
    of a sample) and `decoder_seq_length=args.decoder_seq_length`, which `model_provider` sets under
    PP to this rank's rows x CP (`pipeline.p2p_seq_length`). megatron-core's interleaved 1F1B sizes
    its P2P tensors from `seq_length` alone, so with virtual stages the two stages would exchange
    tensors of L rows instead of this rank's rows. The schedule therefore gets the rows as
    `seq_length` whenever `decoder_seq_length` is set (a no-op without PP, where it is None)."""
    from megatron.training import training

    def hook(original):
        def get_forward_backward_func(*args, **kwargs):
            schedule = original(*args, **kwargs)

            def rows_schedule(*a, **kw):
                if kw.get("decoder_seq_length"):
                    kw["seq_length"] = kw["decoder_seq_length"]
                return schedule(*a, **kw)

            return rows_schedule
        return get_forward_backward_func

    replace_once(training, "get_forward_backward_func", hook)


def install_checkpoint_hook() -> None:
    """A LoRA run's checkpoints under pretrain() are the trainer's (docs/lora.md#checkpoints): Megatron-LM's
    `load_checkpoint` first checks --load's LoRA record against the flags and the base
    (`lora.checkpoint.check_resume`), loads the frozen base of --pretrained-checkpoint (weights only),
    then --load's adapters and their optimizer state if it holds a checkpoint (Megatron-LM would
    instead read --pretrained-checkpoint as a full model when --load is empty); `save_checkpoint`
    writes the LoRA record (`files.LORA_FILE`) beside the adapters (`_AdapterState`) once they are
    written and before Megatron-LM's tracker names the iteration, so a run stopped in between resumes
    from the previous checkpoint, never from adapters without their record."""
    from megatron.training import get_args, training

    from megatron_csbp.checkpoint import files, state
    from megatron_csbp.lora.checkpoint import base_record, check_resume, record_json

    held = {}

    def loading(load):
        def load_checkpoint(ddp_model, optimizer, scheduler, *args, **kwargs):
            a = get_args()
            lora = LoRAConfig.of(a)
            if lora is None:
                return load(ddp_model, optimizer, scheduler, *args, **kwargs)
            from megatron.core.utils import unwrap_model
            from megatron_csbp.parallel.pipeline import ModelChunks

            held["base"] = base_record(a.pretrained_checkpoint) if a.pretrained_checkpoint else None
            step = files.checkpoint_to_load(a.load, getattr(a, "ckpt_step", None))
            if step is not None:
                check_resume(a.load, step, lora, held["base"])  # before a base is read
            if held["base"] is not None:
                gpts = ModelChunks([chunk.gpt for chunk in unwrap_model(ddp_model)])
                state.load_checkpoint(a.pretrained_checkpoint, gpts, None, None, keep=lambda k: not is_adapter(k))
                if a.rank == 0:
                    print(f"> block diffusion: loaded the frozen base of the adapters from --pretrained-checkpoint "
                          f"{a.pretrained_checkpoint}", flush=True)
            if step is None:  # the adapters of --seed, iteration 0
                return 0, 0
            return load(ddp_model, optimizer, scheduler, *args, **kwargs)
        return load_checkpoint

    def saving(save):
        def save_checkpoint(iteration, *args, **kwargs):
            a = get_args()
            lora = LoRAConfig.of(a)
            if lora is None or a.rank != 0:
                return save(iteration, *args, **kwargs)
            from megatron.core import dist_checkpointing

            record, dist_save = record_json(lora, held.get("base")), dist_checkpointing.save

            def save_then_record(state_dict, checkpoint_dir, *rest, **options):
                """The record beside the adapters before Megatron-LM's tracker names this iteration (torch_dist)."""
                request = dist_save(state_dict, checkpoint_dir, *rest, **options)
                Path(checkpoint_dir, files.LORA_FILE).write_text(record)
                return request

            with swapped(dist_checkpointing, "save", save_then_record):
                out = save(iteration, *args, **kwargs)
            folder = files.checkpoint_path(a.save or "", iteration)
            if os.path.isdir(folder) and not os.path.exists(os.path.join(folder, files.LORA_FILE)):  # another format
                Path(folder, files.LORA_FILE).write_text(record)
            return out
        return save_checkpoint

    replace_once(training, "load_checkpoint", loading)
    replace_once(training, "save_checkpoint", saving)


def _dataset_on_every_stage(vp_stage=None, is_packed_sequence=False) -> bool:
    """pretrain_gpt.is_dataset_built_on_rank for a BDLM: TP rank 0 of every stage (core_v0.19.0 also
    passes is_packed_sequence, for SFT; core_v0.16.1 does not)."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank() == 0


def _run_pretrain(pretrain, datasets_provider, model_type) -> None:
    """Megatron-LM's `pretrain()` with the plugin's providers, in the tag's calling convention:
    core_v0.16.1 `pretrain(datasets, model_provider, model_type, forward_step, extra_args_provider=,
    args_defaults=)` parses the arguments itself; core_v0.19.0 `pretrain(cfg_container, datasets,
    model_type, forward_step, model_provider=)` takes them parsed (`parse_and_validate_args`) and
    gathered into a `PretrainConfigContainer` (pretrain_gpt.py's `__main__`)."""
    import inspect

    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    if next(iter(inspect.signature(pretrain).parameters)) != "cfg_container":
        pretrain(datasets_provider, model_provider, model_type, forward_step,
                 extra_args_provider=extra_args_provider, args_defaults=defaults)
        return
    import warnings

    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=defaults)
    with warnings.catch_warnings():  # "It is recommended to use a ModelConfig ...": the plugin's model
        warnings.filterwarnings("ignore", message=r"\s*It is recommended to use a ModelConfig")  # is a provider
        config = pretrain_cfg_container_from_args(args)
    pretrain(config, datasets_provider, model_type, forward_step, model_provider=model_provider)


def pretrain_bdlm(argv: Optional[Sequence[str]] = None) -> None:
    """Run Megatron-LM's `pretrain()` as a BDLM trainer (Megatron-LM must be importable). A flag the
    plugin refuses (`validate_megatron_args`, `resolve_mask_token_id`) ends the run with one line,
    before Megatron-LM's argument dump where it can (`megatron_csbp.utils.cli`)."""
    import sys

    from megatron_csbp.utils import cli

    cli.filter_warnings()  # hide the library warnings a user cannot act on
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    import pretrain_gpt  # Megatron-LM's script: its dataset provider

    sys.argv = [sys.argv[0]] + rewrite_argv(sys.argv[1:] if argv is None else argv)
    install()
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    # every pipeline stage reads the samples (Megatron-LM: the first and last only)
    pretrain_gpt.is_dataset_built_on_rank = _dataset_on_every_stage
    try:
        _run_pretrain(pretrain, pretrain_gpt.train_valid_test_datasets_provider, ModelType.encoder_or_decoder)
    except (MegatronLMFlagError, CheckpointError) as e:
        if os.environ.get("MEGATRON_CSBP_TRACEBACK"):
            raise
        cli.fail(str(e), e.exit_code)
