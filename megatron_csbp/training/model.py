"""Model construction for training: Megatron `GPTModel` (local layer spec with block-diffusion core
attention) wrapped as a `BlockDiffusionModel`, ready for Megatron's DDP.

Initial weights do not depend on the layout (CPU initialisation, MoE redrawn by global name); with
`model_shape` the checkpoint's family builds it. Why: docs/training.md ("Layout-independent results").
"""
from __future__ import annotations

from dataclasses import make_dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry
from megatron_csbp.layout.packing import Packing
from megatron_csbp.layout.sizes import shard_group_size
from megatron_csbp.model import builder
from megatron_csbp.model.builder import padded_vocab_size  # noqa: F401  (re-exported)
from megatron_csbp.model.bdlm import BlockDiffusionModel
from megatron_csbp import objectives
from megatron_csbp.parallel import pipeline
from megatron_csbp.config.options import config_fields, gpt_kwargs, section_fields


#: The typed model config: the options declared for "model" (config/options.py), then what the
#: flags derive or other owners declare (objectives, pipeline). Defaults: the flags', except a
#: smaller model for direct construction (tests, tools).
ModelArgs = make_dataclass("ModelArgs", [
    *[(n, t, d) for n, t, d in section_fields("model")
      if n not in ("num_layers", "hidden_size", "seq_length", "vocab_size", "clean_attention")],
    ("num_layers", int, 2), ("hidden_size", int, 64), ("seq_length", int, 64), ("vocab_size", int, 128),
    ("clean_attention", str, "block_causal"), ("mask_token_id", Optional[int], None),
    ("noise_eps_min", float, 1e-3), ("noise_eps_max", float, 1.0), ("loss_weighting", str, "inverse_t"),
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


def attention_backend(a):
    from megatron.core.transformer.enums import AttnBackend
    return AttnBackend[a.attention_backend]


def params_dtype(a) -> torch.dtype:
    return torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32


def run_options(a) -> dict:
    """The config fields this run's flags set on every model, flag-built or converted: parallel
    layout (CP size = the shard group), dropout, attention backend, per-token loss, recompute."""
    return dict(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        context_parallel_size=shard_group_size(a.context_parallel_size, a.block_parallel_size),
        sequence_parallel=a.sequence_parallel,
        hidden_dropout=a.hidden_dropout,
        attention_dropout=a.attention_dropout,
        attention_backend=attention_backend(a),
        pipeline_dtype=params_dtype(a),
        # The loss is already divided by the global denominator: gradients are SUMMED over
        # DP x CP x BP (Megatron DDP with per-token loss does not average).
        calculate_per_token_loss=True,
        **recompute_options(a),
        **pipeline.config_fields(a),
    )


def transformer_config(a, finalize_model_grads_func=None) -> TransformerConfig:
    """The config of the flag-built model (weights drawn on CPU from --seed)."""
    cfg = builder.transformer_config(
        **builder.dimensions(a),
        **run_options(a),
        use_cpu_initialization=True,
        perform_initialization=True,
        **config_fields(a),  # the declared fields (normalization, epsilon, biases, no fusion, ...)
        activation_func=F.silu if a.swiglu else F.gelu,
        params_dtype=params_dtype(a),
        **config_fields(a, moe=True),
    )
    if finalize_model_grads_func is not None:
        cfg.finalize_model_grads_func = finalize_model_grads_func
    return cfg


def build_objective(a):
    """The objective `a.objective` names, from the objective registry (megatron_csbp/objectives/);
    its mask token checked against the embedding's rows (`builder.embedding_rows`)."""
    return objectives.build_objective(a, builder.embedding_rows(a))


def build_converted_gpt(a, finalize_model_grads_func=None, pre_process: bool = True, post_process: bool = True,
                        vp_stage: Optional[int] = None):
    """`GPTModel` of a converted checkpoint's shape under this run's parallel layout (weights
    uninitialised: they are loaded next)."""
    shape = a.model_shape
    if shape.vocab_size % a.tensor_model_parallel_size:
        raise ValueError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size} must divide the checkpoint's "
                         f"vocabulary {shape.vocab_size}")
    config = builder.shape_transformer_config(shape, params_dtype=params_dtype(a), **run_options(a),
                                              expert_model_parallel_size=a.expert_model_parallel_size)
    if finalize_model_grads_func is not None:
        config.finalize_model_grads_func = finalize_model_grads_func
    # Megatron's RNG tracker must hold its model-parallel state: the embedding forks it under
    # --sequence-parallel (the weights themselves are loaded next).
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    return config, builder.build_gpt_model(shape, config=config, kernel=a.attention_kernel,
                                           stage=pipeline.Stage(pre_process, post_process, vp_stage))


