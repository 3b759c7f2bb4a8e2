"""Pipeline parallelism (PP) for block diffusion: Megatron's stages over any TP x single/CP/BP/CSBP layout.

Every stage rebuilds the same noise, plan and rows from the sample index; only this rank's rows'
hidden states cross a stage (megatron-core's P2P). Stages, interleaving and PP-independent initial
weights (`build_chunks`) follow Megatron-LM's rules. Why it composes, sizes and flags:
docs/pipeline.md.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch


# ---- flags and their rules ---------------------------------------------------------------------
def check_pipeline_args(args, num_microbatches: int) -> Optional[int]:
    """Megatron-LM's pipeline rules (its `validate_args`), each refused with the flag named; returns
    the virtual pipeline size (None without interleaving: Megatron-LM's
    `args.virtual_pipeline_model_parallel_size`). Needs `num_layers` filled in."""
    P = args.pipeline_model_parallel_size
    given = {"--" + dest.replace("_", "-"): getattr(args, dest, None) for dest in (
        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
        "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")}
    first, last, per_vstage, vstages = given.values()
    if P < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {P}")
    for flag, v in given.items():
        if v is not None and P == 1:
            raise ValueError(f"{flag} needs --pipeline-model-parallel-size > 1")
        if v is not None and v <= 0:
            raise ValueError(f"{flag} must be positive, got {v}")
    if P == 1:
        return None
    L = args.num_layers
    if per_vstage is not None and vstages is not None:
        raise ValueError("give --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank, "
                         "not both")
    uneven = first is not None or last is not None
    if per_vstage is not None:
        if uneven:
            raise ValueError("with --decoder-first/last-pipeline-num-layers give the virtual stages as "
                             "--num-virtual-stages-per-pipeline-rank (Megatron-LM's rule)")
        if L % P:
            raise ValueError(f"--num-layers {L} must be divisible by --pipeline-model-parallel-size {P}")
        if (L // P) % per_vstage:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_vstage} must divide the {L // P} layers "
                             f"of a pipeline stage (--num-layers {L} / --pipeline-model-parallel-size {P})")
        vstages = (L // P) // per_vstage
    V = vstages if vstages and vstages > 1 else None
    if not uneven and L % P:
        raise ValueError(f"--num-layers {L} must be divisible by --pipeline-model-parallel-size {P} (or set "
                         "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)")
    # Layers per stage (megatron-core's TransformerConfig rules, with the flags named).
    middle_layers, middle_stages = L, P
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is None:
            continue
        if V and n % V:
            raise ValueError(f"{flag} {n} must be divisible by the virtual stages per pipeline rank {V}")
        middle_layers -= n
        middle_stages -= 1
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        raise ValueError(f"--num-layers {L} leaves {middle_layers} layers for {middle_stages} middle pipeline stages "
                         "after --decoder-first/last-pipeline-num-layers")
    if middle_stages and middle_layers % middle_stages:
        raise ValueError(f"the {middle_layers} layers left for the {middle_stages} middle pipeline stages must divide "
                         f"evenly (--num-layers {L}, --pipeline-model-parallel-size {P}, "
                         "--decoder-first/last-pipeline-num-layers)")
    if middle_stages and V and (middle_layers // middle_stages) % V:
        raise ValueError(f"the {middle_layers // middle_stages} layers of a middle pipeline stage must be divisible by "
                         f"the virtual stages per pipeline rank {V}")
    # megatron-core's interleaved schedule: micro-batches go in groups of P per virtual stage.
    if V and num_microbatches % P:
        raise ValueError(f"interleaved pipelining needs the micro-batches per iteration ({num_microbatches} = "
                         f"--global-batch-size / (--micro-batch-size x data-parallel size)) to be a multiple of "
                         f"--pipeline-model-parallel-size {P}")
    return V


def config_fields(a) -> dict:
    """TransformerConfig / ModelParallelConfig fields of the pipeline flags (`a`: flags or ModelArgs)."""
    P = getattr(a, "pipeline_model_parallel_size", 1) or 1
    if P == 1:
        return {}
    V = getattr(a, "virtual_pipeline_model_parallel_size", None)
    fields = dict(pipeline_model_parallel_size=P, virtual_pipeline_model_parallel_size=V,
                  num_layers_in_first_pipeline_stage=getattr(a, "decoder_first_pipeline_num_layers", None),
                  num_layers_in_last_pipeline_stage=getattr(a, "decoder_last_pipeline_num_layers", None))
    if V:
        # Megatron-LM's defaults for the interleaved schedule (overlap on, hence no batched P2P);
        # without overlap it needs P > 2.
        fields.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    return fields


# ---- stages ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """Which part of the model a chunk holds (GPTModel's `pre_process` / `post_process` / `vp_stage`)."""

    pre_process: bool = True
    post_process: bool = True
    vp_stage: Optional[int] = None

    @property
    def whole(self) -> bool:
        return self.pre_process and self.post_process and self.vp_stage is None

    def kwargs(self) -> dict:
        return asdict(self)


WHOLE = Stage()


def virtual_stages() -> List[Optional[int]]:
    """This rank's model chunks: [None] without interleaving, else [0, ..., V-1]."""
    from megatron.core import parallel_state as mpu

    V = mpu.get_virtual_pipeline_model_parallel_world_size()
    return [None] if not V or V == 1 else list(range(V))


def stage_of(vp_stage: Optional[int]):
    """(pre_process, post_process) of chunk `vp_stage` on this rank: the embedding on the first
    virtual stage of the first rank, the output layer and loss on the last of the last."""
    from megatron.core import parallel_state as mpu

    return (mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))


