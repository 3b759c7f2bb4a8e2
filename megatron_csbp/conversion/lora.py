"""LoRA checkpoints <-> Hugging Face: a PEFT adapter folder (`lora/peft.py` places the tensors), the
merged model (`--merge-lora`), and a PEFT adapter imported as a LoRA checkpoint. Where each Megatron
adapter goes comes from the converter's own weight mapping (`model/families/gpt_weights.tensor_map`,
`diffusion_gemma_weights`): docs/lora.md#export-to-peft-and-import."""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from megatron_csbp.lora import FUSED_PARTS, LoRAConfig
from megatron_csbp.lora.peft import Adapters, Target, load_peft_adapter, to_peft_model
from megatron_csbp.model.families import DTYPES, ModelShape, get_family
from megatron_csbp.model.families.diffusion_gemma import hf_config_for_export, transformer_config

#: the megatron-core linears LoRA adapts, by their weights' names
LINEARS = tuple(f"{n}.weight" for n in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+\.)[\w.]*experts\.(?P<e>\d+)\.\w+\.weight$")
#: (split, join) of a module whose base weight is one Hugging Face parameter
_WHOLE = (lambda x: (x,), lambda x: x)


def _gpt_targets(shape: ModelShape) -> List[Target]:
    """The GPT families' `tensor_map` entries of weight matrices; an expert's per-expert on-disk
    names become transformers' fused 3D parameters `mlp.experts.gate_up_proj` ([gate; up] rows, like
    Megatron's fc1) and `mlp.experts.down_proj`, indexed by the expert."""
    from megatron_csbp.model.families.gpt_weights import tensor_map

    out = []
    for t in tensor_map(shape):
        if not t.megatron.endswith(LINEARS):
            continue
        module, m = t.megatron[: -len(".weight")], _EXPERT.match(t.hf[0])
        if m:
            live = m["layer"] + "mlp.experts." + ("gate_up_proj" if len(t.hf) == 2 else "down_proj")
            out.append(Target(module, ((live,),), *_WHOLE, int(m["e"])))
        else:
            parts = FUSED_PARTS.get(module.rsplit(".", 1)[1], ())
            canonical = len(parts) == len(t.hf) and not (parts[0] == "q" and shape.attention_output_gate)
            out.append(Target(module, tuple((n,) for n in t.hf), t.split, t.join, None, parts if canonical else ()))
    return out


