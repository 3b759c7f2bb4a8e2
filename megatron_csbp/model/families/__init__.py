"""Model families, registered by name: the one list of what the converter reads and the trainer builds.

A family (`base.Family`) owns its Hugging Face config -> `ModelShape` translation and refusals, its
Megatron config and layer spec / model, and its Hugging Face <-> Megatron weight mapping.
`megatron_csbp.model.builder` builds any shape through its family; `megatron_csbp.conversion`
converts through it. Adding a family = one module here that calls `register_family`, imported below.

Registered: llama, qwen2, qwen3, qwen3_moe, mixtral (`gpt`), qwen3_5 (hybrid Gated DeltaNet,
`qwen3_5`), diffusion_gemma (DiffusionGemma and Gemma 4 text MoE starts, `diffusion_gemma`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron_csbp.model.families.base import (  # noqa: F401  (the schema, re-exported)
    DTYPES, SHAPE_FILE, SHAPE_FORMAT_VERSION, Family, ModelShape, UnsupportedModelError, flag_values,
)

_FAMILIES: Dict[str, Family] = {}
_BY_MODEL_TYPE: Dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add `family`; its name and Hugging Face model types must be new."""
    if not family.name or family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is empty or already registered")
    taken = sorted(t for t in family.model_types if t in _BY_MODEL_TYPE)
    if taken:
        raise ValueError(f"model family {family.name!r}: Hugging Face model types {taken} already belong to "
                         f"{sorted({_BY_MODEL_TYPE[t].name for t in taken})}")
    _FAMILIES[family.name] = family
    _BY_MODEL_TYPE.update(dict.fromkeys(family.model_types, family))
    return family


def family_names() -> List[str]:
    return sorted(_FAMILIES)


def hf_model_types() -> List[str]:
    """Every Hugging Face `model_type` the converter reads."""
    return sorted(_BY_MODEL_TYPE)


def get_family(name: str) -> Family:
    """The family of `ModelShape.family` == `name`."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UnsupportedModelError(f"model family {name!r} is not registered (one of {family_names()})") from None


def family_of_hf_config(cfg: Dict[str, Any]) -> Family:
    """The family that reads this Hugging Face config.json (by `model_type`)."""
    model_type = cfg.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"Hugging Face model_type {model_type!r} (architectures {cfg.get('architectures') or []}) is not "
            f"supported; supported model types: {hf_model_types()}")
    return family


def shape_from_hf_config(cfg: Dict[str, Any], params_dtype: Optional[str] = None) -> ModelShape:
    """Translate a Hugging Face `config.json` dict; refuse what Megatron's layers cannot match."""
    return family_of_hf_config(cfg).shape_from_hf_config(cfg, params_dtype)


def megatron_flags(shape: ModelShape) -> List[str]:
    """Megatron-LM command-line flags that rebuild the model of `shape` (where its family has them)."""
    return get_family(shape.family).megatron_flags(shape)


# Registration: each module registers its families on import.
from megatron_csbp.model.families import gpt as _gpt  # noqa: E402,F401
from megatron_csbp.model.families import qwen3_5 as _qwen3_5  # noqa: E402,F401
from megatron_csbp.model.families import diffusion_gemma as _diffusion_gemma  # noqa: E402,F401
