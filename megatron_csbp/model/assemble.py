"""Model assembly, the one way from flags (or a checkpoint's shape) to a model: the block-diffusion
`GPTModel` of a pipeline chunk with layout-independent initial weights, wrapped as its objective's
`BlockDiffusionModel`; the DFlash drafter's chunk. Used by the trainer (`training/model.py`,
`training/drafter.py`), Megatron-LM's `model_provider` and `checkpoint/` (docs/training.md,
"Layout-independent results").
"""
from __future__ import annotations

from dataclasses import make_dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu, tensor_parallel
from megatron.core.transformer.enums import AttnBackend

from megatron_csbp import objectives
from megatron_csbp.config.options import config_fields, gpt_kwargs, moe_layer_pattern, section_fields
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry
from megatron_csbp.layout.packing import Packing
from megatron_csbp.layout.sizes import shard_group_size
from megatron_csbp.lora import LoRAConfig
from megatron_csbp.lora.spec import adapted
from megatron_csbp.model import builder
from megatron_csbp.model.bdlm import wrapper_class
from megatron_csbp.model.diffusiongemma import sft  # noqa: F401  (registers DiffusionGemma SFT's model wrapper)
from megatron_csbp.objectives.flags import NOISE_EPS_MAX, NOISE_EPS_MIN
from megatron_csbp.parallel import pipeline, state as bps
from megatron_csbp.parallel.global_draw import GlobalNames, drawn_slice, tensor_parallel_rank, tensor_parallel_slice
from megatron_csbp.parallel.pipeline import WHOLE, Stage


#: The typed model config: the options declared for "model" (config/options.py), then what the
#: flags derive or other owners declare (objectives, pipeline). Defaults: the flags', except a
#: smaller model for direct construction (tests, tools).
ModelArgs = make_dataclass("ModelArgs", [
    *[(n, t, d) for n, t, d in section_fields("model")
      if n not in ("num_layers", "hidden_size", "seq_length", "vocab_size", "clean_attention")],
    ("num_layers", int, 2), ("hidden_size", int, 64), ("seq_length", int, 64), ("vocab_size", int, 128),
    ("clean_attention", str, "block_causal"), ("mask_token_id", Optional[int], None),
    ("noise_eps_min", float, NOISE_EPS_MIN.default), ("noise_eps_max", float, NOISE_EPS_MAX.default), ("loss_weighting", str, "inverse_t"),
    ("virtual_pipeline_model_parallel_size", Optional[int], None), ("encoder_loss_weight", float, 1.0),
    ("self_conditioning_prob", float, 0.5), ("eod_token_id", Optional[int], None),
    ("pad_token_id", Optional[int], None),
    ("model_shape", Any, None),  # a converted checkpoint's ModelShape (None: built from the flags)
], namespace={"__module__": __name__})


def recompute_options(a) -> dict:
    """Megatron's recompute fields from the flags (full granularity: uniform, 1 layer by default)."""
    full = a.recompute_granularity == "full"
    return dict(recompute_granularity=a.recompute_granularity,
                recompute_method=(a.recompute_method or "uniform") if full else None,
                recompute_num_layers=(1 if a.recompute_num_layers is None else a.recompute_num_layers) if full else None)


def params_dtype(a) -> torch.dtype:
    return torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32


def run_options(a) -> dict:
    """The config fields this run's flags set on every model, flag-built or converted: parallel
    layout (CP size = the shard group), dropout, attention backend, per-token loss, recompute."""
    return dict(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        context_parallel_size=shard_group_size(a.context_parallel_size, a.block_parallel_size),
        sequence_parallel=a.sequence_parallel, hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
        attention_backend=AttnBackend[a.attention_backend], pipeline_dtype=params_dtype(a),
        # The loss is already divided by the global denominator: gradients are SUMMED over
        # DP x CP x BP (Megatron DDP with per-token loss does not average).
        calculate_per_token_loss=True, **recompute_options(a), **pipeline.config_fields(a),
    )


def transformer_config(a):
    """The config of the flag-built model (weights drawn on CPU from --seed)."""
    return builder.transformer_config(
        **run_options(a), use_cpu_initialization=True, perform_initialization=True,
        **config_fields(a),  # the declared fields (normalization, epsilon, biases, no fusion, ...)
        activation_func=F.silu if a.swiglu else F.gelu, params_dtype=params_dtype(a), **config_fields(a, moe=True),
    )


def build_objective(a):
    """The objective `a.objective` names, from the objective registry (megatron_csbp/objectives/);
    its mask token checked against the embedding's rows (`builder.embedding_rows`)."""
    return objectives.build_objective(a, builder.embedding_rows(a))


def build_layout(a) -> SequenceLayout:
    geometry = BlockGeometry(a.seq_length, a.block_size, a.clean_attention)
    return SequenceLayout(geometry, a.context_parallel_size, a.block_parallel_size, a.block_ownership)


