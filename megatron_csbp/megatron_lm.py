"""Megatron-LM integration without forking it (checked against Megatron-LM tag core_v0.16.1,
commit 55ac7082517c3878ae653c07c09c534b8aed49f6; see docs/training.md).

Megatron-LM's `pretrain()` takes an `extra_args_provider`, a model provider and a forward step, and
calls `mpu.initialize_model_parallel` by attribute lookup. That is all the plugin needs:

- `extra_args_provider(parser)`: our flags (`--block-parallel-size`, `--block-size`, `--objective`,
  `--mask-token-id`, `--clean-attention`, `--noise-eps-min/max`, `--loss-weighting`,
  `--attention-transport`, `--block-ownership`, `--attention-kernel`, `--log-json`), plus
  `--bdlm-context-parallel-size` (set by `rewrite_argv`).
- `rewrite_argv(argv)`: block parallelism lives inside Megatron's CP axis, so Megatron must see
  `--context-parallel-size max(CP, BP)` (its batch, sampler, DDP and checkpoint arithmetic then
  treat the whole sequence group like CP ranks). The user's CP (the clean ring size) travels as
  `--bdlm-context-parallel-size`. It also adds `--calculate-per-token-loss` (our losses are sums
  over each rank's own targets; Megatron divides by the token count summed over DP x CP x BP).
- `install_initialize_hook()`: wraps `megatron.core.parallel_state.initialize_model_parallel` so
  Megatron-LM's own initialisation also builds the plugin's clean-ring/replica groups.
- `model_provider(...)`: Megatron's GPTModel from Megatron-LM's args, any layer spec with the
  core attention swapped, wrapped as a block diffusion model.
- `forward_step(data_iterator, model)`: Megatron-LM's batch (NOT sliced by CP rank: every rank of
  the sequence group needs the whole sample), noise keyed by the global sample index.

`examples/megatron_lm/pretrain_bdlm.py` puts these together with `pretrain_gpt.py`'s dataset
provider. Nothing needs patching in core_v0.16.1 (so `patches/` stays empty for it).
"""
from __future__ import annotations

import argparse
from functools import partial
from typing import List, Optional, Sequence

import torch

from megatron_csbp.training.arguments import add_block_diffusion_args


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_block_diffusion_args(parser)
    parser.add_argument("--bdlm-context-parallel-size", type=int, default=None,
                        help="(set by megatron_csbp.megatron_lm.rewrite_argv) the clean-ring size; Megatron's "
                             "--context-parallel-size holds max(CP, BP)")
    return parser


def _flag_value(argv: List[str], name: str, default: int) -> int:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith(name + "="):
            return int(a.split("=", 1)[1])
    return default


def _set_flag(argv: List[str], name: str, value) -> List[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out + [name, str(value)]


def rewrite_argv(argv: Sequence[str]) -> List[str]:
    """Megatron-LM argv with CP = max(CP, BP), the true CP recorded, per-token loss on."""
    argv = list(argv)
    cp = _flag_value(argv, "--context-parallel-size", 1)
    bp = _flag_value(argv, "--block-parallel-size", 1)
    if bp > 1 and bp % cp:
        raise SystemExit(f"--block-parallel-size {bp} must be a multiple of --context-parallel-size {cp}")
    if "--bdlm-context-parallel-size" not in " ".join(argv):
        argv = _set_flag(argv, "--bdlm-context-parallel-size", cp)
        argv = _set_flag(argv, "--context-parallel-size", max(cp, bp))
    if "--calculate-per-token-loss" not in argv:
        argv.append("--calculate-per-token-loss")
    return argv


def _true_cp(args) -> int:
    return args.bdlm_context_parallel_size or args.context_parallel_size


def install_initialize_hook() -> None:
    """After this, Megatron-LM's `mpu.initialize_model_parallel(...)` also builds the plugin groups."""
    from megatron.core import parallel_state as mpu

    if getattr(mpu.initialize_model_parallel, "__bdlm_hook__", False):
        return
    original = mpu.initialize_model_parallel

    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, *args, **kwargs):
        from megatron.training import get_args
        from megatron_csbp import parallel_state as bps

        a = get_args()
        seq = kwargs.pop("context_parallel_size", 1)
        ep = kwargs.pop("expert_model_parallel_size", 1)
        cp, bp = _true_cp(a), a.block_parallel_size
        if max(cp, bp) != seq:
            raise ValueError(f"Megatron's --context-parallel-size is {seq}, expected max(CP {cp}, BP {bp}); launch "
                             "through megatron_csbp.megatron_lm.rewrite_argv (examples/megatron_lm/pretrain_bdlm.py)")
        mpu.initialize_model_parallel = original  # initialize_block_parallel calls Megatron's own
        try:
            bps.initialize_block_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, cp, bp, ep,
                                          virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                                          **kwargs)
        finally:
            mpu.initialize_model_parallel = initialize_model_parallel

    initialize_model_parallel.__bdlm_hook__ = True
    mpu.initialize_model_parallel = initialize_model_parallel


