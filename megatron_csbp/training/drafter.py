"""The trainer's model for --objective dflash (`training.model.CHUNK_BUILDERS`): the DFlash drafter
(model/dflash.py) with the verifier's frozen embeddings and head, on this rank's shard group."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_csbp.checkpoint.drafter import load_drafter
from megatron_csbp.model.dflash import (SHAPE_FILE, WEIGHTS_FILE, DFlashDrafter, DFlashTrainingModel, DrafterShape,
                                        TrainableDrafter, drafter_shape_from_args, drafter_state,
                                        drafter_transformer_config, record_verifier)
from megatron_csbp.objectives.dflash import DFlashObjective
from megatron_csbp.training.model import params_dtype, register_chunk_builder


@register_chunk_builder(DFlashObjective)
def build_drafter_chunks(a, device=None, finalize_model_grads_func=None) -> list:
    """The chunks of --objective dflash: the drafter (initialised from --seed, or
    the --load drafter's `drafter.pt` weights: an import or an older `dflash train --save`), the
    verifier's frozen embeddings and LM head, the layout of this rank's shard group. With --save,
    rank 0 writes the drafter's shape and verifier record there (what `--load` and the export read)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_csbp.parallel import pipeline, state as bps
    from megatron_csbp.data.features import FeatureDataset, FeatureSplit, load_verifier
    from megatron_csbp.attention.dflash import DFlashLayout
    from megatron_csbp.objectives import build_objective

    data, n_eval = FeatureDataset(a.features_path), a.eval_sequences
    splits = (FeatureSplit(data, 0, len(data) - n_eval), FeatureSplit(data, len(data) - n_eval, n_eval))
    verifier = load_verifier(a.verifier)
    # the drafter's weights, the verifier's frozen embeddings and head in --bf16 / --fp16 / fp32
    dtype = params_dtype(a)
    embedding = verifier.get_input_embeddings().weight.detach().to(dtype).clone()
    head = verifier.get_output_embeddings().weight.detach().to(dtype).clone()
    del verifier
    objective = build_objective(a, vocab_size=embedding.shape[0])
    load = a.dflash_drafter_load
    shape = DrafterShape.from_json(open(os.path.join(load, SHAPE_FILE)).read()) if load else \
        drafter_shape_from_args(a, data.meta["hidden_size"])
    if shape.hidden_size != data.meta["hidden_size"]:
        raise ValueError(f"--load {load}: the drafter's hidden size {shape.hidden_size} differs from the features' "
                         f"{data.meta['hidden_size']}")
    # the losses are pre-divided by the global count of sequences: Megatron's schedule must not average
    config = drafter_transformer_config(shape, params_dtype=dtype, perform_initialization=True,
                                        init_method_std=a.init_method_std, calculate_per_token_loss=True,
                                        pipeline_dtype=dtype, bf16=a.bf16, fp16=a.fp16, **pipeline.config_fields(a))
    if finalize_model_grads_func is not None:
        config.finalize_model_grads_func = finalize_model_grads_func
    torch.manual_seed(a.seed)
    # this pipeline stage's layers (megatron-core's split: --num-layers over the stages, or
    # --decoder-first/last-pipeline-num-layers); the context projection first, the final norm last
    (pre, post), first = pipeline.stage_of(None), pipeline.first_layer(config, None)
    layers = range(first, first + get_num_layers_to_build(config))
    drafter = DFlashDrafter(shape, config, layers, pre, post)
    if load and os.path.isfile(os.path.join(load, WEIGHTS_FILE)):  # imported / an older dflash train --save
        drafter.load_state_dict(drafter_state(load_drafter(load)), strict=False)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f" loaded drafter weights {os.path.join(load, WEIGHTS_FILE)} (an import or an older dflash train "
                  "--save: weights only, iteration 0, fresh optimizer)", flush=True)
    save = a.dflash_drafter_save
    if save and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        os.makedirs(save, exist_ok=True)
        with open(os.path.join(save, SHAPE_FILE), "w") as f:
            f.write(shape.to_json())
        record_verifier(save, a.verifier)  # its tokenizer goes with the export
    cp, bp = a.context_parallel_size, a.block_parallel_size
    layout = DFlashLayout(data.meta["seq_length"], shape.block_size, cp, bp)
    shard_group = mpu.get_context_parallel_group()
    ring = bps.get_clean_ring_group() if layout.kind != "cp" else shard_group
    if device is not None:
        drafter, embedding, head = drafter.to(device), embedding.to(device), head.to(device)
    model = DFlashTrainingModel(drafter, embedding, head, objective, layout, shard_rank=mpu.get_context_parallel_rank(),
                                shard_group=shard_group, ring_group=ring, transport=a.attention_transport)
    return [TrainableDrafter(config, model, splits)]
