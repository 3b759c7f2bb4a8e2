"""The model of a `ModelShape` (a converted checkpoint): `build_gpt_model(shape, ...)` builds it
through the family registered under `shape.family` (`megatron_csbp.model.families`), with the
tensor-parallel attributes of loaded weights set.

The megatron-core constructors every caller goes through (`transformer_config`, `gpt_model`,
`PORTABLE_CONFIG`, ...) live in `megatron_csbp.model.core`, below the families, and are re-exported here.
"""
from __future__ import annotations

import torch

from megatron_csbp.model.core import (  # noqa: F401  (re-exported: the constructors' public place)
    PORTABLE_CONFIG, embedding_rows, gpt_layer_spec, gpt_model, local_layer_spec, padded_vocab_size, transformer_config,
    with_block_diffusion,
)


# ---- a ModelShape, through its family ----------------------------------------------------------

def build_gpt_model(shape, block_diffusion: bool = True, kernel: str = "auto", stage=None, **config_overrides):
    """The megatron-core model of `shape` (a `GPTModel`, or the family's subclass of it) under the
    current parallel state. The vocabulary is exactly `shape.vocab_size` (no padding: TP must divide
    it). `kernel`: the block-diffusion attention kernel (--attention-kernel).

    Weights are not initialised (they are about to be loaded); pass `perform_initialization=True`
    in `config_overrides` to draw them. Other overrides set parallelism and training options.
    `stage`: the pipeline chunk (`megatron_csbp.parallel.pipeline.Stage`; default the whole model)."""
    from megatron_csbp.model.families import get_family

    family = get_family(shape.family)
    config = family.transformer_config(shape, **config_overrides)
    model = family.build_model(shape, config, block_diffusion, kernel, stage=stage)
    if not config.perform_initialization:
        mark_tensor_parallel_weights(model, config)
    return model


def mark_tensor_parallel_weights(model: torch.nn.Module, config) -> None:
    """Set the tensor-parallel attributes Megatron only sets while initialising weights.

    With `perform_initialization=False` (weights about to be loaded), megatron-core 0.16 leaves
    `tensor_model_parallel` / `partition_dim` / `partition_stride` unset on the weights of parallel
    linears and embeddings, so gradient-norm and optimizer code would treat TP-sharded weights as
    TP duplicates. This sets exactly what initialisation sets: dim 0 for column-parallel layers and
    the vocabulary embedding, dim 1 for row-parallel layers, stride 2 for SwiGLU `linear_fc1`."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_tensor_model_parallel_attributes,
    )

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or getattr(weight, "tensor_model_parallel", False):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            stride = 2 if (name.endswith("linear_fc1") and config.gated_linear_unit) else 1
            set_tensor_model_parallel_attributes(weight, True, 0, stride)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
