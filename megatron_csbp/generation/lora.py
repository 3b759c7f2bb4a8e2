"""A LoRA checkpoint (adapters only, `lora/checkpoint.py`) as a model to decode or score: its base
(the path it records) with the adapters folded into the base weights (`lora.peft.merged_state`:
W + alpha / rank * B A, the same function as the adapter's forward without dropout)."""
from __future__ import annotations

from typing import Optional, Tuple

from megatron_csbp.lora import LoRAConfig
from megatron_csbp.lora.peft import Adapters, merged_state


def read_lora(load: str, step=None) -> Optional[Tuple[LoRAConfig, Adapters, str]]:
    """(LoRA config, adapters, base folder) when `load` holds a LoRA checkpoint, else None."""
    from megatron_csbp.checkpoint import files

    lora_record = getattr(files, "lora_record", None)  # TODO(merge r24-ckpt): import it; None before it lands
    if lora_record is None:
        return None
    checkpoint_to_load = files.checkpoint_to_load
    iteration = checkpoint_to_load(load, step) if load else None
    if iteration is None or lora_record(load, iteration) is None:
        return None
    from megatron_csbp.lora.checkpoint import read_lora_checkpoint

    return read_lora_checkpoint(load, iteration)


def fold_adapters(model, config: LoRAConfig, adapters: Adapters) -> None:
    """Fold `adapters` into `model`'s base weights (a base model loaded on one process)."""
    from megatron_csbp.checkpoint.model import load_model_weights

    load_model_weights(model, merged_state(model.state_dict(), config, adapters))