def _model_args_from_megatron(args):
    from megatron_csbp.training.model import ModelArgs

    return ModelArgs(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        seq_length=args.seq_length, vocab_size=args.padded_vocab_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=_true_cp(args), block_parallel_size=args.block_parallel_size,
        block_size=args.block_size, objective=args.objective, mask_token_id=args.mask_token_id,
        clean_attention=args.clean_attention or "block_causal", noise_eps_min=args.noise_eps_min, noise_eps_max=args.noise_eps_max,
        loss_weighting=args.loss_weighting, attention_transport=args.attention_transport,
        block_ownership=args.block_ownership, seed=args.seed, attention_kernel=args.attention_kernel)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None):
    """Megatron-LM model provider: GPTModel (Megatron-LM's config and spec choice) as a BDLM."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_csbp import parallel_state as bps
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.model.spec import with_block_diffusion_attention
    from megatron_csbp.training.model import TrainableBDLM, build_layout, build_objective

    args = get_args()
    if not (pre_process and post_process):
        raise ValueError("block diffusion does not support pipeline parallelism (--pipeline-model-parallel-size 1)")
    config = config or core_transformer_config_from_args(args)
    if not config.calculate_per_token_loss:
        raise ValueError("block diffusion needs --calculate-per-token-loss (rewrite_argv adds it)")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                          args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        normalization=args.normalization)
    spec = with_block_diffusion_attention(spec, kernel=args.attention_kernel)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                   max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                   fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                   rotary_base=args.rotary_base)
    margs = _model_args_from_megatron(args)
    if margs.objective == "diffusiongemma-sft":
        raise ValueError("--objective diffusiongemma-sft runs in python -m megatron_csbp.train (DiffusionGemma is "
                         "built from a converted checkpoint, not from Megatron-LM flags)")
    if margs.mask_token_id is None and margs.objective == "bd3lm":
        raise ValueError("--objective bd3lm needs --mask-token-id with Megatron-LM tokenizers")
    bdlm = BlockDiffusionModel(gpt, build_objective(margs), build_layout(margs), bps.get_block_parallel_rank(),
                               bps.get_clean_ring_group(), margs.attention_transport)
    return TrainableBDLM(config, bdlm)


class _SampleCounter:
    """Global sample indices from Megatron-LM's consumed-sample counter (its sampler's arithmetic)."""

    def __init__(self):
        self.consumed, self.micro = None, 0

    def indices(self, args, micro_batch_size: int):
        from megatron.core import parallel_state as mpu

        if self.consumed != args.consumed_train_samples:
            self.consumed, self.micro = args.consumed_train_samples, 0
        dp, r = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        start = self.consumed + self.micro * micro_batch_size * dp + r * micro_batch_size
        self.micro += 1
        return torch.arange(start, start + micro_batch_size)


_COUNTER = _SampleCounter()


def loss_func(out, denominator_share, output_tensor):
    report = torch.stack([out.weighted_sum.float(), denominator_share.float()])
    return output_tensor, denominator_share.to(torch.int), {"lm loss": report}


def forward_step(data_iterator, model):
    """Megatron-LM forward step: whole samples on every rank of the sequence group."""
    from megatron.core import parallel_state as mpu
    from megatron.training import get_args
    from megatron.training.utils import get_batch_on_this_tp_rank

    args = get_args()
    if torch.cuda.is_available():
        batch = get_batch_on_this_tp_rank(data_iterator)  # no get_batch_on_this_cp_rank: the layout places rows
    else:  # CPU checks (its TP broadcast moves batches with .cuda()); TP = 1 there
        batch = next(data_iterator)
    tokens = batch["tokens"]
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    sample_index = _COUNTER.indices(args, tokens.shape[0])
    # Sum of w * CE over this rank's own targets (denominator 1); Megatron divides the gradients by
    # the token count summed over DP x CP x BP: count each sample's supervised tokens once.
    from megatron_csbp.training.model import TrainableBDLM
    inner = model
    while not isinstance(inner, TrainableBDLM):
        inner = inner.module
    share = inner.bdlm.objective.denominator(loss_mask)
    if mpu.get_context_parallel_rank() != 0:
        share = torch.zeros_like(share)
    out = model(tokens, loss_mask, sample_index, torch.ones((), device=tokens.device))
    return out.loss, partial(loss_func, out, share.to(tokens.device))


def use_prebuilt_dataset_helpers() -> bool:
    """Megatron-LM's `initialize_megatron` runs `make` in megatron/core/datasets to build the C++
    index helpers. The megatron-core wheel ships them prebuilt (`helpers_cpp`) and has no Makefile,
    so with Megatron-LM's training package on top of the wheel that `make` fails. When the prebuilt
    module imports, compiling is skipped; a source checkout of megatron/core is left as it was."""
    import importlib.util
    import os

    from megatron.core.datasets import utils as dataset_utils

    here = os.path.dirname(os.path.abspath(dataset_utils.__file__))
    if os.path.exists(os.path.join(here, "Makefile")) or importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return False
    dataset_utils.compile_helpers = lambda: None
    return True


def pretrain_bdlm(argv: Optional[Sequence[str]] = None) -> None:
    """Run Megatron-LM's `pretrain()` as a BDLM trainer (Megatron-LM must be importable)."""
    import sys

    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    import pretrain_gpt  # Megatron-LM's script: its dataset provider

    sys.argv = [sys.argv[0]] + rewrite_argv(sys.argv[1:] if argv is None else argv)
    from megatron_csbp.compat.megatron_lm import install_megatron_lm_cpu_compat
    install_megatron_lm_cpu_compat()
    install_initialize_hook()
    use_prebuilt_dataset_helpers()
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, extra_args_provider=extra_args_provider,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