def _dg_targets(shape: ModelShape) -> List[Target]:
    """DiffusionGemma: every projection of the decoder layers (Megatron adapts no other: the
    self-conditioning MLP stays as it is), which Hugging Face's encoder language model shares (tied
    weights, separate modules: the adapter goes on both)."""
    from megatron_csbp.model.families.diffusion_gemma_weights import (
        HF_ENCODER, HF_TEXT, qkv_tensors,
    )

    config = transformer_config(shape)
    halves = (lambda t: t.chunk(2), lambda g, u: torch.cat([g, u]))
    out = []
    for i in range(config.num_layers):
        m, qkv = f"decoder.layers.{i}.", qkv_tensors(config, i)

        def both(*names):
            return tuple((f"{HF_TEXT}layers.{i}.{n}", f"{HF_ENCODER}layers.{i}.{n}") for n in names)

        qkv_names = (n.removeprefix(f"{HF_TEXT}layers.{i}.") for n in qkv.hf)
        out += [Target(m + "self_attention.linear_qkv", both(*qkv_names), qkv.split, qkv.join),
                Target(m + "self_attention.linear_proj", both("self_attn.o_proj.weight"), *_WHOLE),
                Target(m + "mlp.dense.linear_fc1", both("mlp.gate_proj.weight", "mlp.up_proj.weight"), *halves),
                Target(m + "mlp.dense.linear_fc2", both("mlp.down_proj.weight"), *_WHOLE)]
        experts = f"{m}mlp.experts.local_experts."
        out += [Target(f"{experts}{e}.{fc}", both(f"experts.{hf}"), *_WHOLE, e) for e in range(config.num_moe_experts)
                for fc, hf in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj"))]
    return out


class _FamilyMap(NamedTuple):
    targets: Callable[[ModelShape], List[Target]]
    hf_config: Callable[[ModelShape], dict]


#: family name -> how its adapters map (the GPT families share one)
FAMILY_MAPS: Dict[str, _FamilyMap] = {
    **{name: _FamilyMap(_gpt_targets, lambda shape: dict(shape.hf_config))
       for name in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen3_5")},
    "diffusion_gemma": _FamilyMap(_dg_targets, hf_config_for_export),
}


def family_map(shape: ModelShape) -> _FamilyMap:
    if shape.family not in FAMILY_MAPS:
        raise ValueError(f"a PEFT adapter of a {shape.family} model is not supported (families: {sorted(FAMILY_MAPS)})")
    return FAMILY_MAPS[shape.family]


def meta_hf_model(shape: ModelShape):
    """The Hugging Face model of `shape` on the meta device (no memory): what peft needs for names."""
    import transformers

    cfg = family_map(shape).hf_config(shape)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"},
                                               model_type=cfg["model_type"])
    arch = (cfg.get("architectures") or get_family(shape.family).architectures)[0]
    with torch.device("meta"):
        return getattr(transformers, arch)._from_config(config)


def peft_targets(shape: ModelShape) -> List[Target]:
    return family_map(shape).targets(shape)


def export_peft_adapter(shape: ModelShape, config: LoRAConfig, adapters: Adapters, output: str,
                        base: Optional[str] = None, dtype: Optional[str] = None) -> None:
    """Write `adapters` of a model of `shape` as a PEFT adapter folder (`dtype`: of the written tensors)."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
        adapters = {k: v.to(DTYPES[dtype]) for k, v in adapters.items()}
    to_peft_model(meta_hf_model(shape), peft_targets(shape), config, adapters, base).save_pretrained(output)


def import_peft_adapter(shape: ModelShape, directory: str, flag: str = "--peft-adapter"):
    """(LoRAConfig, adapters) of a PEFT adapter folder made for the Hugging Face model of `shape`."""
    if not os.path.isfile(os.path.join(directory, "adapter_config.json")):
        raise FileNotFoundError(f"{flag} {directory}: no adapter_config.json (a PEFT adapter folder holds it)")
    return load_peft_adapter(meta_hf_model(shape), peft_targets(shape), directory, flag)


def export_lora_checkpoint(load: str, output: str, merge: bool = False, dtype: Optional[str] = None,
                           log: Optional[Callable[[str], None]] = None, **hf_export) -> ModelShape:
    """`convert megatron-to-hf --load LORA_CKPT`: a PEFT adapter folder for the Hugging Face export of
    the checkpoint's base, or with `merge` (--merge-lora) the base exported with the adapters folded
    in (`hf_export`: `api.megatron_to_hf_checkpoint`'s options)."""
    from megatron_csbp.checkpoint.files import read_checkpoint_model
    from megatron_csbp.conversion import api
    from megatron_csbp.generation.lora import read_lora
    from megatron_csbp.lora.peft import merged_state

    config, adapters, base = read_lora(load)
    shape = read_checkpoint_model(base).shape
    groups = shape.num_query_groups or shape.num_attention_heads
    if merge:
        return api.megatron_to_hf_checkpoint(base, output, dtype, log=log,
                                             transform=lambda state: merged_state(state, config, adapters, groups), **hf_export)
    export_peft_adapter(shape, config, adapters, output, dtype=dtype)
    if log is not None:
        log(f"its base: export it with `python -m megatron_csbp.convert megatron-to-hf --load {base}`; load the "
            "adapter onto it with peft.PeftModel.from_pretrained")
    return shape


def import_peft_checkpoint(hf_path: str, adapter: str, output: str, dtype: Optional[str] = None):
    """`convert hf-to-megatron --hf-path BASE --peft-adapter DIR --output OUT`: the base converted to
    `OUT/base` and the adapter written as a LoRA checkpoint in `OUT` over it (train on with
    `--load OUT --pretrained-checkpoint OUT/base` and the LoRA flags it prints). Returns (shape, config)."""
    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.hf_io import read_config
    from megatron_csbp.lora.checkpoint import write_lora_checkpoint
    from megatron_csbp.model.families import shape_from_hf_config

    config, adapters = import_peft_adapter(shape_from_hf_config(read_config(hf_path), dtype), adapter)
    base = os.path.join(output, "base")
    shape = api.hf_to_megatron_checkpoint(hf_path, base, dtype)
    write_lora_checkpoint(output, config, {k: v.to(shape.torch_dtype) for k, v in adapters.items()}, base)
    return shape, config
