"""DFlash drafters (`muse_glimmer_assistant`, transformers' `MuseGlimmerAssistantModel`) both ways:

    python -m megatron_csbp.convert hf-to-megatron --hf-path DRAFTER_HF --output DRAFTER
    python -m megatron_csbp.convert megatron-to-hf --load DRAFTER --output DRAFTER_HF

An import is `drafter.pt` + `megatron_csbp_drafter.json` (`DrafterShape`); every config field
maps; the export carries the verifier's tokenizer. docs/dflash.md#importing-a-released-drafter-convert-hf-to-megatron,
docs/conversion.md (the tokenizer).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from megatron_csbp.checkpoint.drafter import read_drafter, save_drafter
from megatron_csbp.checkpoint.files import ASSETS_DIR
from megatron_csbp.conversion import hf_io
from megatron_csbp.conversion.tokenizer import export_tokenizer, has_tokenizer
from megatron_csbp.model.dflash import HF_MODEL_TYPE, VERIFIER_FILE, DrafterShape, record_verifier  # noqa: F401
from megatron_csbp.model.families import DTYPES


def export_drafter_tokenizer(load: str, output: str, tokenizer_model: Optional[str] = None) -> str:
    """The drafter's tokenizer (its verifier's) into the exported folder `output`; one line saying
    what was written. Sources, first found: `tokenizer_model`, the import's `hf_assets/`, the
    recorded verifier (sha256-checked)."""
    assets = os.path.join(load, ASSETS_DIR)
    verifier = os.path.join(load, VERIFIER_FILE)
    record = json.loads(Path(verifier).read_text()) if os.path.isfile(verifier) else {}
    if tokenizer_model is None and os.path.isdir(assets) and os.listdir(assets):
        tokenizer_model = assets
    if tokenizer_model is None and not record:
        return ("no tokenizer written: the drafter records no verifier (imported without a tokenizer); give the "
                "verifier's tokenizer folder as --tokenizer-model")
    folder = tokenizer_model or record.get("verifier")
    if folder and os.path.isdir(folder) and not has_tokenizer(folder):
        return f"no tokenizer written: the verifier {folder} holds no tokenizer files"
    args = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": record.get("verifier"), **record}
    return export_tokenizer(args, output, tokenizer_model)


def is_hf_drafter(hf_path: str) -> bool:
    has_config = os.path.isfile(os.path.join(hf_path, "config.json"))
    return has_config and hf_io.read_config(hf_path).get("model_type") == HF_MODEL_TYPE


def hf_to_megatron_drafter(hf_path: str, output: str, dtype=None) -> DrafterShape:
    """A `MuseGlimmerAssistantModel` folder -> a drafter checkpoint `dflash train --load` reads."""
    from megatron_csbp.model.dflash import hf_tensor_names, hf_to_megatron_state

    cfg = hf_io.read_config(hf_path)
    shape = DrafterShape.from_hf_config(cfg)
    tensors = hf_io.read_tensors(hf_path)
    state = hf_to_megatron_state(shape, tensors)
    unused = sorted(set(tensors) - hf_tensor_names(shape))
    if unused:
        raise ValueError(f"{hf_path}: tensors the drafter has no place for: {unused[:8]}")
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) for k, v in state.items()}
    save_drafter(state, shape, output)
    if has_tokenizer(hf_path):  # the verifier's tokenizer, exported with the drafter
        hf_io.copy_assets(hf_path, os.path.join(output, ASSETS_DIR), exclude=("config.json", "generation_config.json"))
    return shape


def megatron_to_hf_drafter(load: str, output: str, dtype=None, tokenizer_model: Optional[str] = None,
                           log=None) -> DrafterShape:
    """A drafter checkpoint (imported, or saved by `dflash train`) -> a `MuseGlimmerAssistantModel`
    folder, with its verifier's tokenizer (`export_drafter_tokenizer`; `log` gets its line)."""
    from megatron_csbp.checkpoint.model import single_process_megatron
    from megatron_csbp.model.dflash import export_hf_drafter

    with single_process_megatron():
        model = read_drafter(load)
        export_hf_drafter(model, output, DTYPES[dtype] if dtype else torch.float32)
    line = export_drafter_tokenizer(load, output, tokenizer_model)
    if log is not None:
        log(line)
    return model.shape