def first_layer(config, vp_stage: Optional[int]) -> int:
    """Global index of the chunk's first transformer layer (megatron-core's offset rule)."""
    if config.pipeline_model_parallel_size == 1:
        return 0
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage)


def replay_earlier_draws(config, layer_spec, vocab_size: int, max_sequence_length: int, offset: int,
                         with_embedding: bool, position_embedding_type: str = "rope") -> None:
    """Advance the CPU generator by exactly what one rank's build draws before layer `offset`:
    the embedding (if `with_embedding`) and layers 0..offset-1, each built and dropped (one at a
    time; with `use_cpu_initialization` every weight is drawn in full from the CPU generator,
    whatever TP is). Homogeneous layer specs (a `ModuleSpec`, as the flag-built GPT has)."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if not isinstance(layer_spec, ModuleSpec):
        raise ValueError("layout-independent initial weights under pipeline parallelism need one layer spec for every "
                         "layer; load a converted checkpoint for this model")
    if with_embedding:
        LanguageModelEmbedding(config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                                   position_embedding_type=position_embedding_type)
    for i in range(offset):
        # dropped at once; layer number and stage do not change the draws (only the layer's name)
        build_module(layer_spec, config=config, layer_number=i + 1,
                     vp_stage=0 if config.virtual_pipeline_model_parallel_size else None)


def stage_block_spec(spec, config, stage: Stage):
    """A decoder block spec listing every layer of the model (a layer-type pattern: GDN hybrids)
    cut to this chunk's layers; other specs (one layer spec, or already cut by megatron-core)
    unchanged. Layers keep their global numbers, so the pattern splits across stages as written."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if stage.whole or not isinstance(spec, TransformerBlockSubmodules) or len(spec.layer_specs) != config.num_layers:
        return spec
    offset = first_layer(config, stage.vp_stage)
    n = get_num_layers_to_build(config, vp_stage=stage.vp_stage)
    return TransformerBlockSubmodules(layer_specs=spec.layer_specs[offset:offset + n], layer_norm=spec.layer_norm)


def build_chunks(build_chunk: Callable, replay: Optional[Callable] = None) -> list:
    """One model chunk per virtual stage of this rank: `build_chunk(pre_process, post_process,
    vp_stage)`. `replay(vp_stage, pre_process)`, if given, runs first for every chunk (the
    caller reseeds and replays the draws before the chunk, `replay_earlier_draws`)."""
    chunks = []
    for vp in virtual_stages():
        pre, post = stage_of(vp)
        if replay is not None:
            replay(vp, pre)
        chunks.append(build_chunk(pre, post, vp))
    return chunks


# ---- the schedule ------------------------------------------------------------------------------
def p2p_seq_length(bdlm) -> int:
    """`seq_length` for megatron-core's schedules: they send [seq_length / CP (/ TP under sequence
    parallelism), b, h]; this rank's rows are what crosses a stage, so seq_length = rows x shard
    group size (Megatron's CP axis holds the shard group). Rows that vary (`variable_rows`; a model
    without one plan, the DFlash drafter) travel with their shapes: any value."""
    from megatron.core import parallel_state as mpu

    plan = getattr(bdlm, "plan", None)
    return (len(plan.local) if plan is not None else 1) * mpu.get_context_parallel_world_size()


def variable_rows(objective) -> bool:
    """Whether the rows per micro-batch vary (canvas plans): P2P then exchanges shapes first."""
    return not getattr(objective, "fixed_rows", True)


class ModelChunks(torch.nn.Module):
    """The model chunks of one rank under interleaved pipelining, for checkpoints: Megatron-LM's
    state keys `model0`, `model1`, ... (`sharded_state`); every tensor keeps its global key and
    layer offset, so torch_dist checkpoints load under any PP / VP / TP / CP / BP."""

    def __init__(self, chunks):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)


def keyed_chunks(model) -> dict:
    """{'model': the model} of one chunk; {'model0': chunk 0, 'model1': ...} of several."""
    chunks = list(model.chunks) if isinstance(model, ModelChunks) else [model]
    return {"model" if len(chunks) == 1 else f"model{i}": c for i, c in enumerate(chunks)}


def sharded_state(model) -> dict:
    """The sharded state of each of `keyed_chunks(model)`, by its key."""
    return {key: c.sharded_state_dict() for key, c in keyed_chunks(model).items()}
