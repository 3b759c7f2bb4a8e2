"""The tokenizer that goes with every Hugging Face export: the one the model was trained with
(`export_tokenizer`: `--tokenizer-model`, else the trainer's record in `bdlm_meta.json`, checked by
sha256, else the converted model's `hf_assets/`), checked to load with `AutoTokenizer` with the
trainer's EOD and mask ids. Where it comes from for each tokenizer type: docs/conversion.md.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Optional

from megatron_csbp.data.tokenizer import (
    DEFAULT_MODEL, HF_TOKENIZER_FILES, hf_tokenizer_from_sentencepiece, tokenizer_sha256,
)

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")


def _find(flag_path: Optional[str], recorded: Dict[str, Any], what: str, also: Optional[str] = None) -> str:
    """The tokenizer file/folder the checkpoint recorded, where it still is (and unchanged): at
    the flag's path, the recorded absolute path, then `also` (the shipped model when the flag named
    none; the checkpoint's own hf_assets for a Hugging Face tokenizer)."""
    sha = recorded.get("tokenizer_sha256")
    named = [p for p in (flag_path, recorded.get("tokenizer_path")) if p]
    found = next((p for p in named + [also] if p and os.path.exists(p)
                  and (p != also or not sha or tokenizer_sha256(p) == sha)), None)
    if found is None:
        raise FileNotFoundError(f"the model was trained with the {what} {' = '.join(dict.fromkeys(named))}, "
                                "which is not there: give it to the export as --tokenizer-model PATH")
    if sha and tokenizer_sha256(found) != sha:
        raise ValueError(f"the {what} {found} is not the one the model was trained with (sha256 differs from the "
                         "checkpoint's bdlm_meta.json): give the right one as --tokenizer-model PATH")
    return found


def checkpoint_tokenizer(model_args: Dict[str, Any], tokenizer_model: Optional[str] = None,
                         assets_dir: Optional[str] = None):
    """(kind, path) of the tokenizer to export: kind "sentencepiece" (a .model file), "hf" (a
    folder), "null" (NullTokenizer), or None (no record: a converted model, its hf_assets)."""
    if tokenizer_model is not None:
        if os.path.isdir(tokenizer_model):
            return "hf", tokenizer_model
        if os.path.isfile(tokenizer_model):
            return "sentencepiece", tokenizer_model
        raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no such file or folder")
    ttype = model_args.get("tokenizer_type")
    if not model_args or (ttype is None and "tokenizer_type" not in model_args):
        return None, None
    if ttype == "NullTokenizer":
        return "null", None
    if ttype == "HuggingFaceTokenizer":
        return "hf", _find(model_args.get("tokenizer_model"), model_args, "Hugging Face tokenizer folder", assets_dir)
    if ttype in (None,) + SENTENCEPIECE_TYPES:
        flag = model_args.get("tokenizer_model")
        return "sentencepiece", _find(flag, model_args, "sentencepiece model", None if flag else DEFAULT_MODEL)
    raise ValueError(f"the checkpoint's --tokenizer-type {ttype!r} is not one the export knows")


def export_tokenizer(model_args: Dict[str, Any], output: str, tokenizer_model: Optional[str] = None,
                     assets_dir: Optional[str] = None) -> str:
    """Write the training tokenizer into the Hugging Face folder `output` (see the module
    docstring); `assets_dir`: the checkpoint's hf_assets, already copied into `output`. Returns
    one line saying what was written."""
    kind, path = checkpoint_tokenizer(model_args, tokenizer_model, assets_dir)
    eod, mask = model_args.get("eod_token_id"), model_args.get("mask_token_id")
    if kind == "null" and not has_tokenizer(output):
        return "no tokenizer written: the model was trained with NullTokenizer (its token ids are the text)"
    if kind in (None, "null"):  # (NullTokenizer on a converted model: data pre-tokenized by its own tokenizer)
        if not has_tokenizer(output):
            return "no tokenizer written: the converted model's hf_assets hold none"
        what = "the source model's tokenizer (hf_assets)"
        try:  # copied as the source had it: said, not refused, when transformers cannot read it
            return f"tokenizer: {what}, " + _check(output, None, None)
        except Exception as exc:  # noqa: BLE001  (transformers/tokenizers raise plain Exceptions here)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"tokenizer: {what} copied; AutoTokenizer cannot load it ({first})"
    elif kind == "sentencepiece":
        vocab = model_args.get("vocab_size")
        hf = hf_tokenizer_from_sentencepiece(path, eos_id=eod, mask_id=mask if mask is not None and
                                             (vocab is None or mask < vocab) else None)
        _clear_tokenizer(output)
        hf.save_pretrained(output)
        shutil.copyfile(path, os.path.join(output, "tokenizer.model"))
        what = f"the sentencepiece tokenizer {path}"
    else:
        from transformers import AutoTokenizer

        if not (assets_dir and os.path.isdir(assets_dir) and os.path.samefile(path, assets_dir)):
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            _clear_tokenizer(output)
            tok.save_pretrained(output)
        what = f"the Hugging Face tokenizer {path}"
    return f"tokenizer: {what}, " + _check(output, eod, mask)


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in HF_TOKENIZER_FILES if f != "tokenizer_config.json")


def _clear_tokenizer(folder: str) -> None:
    """Remove tokenizer files copied from hf_assets that belong to another tokenizer."""
    for f in HF_TOKENIZER_FILES:
        p = os.path.join(folder, f)
        if os.path.isfile(p):
            os.remove(p)


def _check(output: str, eod: Optional[int], mask: Optional[int]) -> str:
    """`AutoTokenizer` loads the export, with the training EOD (and mask) ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(output, local_files_only=True)
    if eod is not None and tok.eos_token_id != eod:
        raise ValueError(f"the exported tokenizer's EOS id {tok.eos_token_id} is not the training EOD id {eod}")
    if mask is not None and mask < len(tok) and tok.mask_token_id is not None and tok.mask_token_id != mask:
        raise ValueError(f"the exported tokenizer's mask id {tok.mask_token_id} is not the training mask id {mask}")
    ids = f"EOS {tok.eos_token!r} = {tok.eos_token_id}"
    if tok.mask_token_id is not None:
        ids += f", mask {tok.mask_token!r} = {tok.mask_token_id}"
    return f"loadable by AutoTokenizer ({type(tok).__name__}, {len(tok)} tokens; {ids})"