def converted_gpt(a, stage: Stage = WHOLE):
    """The `GPTModel` of a converted checkpoint's shape (`a.model_shape`) under this run's
    parallel layout (weights uninitialised: they are loaded next)."""
    shape = a.model_shape
    if shape.vocab_size % a.tensor_model_parallel_size:
        raise ValueError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size} must divide the checkpoint's "
                         f"vocabulary {shape.vocab_size}")
    # Megatron's RNG tracker must hold its model-parallel state: the embedding forks it under
    # --sequence-parallel (the weights themselves are loaded next).
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    return builder.build_gpt_model(shape, kernel=a.attention_kernel, stage=stage, params_dtype=params_dtype(a),
                                   **run_options(a), expert_model_parallel_size=a.expert_model_parallel_size)


def layer_spec(a, config, vp_stage: Optional[int] = None, transformer_engine: bool = False):
    """The flag-built model's layer spec with block-diffusion core attention (`core.gpt_layer_spec`;
    `transformer_engine`: TransformerEngine's layers, under Megatron-LM's pretrain())."""
    mixed_moe = bool(a.num_experts) and not all(moe_layer_pattern(a.moe_layer_freq, a.num_layers))
    return builder.gpt_layer_spec(config, mixed_moe, kernel=a.attention_kernel, normalization=a.normalization,
                                  vp_stage=vp_stage, qk_layernorm=a.qk_layernorm, num_experts=a.num_experts,
                                  moe_grouped_gemm=a.moe_grouped_gemm, transformer_engine=transformer_engine)


def flag_built_gpt(a, config, spec, stage: Stage, vocab_size: int, max_sequence_length: int,
                   seed: Optional[int], redraw_experts: bool = True, **options):
    """The `GPTModel` chunk `stage` of the flags, drawn from `seed` (None: the generator as it is)
    with the weights of the whole model: a chunk after the start first replays one rank's draws before
    its first layer; with `redraw_experts` a MoE is instead drawn again by global name
    (`redraw_weights_by_global_name`). `options`: more GPTModel keywords."""
    if seed is not None:
        torch.manual_seed(seed)
    offset = pipeline.first_layer(config, stage.vp_stage)
    if (offset or not stage.pre_process) and not (redraw_experts and a.num_experts):
        pipeline.replay_earlier_draws(config, spec, vocab_size, max_sequence_length, offset,
                                      with_embedding=not stage.pre_process,
                                      position_embedding_type=a.position_embedding_type)
    gpt = builder.gpt_model(config, spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                            **stage.kwargs(), **options, **gpt_kwargs(a))  # rotary
    if redraw_experts and a.num_experts:
        redraw_weights_by_global_name(gpt, config, a.seed)
    return gpt


def wrap(a, gpt, objective=None, layout: Optional[SequenceLayout] = None, device=None):
    """`gpt` as the `BlockDiffusionModel` (sub)class of the objective (`model.bdlm.wrapper_class`) on
    this rank's place of the layout; `objective` / `layout` default to the flags'."""
    objective = objective or build_objective(a)
    layout = layout or build_layout(a)
    if device is not None:
        gpt = gpt.to(device)
    shard_rank = bps.get_shard_rank() if bps.is_initialized() else 0
    ring = bps.get_clean_ring_group() if bps.is_initialized() else None
    return wrapper_class(objective)(gpt, objective, layout, shard_rank=shard_rank, ring_group=ring,
                                    transport=a.attention_transport, packing=Packing.of(a))