def build_layout(a) -> SequenceLayout:
    geometry = BlockGeometry(a.seq_length, a.block_size, a.clean_attention)
    return SequenceLayout(geometry, a.context_parallel_size, a.block_parallel_size, a.block_ownership)


class TrainableBDLM(MegatronModule):
    """A `BlockDiffusionModel` as a MegatronModule for DDP and the trainer's `model.contract.ModelChunk`;
    checkpoints are plain GPT state (the same keys as Megatron-LM's GPT checkpoints: core attention
    has no parameters)."""

    def __init__(self, config: TransformerConfig, bdlm: BlockDiffusionModel):
        super().__init__(config=config)
        self.bdlm = bdlm
        self.model_type = bdlm.gpt.model_type
        for mode in ("supervised", "training_loss", "stage_output", "first_pass", "evaluation_loss", "eval_record"):
            setattr(self, mode, getattr(bdlm, mode))

    objective = property(lambda self: self.bdlm.objective)
    last_stage = property(lambda self: self.bdlm.last_stage)
    plan = property(lambda self: self.bdlm.plan)

    @property
    def gpt(self) -> GPTModel:
        return self.bdlm.gpt

    @property
    def module(self) -> GPTModel:
        """The wrapped GPTModel, as DDP/Float16Module expose theirs: Megatron's
        `get_attr_wrapped_model` (e.g. Megatron-LM's `train()` asking for `pg_collection`) walks
        `.module` until it finds the attribute. A property, so no second state-dict entry."""
        return self.bdlm.gpt

    def forward(self, tokens, loss_mask=None, sample_index=None, denominator=None, document_ids=None,
                self_conditioning=None):
        """What megatron-core's schedules call (`BlockDiffusionModel.forward`)."""
        return self.bdlm(tokens, loss_mask, sample_index, denominator, document_ids, self_conditioning)

    def set_input_tensor(self, input_tensor):
        self.bdlm.gpt.set_input_tensor(input_tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return self.bdlm.gpt.sharded_state_dict(prefix, sharded_offsets, metadata)


def build_model_chunks(a, device: Optional[torch.device] = None, finalize_model_grads_func=None) -> list:
    """This rank's model chunks, one `TrainableBDLM` per virtual pipeline stage (one chunk without
    interleaving; the whole model without pipeline parallelism); an objective's own model when it
    names one (`Objective.model_builder`, e.g. the DFlash drafter)."""
    builder_name = objectives.objective_class(a.objective).model_builder
    if builder_name is not None:
        import importlib

        module, fn = builder_name.split(":")
        return getattr(importlib.import_module(module), fn)(a, device, finalize_model_grads_func)
    return pipeline.build_chunks(lambda pre, post, vp: build_model(a, device, finalize_model_grads_func, pre, post, vp))


def build_model(a, device: Optional[torch.device] = None, finalize_model_grads_func=None,
                pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None) -> TrainableBDLM:
    """Build on CPU with a fixed seed (layout-independent weights), then move to `device`.
    `pre_process` / `post_process` / `vp_stage`: the pipeline chunk (megatron_csbp/parallel/pipeline.py)."""
    objective = build_objective(a)
    layout = build_layout(a)
    if a.model_shape is not None:
        config, gpt = build_converted_gpt(a, finalize_model_grads_func, pre_process, post_process, vp_stage)
        return _wrap(a, config, gpt, objective, layout, device)
    config = transformer_config(a, finalize_model_grads_func)
    vocab = builder.embedding_rows(a)
    if a.num_experts and isinstance(a.moe_layer_freq, list) and not all(a.moe_layer_freq):
        # dense and MoE layers mixed: Megatron's decoder block spec reads the pattern from the config
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        # (cut to this chunk's layers: the pattern entries of the layers it holds, by global index)
        spec = builder.with_block_diffusion(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                                       normalization=a.normalization,
                                                                       vp_stage=vp_stage),
                                            a.attention_kernel)
    else:
        spec = builder.local_layer_spec(kernel=a.attention_kernel, normalization=a.normalization,
                                        qk_layernorm=a.qk_layernorm, num_experts=a.num_experts,
                                        moe_grouped_gemm=a.moe_grouped_gemm)
    # Same draws on every rank and layout: seed the CPU generator (and Megatron's tracker).
    torch.manual_seed(a.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    torch.manual_seed(a.seed)
    # A pipeline chunk after the start first replays one rank's draws before its first layer (a
    # flag-built MoE instead draws every weight again by its global name below).
    offset = pipeline.first_layer(config, vp_stage)
    if (offset or not pre_process) and not a.num_experts:
        pipeline.replay_earlier_draws(config, spec, vocab, a.seq_length, offset, with_embedding=not pre_process,
                                      position_embedding_type=a.position_embedding_type)
    gpt = builder.gpt_model(
        config,
        spec,
        vocab_size=vocab,
        max_sequence_length=a.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
        vp_stage=vp_stage,
        **gpt_kwargs(a),  # rotary
    )
    if a.num_experts:
        redraw_weights_by_global_name(gpt, config, a.seed)
    return _wrap(a, config, gpt, objective, layout, device)


def redraw_weights_by_global_name(gpt, config, seed: int) -> int:
    """Layout-independent initial weights of a flag-built MoE. Megatron draws each rank's local
    experts from the one CPU generator, so under expert parallelism a rank draws fewer experts and
    every weight built after the first MoE layer comes from another point of the stream. Here every
    randomly initialised weight (linear layers, embeddings, routers) is drawn again, in full, from a
    generator seeded by (--seed, its name with the *global* expert index), with Megatron's init
    method for it, and this rank's tensor-parallel slice is taken as Megatron's CPU initialisation
    takes it (stride-aware). Under pipeline parallelism the name carries the *global* layer index
    (a chunk's `decoder.layers.i` is layer offset + i) and the last stage's copy of tied embeddings
    is drawn as `embedding.word_embeddings` (the first stage's weight, same init method), so
    every chunk holds one rank's weights. Returns the number of weights drawn. Size: one full weight
    at a time."""
    import zlib

    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.moe.router import Router

    n_local = config.num_moe_experts // mpu.get_expert_model_parallel_world_size()
    first_expert = mpu.get_expert_model_parallel_rank() * n_local
    layer_offset = pipeline.first_layer(config, getattr(gpt, "vp_stage", None))
    drawn = 0
    for name, module in gpt.named_modules():
        if isinstance(module, RowParallelLinear):
            init = config.output_layer_init_method
        elif isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding, Router)):
            init = config.init_method
        else:
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:  # this chunk's layer i -> global layer offset + i
            parts[2] = str(layer_offset + int(parts[2]))
        if getattr(weight, "shared_embedding", False) and parts == ["output_layer"]:
            parts = ["embedding", "word_embeddings"]  # the tied copy: the embedding's draw
        expert = "local_experts" in parts
        if expert:  # local expert i of this EP rank -> global expert first_expert + i
            k = parts.index("local_experts") + 1
            parts[k] = str(first_expert + int(parts[k]))
        if getattr(weight, "tensor_model_parallel", False):
            dim, stride = weight.partition_dim, weight.partition_stride
            rank, world = ((mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size())
                           if expert else (mpu.get_tensor_model_parallel_rank(),
                                           mpu.get_tensor_model_parallel_world_size()))
        else:
            dim, stride, rank, world = 0, 1, 0, 1
        full = list(weight.shape)
        full[dim] *= world
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(".".join(parts).encode()))
            master = torch.empty(full, dtype=torch.float32)
            init(master)
        pieces = torch.split(master, weight.shape[dim] // stride, dim=dim)
        with torch.no_grad():
            weight.copy_(torch.cat(pieces[rank::world], dim=dim).to(weight.dtype))
        drawn += 1
    return drawn


def _wrap(a, config, gpt, objective, layout, device) -> TrainableBDLM:
    from megatron_csbp.parallel import state as bps

    if device is not None:
        gpt = gpt.to(device)
    shard_rank = bps.get_shard_rank() if bps.is_initialized() else 0
    ring = bps.get_clean_ring_group() if bps.is_initialized() else None
    from megatron_csbp.model.bdlm import wrapper_class

    cls = wrapper_class(objective)
    bdlm = cls(gpt, objective, layout, shard_rank=shard_rank, ring_group=ring, transport=a.attention_transport,
               packing=Packing.of(a))
    return TrainableBDLM(config, bdlm)
