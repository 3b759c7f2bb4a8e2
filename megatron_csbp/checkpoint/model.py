"""A checkpoint's model built and loaded under the current parallel state, and a model saved as a
release checkpoint (converted models; the format: docs/conversion.md#checkpoint-format-what-the-trainer---loads).
`load_for_generation`: `generate`'s model rebuilt from a trainer checkpoint's saved flags, on one
process.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional, Union

import torch.distributed as dist

from megatron_csbp.checkpoint.files import (
    MODEL_KEY, RELEASE, TRACKER, CheckpointModel, checkpoint_to_load, read_checkpoint_model,
)
from megatron_csbp.checkpoint.integrity import check_checkpoint_files, write_checksums
from megatron_csbp.compat.cpu import install_cpu_compat
from megatron_csbp.model.families import SHAPE_FILE, ModelShape

CHECKPOINT_VERSION = 3.0


@contextlib.contextmanager
def single_process_megatron():
    """A one-rank gloo group and Megatron's parallel state (TP = PP = 1), unless the caller already
    set them up; torn down afterwards if created here."""
    from megatron.core import parallel_state as mpu

    install_cpu_compat()  # a no-op with CUDA
    created_pg = not dist.is_initialized()
    if created_pg:  # an in-memory store: no rendezvous, immune to a surrounding torchrun's env
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    created_mpu = not mpu.model_parallel_is_initialized()
    if created_mpu:
        mpu.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if created_mpu:
            mpu.destroy_model_parallel()
        if created_pg:
            dist.destroy_process_group()


def save_gpt_model(model, shape: ModelShape, output: str) -> str:
    """Save `model` (any parallel layout: every rank calls this) as a release checkpoint (the caller
    puts the Hugging Face assets into `output/hf_assets`)."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank() if dist.is_initialized() else 0
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    ckpt_dir = os.path.join(output, RELEASE)
    if rank == 0:
        if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
            raise FileExistsError(f"{ckpt_dir} exists and is not empty: choose a new --output")
        os.makedirs(ckpt_dir, exist_ok=True)
    barrier()
    state = {MODEL_KEY: model.sharded_state_dict(), "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
    dist_checkpointing.save(state, ckpt_dir)
    if rank == 0:
        for d in (output, ckpt_dir):
            Path(d, SHAPE_FILE).write_text(shape.to_json())
    barrier()
    write_checksums(ckpt_dir)
    if rank == 0:
        Path(output, TRACKER).write_text(RELEASE)
    barrier()
    return ckpt_dir


def load_checkpoint_model(checkpoint: Union[str, CheckpointModel], params_dtype=None, block_diffusion: bool = True,
                          step=None, **config_overrides):
    """Build the checkpoint's model under the current parallel state and load its weights
    (dist_checkpointing reshards from the layout it was saved under). `config_overrides` set
    parallelism and training options of the TransformerConfig. Returns (model, CheckpointModel)."""
    from megatron.core import dist_checkpointing

    from megatron_csbp.model.builder import build_gpt_model

    info = checkpoint if isinstance(checkpoint, CheckpointModel) else read_checkpoint_model(checkpoint, step)
    shape = info.shape
    model = build_gpt_model(shape, block_diffusion=block_diffusion, params_dtype=params_dtype or shape.torch_dtype,
                            **config_overrides)
    check_checkpoint_files(info.path)
    state = dist_checkpointing.load({MODEL_KEY: model.sharded_state_dict()}, info.path)
    try:
        load_model_weights(model, state[MODEL_KEY])
    except ValueError as exc:
        raise ValueError(f"--load {info.root}: the {shape.family} model of {info.path}: {exc}") from None
    return model, info


def load_model_weights(model, state: dict) -> None:
    """`load_state_dict` that ignores Megatron's (None) `_extra_state` entries but nothing else."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")


def read_trained(load: str, ckpt_step: Optional[int] = None) -> CheckpointModel:
    """The checkpoint `python -m megatron_csbp.train` wrote in `--load load` (the tracker's, or
    `--ckpt-step`; a missing one lists the saved ones); refuses a folder without its saved flags."""
    step = checkpoint_to_load(load, ckpt_step)
    try:
        info = read_checkpoint_model(load, step)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    if not info.model_args:
        raise ValueError(f"--load {load}: {info.path} has no bdlm_meta.json (not a megatron_csbp.train checkpoint)")
    return info


def load_for_generation(load: str, ckpt_step: Optional[int] = None):
    """The `BlockDiffusionModel` of a `python -m megatron_csbp.train` checkpoint at TP = CP = BP = 1,
    rebuilt from its saved hyper-parameters (`bdlm_meta.json`; a converted model from its shape file)
    and loaded, in eval mode, on one process. Returns (model, model_meta, step)."""
    from megatron_csbp.checkpoint.state import load_checkpoint

    info = read_trained(load, ckpt_step)
    model = generation_model(load, info)
    load_checkpoint(load, model.gpt, None, None, info.iteration)
    return model, info.model_args, info.iteration


def generation_model(load: str, info: CheckpointModel, **overrides):
    """The eval-mode `BlockDiffusionModel` a trained checkpoint's saved flags (then `overrides`) build on
    one process, weights not loaded; refused unless the run is BD3-LM."""
    from megatron_csbp.model.assemble import ModelArgs, assemble
    from megatron_csbp.parallel import state as bps

    margs = dict(info.model_args, **overrides)
    if margs.get("objective") != "bd3lm":
        # Fast-dLLM v2 decodes with a token shift: not this sampler. Checked before building the model.
        raise ValueError(f"--load {load}: checkpoint objective is {margs.get('objective')!r}; this sampler "
                         "decodes BD3-LM (--objective bd3lm) checkpoints and DiffusionGemma models. Export others "
                         "with `python -m megatron_csbp.convert megatron-to-hf` and generate with their Hugging "
                         "Face model")
    # a one-rank gloo group and the block-parallel state at TP = CP = BP = 1, kept for the caller's decoding
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise ValueError("python -m megatron_csbp.generate runs on one process (no torchrun)")
    install_cpu_compat()
    if not bps.is_initialized():
        bps.initialize_block_parallel()
    fields = ModelArgs.__dataclass_fields__
    _, model = assemble(ModelArgs(**{k: v for k, v in margs.items() if k in fields and v is not None},
                                  model_shape=info.file_shape))
    model.eval()
    return model