def assemble(a, device=None, finalize_model_grads_func=None, stage: Stage = WHOLE) -> Tuple[object, object]:
    """(config, `BlockDiffusionModel`) of pipeline chunk `stage` of `a` (ModelArgs): built on CPU
    with a fixed seed (layout-independent weights), or of `a.model_shape` (a converted checkpoint's
    family, weights left to load), then moved to `device`."""
    objective, layout = build_objective(a), build_layout(a)

    def build():
        if a.model_shape is not None:
            return converted_gpt(a, stage)
        config = transformer_config(a)
        # Same draws on every rank and layout: seed the CPU generator (and Megatron's tracker).
        torch.manual_seed(a.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
        return flag_built_gpt(a, config, layer_spec(a, config, stage.vp_stage), stage, builder.embedding_rows(a),
                              a.seq_length, a.seed)

    gpt = adapted(LoRAConfig.of(a), build, a.seed)  # LoRA: adapters through the spec, base frozen
    config = gpt.config
    if finalize_model_grads_func is not None:
        config.finalize_model_grads_func = finalize_model_grads_func
    return config, wrap(a, gpt, objective, layout, device)


def assemble_drafter(a, shape, embedding, head, objective, seq_length: int, splits, device=None,
                     finalize_model_grads_func=None, weights: Optional[Callable[[], dict]] = None):
    """The DFlash drafter's chunk of this pipeline stage (`TrainableDrafter`, weights drawn from --seed,
    then `weights()` loaded when given) with the verifier's frozen `embedding` and `head`, on this rank's shard group."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_csbp.attention.dflash import DFlashLayout
    from megatron_csbp.model.dflash import DFlashDrafter, DFlashTrainingModel, TrainableDrafter, drafter_transformer_config

    dtype = params_dtype(a)
    # the losses are pre-divided by the global count of sequences: Megatron's schedule must not average
    config = drafter_transformer_config(shape, params_dtype=dtype, perform_initialization=True,
                                        init_method_std=a.init_method_std, calculate_per_token_loss=True,
                                        pipeline_dtype=dtype, bf16=a.bf16, fp16=a.fp16, **pipeline.config_fields(a),
                                        finalize_model_grads_func=finalize_model_grads_func)
    torch.manual_seed(a.seed)
    # this pipeline stage's layers (megatron-core's split: --num-layers over the stages, or
    # --decoder-first/last-pipeline-num-layers); the context projection first, the final norm last
    (pre, post), first = pipeline.stage_of(None), pipeline.first_layer(config, None)
    drafter = DFlashDrafter(shape, config, range(first, first + get_num_layers_to_build(config)), pre, post)
    if weights is not None:
        drafter.load_state_dict(weights(), strict=False)
    layout = DFlashLayout(seq_length, shape.block_size, a.context_parallel_size, a.block_parallel_size)
    shard_group = mpu.get_context_parallel_group()
    ring = bps.get_clean_ring_group() if layout.kind != "cp" else shard_group
    if device is not None:
        drafter, embedding, head = drafter.to(device), embedding.to(device), head.to(device)
    model = DFlashTrainingModel(drafter, embedding, head, objective, layout, shard_rank=mpu.get_context_parallel_rank(),
                                shard_group=shard_group, ring_group=ring, transport=a.attention_transport)
    return TrainableDrafter(config, model, splits)


def redraw_weights_by_global_name(gpt, config, seed: int) -> None:
    """Layout-independent initial weights of a flag-built MoE. Megatron draws each rank's local
    experts from the one CPU generator, so under expert parallelism a rank draws fewer experts and
    every weight built after the first MoE layer comes from another point of the stream. Here every
    randomly initialised weight (linear layers, embeddings, routers) is drawn again, in full, from a
    generator seeded by (--seed, its name with the *global* expert index), with Megatron's init
    method for it, and this rank's tensor-parallel slice is taken as Megatron's CPU initialisation
    takes it (stride-aware). Under pipeline parallelism the name carries the *global* layer index
    (a chunk's `decoder.layers.i` is layer offset + i) and the last stage's copy of tied embeddings
    is drawn as `embedding.word_embeddings` (the first stage's weight, same init method), so
    every chunk holds one rank's weights. Grouped experts (`--moe-grouped-gemm`, megatron-core's
    `GroupedMLP`) draw each expert's fc1 / fc2 as the sequential experts' `linear_fc1` /
    `linear_fc2` of the same global name, so both start from the same weights under any layout.
    Size: one full weight at a time."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.moe import experts as moe_experts
    from megatron.core.transformer.moe.router import Router

    grouped_mlp = getattr(moe_experts, "GroupedMLP", ())  # megatron-core 0.16; gone in 0.19
    names = GlobalNames(gpt)
    for name, module in gpt.named_modules():
        parts = names.parts(name)
        if isinstance(module, grouped_mlp):  # expert e's fc1 / fc2 weight, transposed, in weight1 / weight2
            w1 = module.weight1.data.view(module.num_local_experts, config.hidden_size, -1)
            w2 = module.weight2.data.view(module.num_local_experts, -1, config.hidden_size)
            split = tensor_parallel_rank(expert=True)  # GroupedMLP's weights: split over expert TP
            for e in range(module.num_local_experts):
                expert = parts + ["local_experts", str(names.first_expert + e)]
                w1[e].copy_(drawn_slice(expert + ["linear_fc1"], w1[e].t().shape, config.init_method, seed, 0,
                                        2 if config.gated_linear_unit else 1, *split).t())
                w2[e].copy_(drawn_slice(expert + ["linear_fc2"], w2[e].t().shape, config.output_layer_init_method,
                                        seed, 1, 1, *split).t())
            continue
        if isinstance(module, RowParallelLinear):
            init = config.output_layer_init_method
        elif isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding, Router)):
            init = config.init_method
        else:
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        if getattr(weight, "shared_embedding", False) and parts == ["output_layer"]:
            parts = ["embedding", "word_embeddings"]  # the tied copy: the embedding's draw
        split = tensor_parallel_slice(weight, expert="local_experts" in parts)
        with torch.no_grad():
            weight.copy_(drawn_slice(parts, weight.shape, init, seed, *split))
