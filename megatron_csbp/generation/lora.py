"""A LoRA checkpoint (adapters only, `lora/checkpoint.py`) as a model to decode or score: its base
(the path it records) with the adapters folded into the base weights (`lora.peft.merged_state`:
W + alpha / rank * B A, the same function as the adapter's forward without dropout)."""
from __future__ import annotations

from typing import Optional, Tuple

from megatron_csbp.lora import LoRAConfig
from megatron_csbp.lora.peft import Adapters, merged_state


def read_lora(load: str, step=None) -> Optional[Tuple[LoRAConfig, Adapters, str]]:
    """(LoRA config, adapters, base folder) when `load` holds a LoRA checkpoint, else None."""
    from megatron_csbp.checkpoint.files import checkpoint_to_load, lora_record

    iteration = checkpoint_to_load(load, step) if load else None
    if iteration is None or lora_record(load, iteration) is None:
        return None
    from megatron_csbp.lora.checkpoint import read_lora_checkpoint

    return read_lora_checkpoint(load, iteration)


def fold_adapters(model, config: LoRAConfig, adapters: Adapters) -> None:
    """Fold `adapters` into `model`'s base weights (a base model loaded on one process)."""
    from megatron_csbp.checkpoint.model import load_model_weights

    load_model_weights(model, merged_state(model.state_dict(), config, adapters, model.config.num_query_groups))


def load_for_generation(load: str, step, lora: Tuple[LoRAConfig, Adapters, str]):
    """`checkpoint.model.load_for_generation` of a LoRA checkpoint `load` (a BD3-LM run): the model its
    saved flags build, without adapters, with the recorded base's weights and the adapters folded in.
    Returns (model, model_meta, step)."""
    from megatron_csbp.checkpoint.model import generation_model, read_trained
    from megatron_csbp.checkpoint.state import load_checkpoint

    info = read_trained(load, step)
    model = generation_model(load, info, lora_rank=0)  # the base's model: the adapters are folded in below
    load_checkpoint(lora[2], model.gpt, None, None)
    fold_adapters(model.gpt, *lora[:2])
    return model, info.model_args, info.iteration
