"""Decoding from a checkpoint on one process (TP = CP = BP = EP = 1, whatever layout saved it):

    python -m megatron_csbp.generate --load runs/default/checkpoints --prompt "The for statement"
    python -m megatron_csbp.generate --load DIR --prompt-ids PROMPT.npy --max-new-tokens N --seed S --output OUT.npy

Two samplers, chosen by the checkpoint:

- BD3-LM checkpoints of `python -m megatron_csbp.train` (`--objective bd3lm`, flag-built or from a
  converted model): `megatron_csbp.generation.bd3lm` (blocks left to right, clean-prefix KV cache,
  `--steps-per-block` with `--unmask-order`, or Fast-dLLM's `--threshold`). Defaults: temperature
  0.8, random unmasking order (at temperature 0 the small shipped model fills blocks with its most
  frequent piece, a space);
- DiffusionGemma checkpoints (converted, or trained here under any TP/CP/BP/EP layout):
  `megatron_csbp.generation.diffusion_gemma`, transformers' sampler (random canvas, entropy-bound
  acceptance, linear temperature schedule, stable-and-confident stopping) with the checkpoint's
  `generation_config.json` and transformers' defaults; a flag per knob. The draws come from torch's
  global generator seeded with `--seed`, as `torch.manual_seed(S)` before transformers' `generate`.

Ids in and out without a tokenizer: `--prompt-ids` reads an int array [batch, prompt] (.npy),
`--output` writes [batch, prompt + N] (int64 .npy; BD3-LM rows stopped at EOD are filled with EOD
after it). `--prompt` takes text through the checkpoint's tokenizer (space-separated ids for a
NullTokenizer checkpoint).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_csbp.attention.kernels.capability import info_to_stderr
from megatron_csbp.checkpoint.model import load_for_generation  # noqa: F401
from megatron_csbp.generation.bd3lm import ORDERS, BlockDiffusionSampler  # noqa: F401
from megatron_csbp.utils.cli import ArgumentParser, filter_warnings

BD3LM_DEFAULT_NEW_TOKENS = 64
#: transformers' DiffusionGemmaGenerationConfig settings that are flags (`--max-denoising-steps`, ...):
#: type and help; each reaches `generation.diffusion_gemma.generation_config` under its own name
DIFFUSION_GEMMA_SETTINGS = {
    "max_denoising_steps": (int, "default 48"), "entropy_bound": (float, "EntropyBoundSamplerConfig; default 0.1"),
    "t_min": (float, "final temperature; default 0.4"), "t_max": (float, "initial temperature; default 0.8"),
    "stability_threshold": (int, "default 1"), "confidence_threshold": (float, "default 0.005")}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_csbp.generate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True)
    p.add_argument("--ckpt-step", type=int, default=None, help="default: the latest iteration")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (space-separated ids for a NullTokenizer checkpoint)")
    src.add_argument("--prompt-ids", help="int array [batch, prompt] in a .npy file")
    p.add_argument("--output", default=None, help="write the ids [batch, prompt + N] to this .npy file")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"N; default {BD3LM_DEFAULT_NEW_TOKENS} (BD3-LM), the generation config's (DiffusionGemma: 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-model", default=None, help="default: the one saved with the checkpoint")
    p.add_argument("--chat", action="store_true",
                   help="--prompt is one user turn, rendered as the checkpoint's SFT data was (its --chat-template: "
                        "the tokenizer's chat template with the generation prompt, else User:/Assistant:)")
    b = p.add_argument_group("BD3-LM")
    b.add_argument("--temperature", type=float, default=0.8, help="0: argmax")
    b.add_argument("--unmask-order", choices=ORDERS, default="random",
                   help="which masked positions a step fixes: the most confident, or uniformly drawn ones")
    b.add_argument("--steps-per-block", type=int, default=None, help="default: the block size")
    b.add_argument("--threshold", type=float, default=None,
                   help="Fast-dLLM parallel decoding: fix every masked position whose token has probability >= this "
                        "(at least the most confident one per step); replaces --steps-per-block/--unmask-order")
    b.add_argument("--no-kv-cache", action="store_true", help="recompute the clean prefix at every step")
    d = p.add_argument_group("DiffusionGemma (transformers' DiffusionGemmaGenerationConfig fields)")
    for name, (kind, text) in DIFFUSION_GEMMA_SETTINGS.items():
        d.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    d.add_argument("--eos-token-id", type=int, nargs="+", default=None, help="default: the generation config's")
    d.add_argument("--pad-token-id", type=int, default=None, help="default: the generation config's")
    d.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
                   help="parameters and compute (transformers compares at the same dtype)")
    return p


def _prompt_ids(a, tok=None, null_tokenizer: bool = False, template_spec: Optional[str] = "auto") -> np.ndarray:
    """[batch, prompt] int64 from --prompt-ids or --prompt (ids for a NullTokenizer); with --chat the
    prompt as a user turn of `template_spec` (data.sft.chat_template), the generation prompt added."""
    if a.chat:
        if a.prompt is None or tok is None or null_tokenizer:
            raise ValueError("--chat renders --prompt text with the checkpoint's tokenizer: give --prompt (and a "
                             "checkpoint with a text tokenizer)")
        from megatron_csbp.data.sft import chat_template, prompt_ids

        return np.asarray([prompt_ids(a.prompt, tok, chat_template(tok, template_spec))], dtype=np.int64)
    if a.prompt_ids is not None:
        try:
            ids = np.load(a.prompt_ids)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--prompt-ids {a.prompt_ids}: not a .npy array ({exc})") from None
        ids = ids[None] if ids.ndim == 1 else ids
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"--prompt-ids must be an integer array [batch, prompt], got {ids.dtype} {ids.shape}")
        return ids.astype(np.int64)
    if tok is None:
        raise ValueError("--prompt needs a tokenizer: give --tokenizer-model (SentencePiece), or pass ids with "
                         "--prompt-ids")
    if null_tokenizer:
        try:
            ids = [int(t) for t in a.prompt.split()]
        except ValueError:
            raise ValueError(f"--prompt {a.prompt!r}: this checkpoint has a NullTokenizer (no vocabulary); give token "
                             "ids separated by spaces (--prompt '5 17 42') or --prompt-ids PROMPT.npy") from None
        return np.asarray([ids], dtype=np.int64)
    return np.asarray([tok.tokenize(a.prompt)], dtype=np.int64)


def _check_range(ids: np.ndarray, vocab_size: int) -> None:
    if ids.shape[1] == 0:
        raise ValueError("--prompt / --prompt-ids: the prompt is empty")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"--prompt-ids: token ids must lie in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")


def _diffusion_gemma(load: str, step: Optional[int]):
    """The checkpoint when `load` holds a DiffusionGemma, else None (the one checkpoint reader,
    `checkpoint.files.read_checkpoint_model`, decides what the folder holds)."""
    from megatron_csbp.checkpoint.files import read_checkpoint_model

    try:
        info = read_checkpoint_model(load, step)
        return info if info.shape.family == "diffusion_gemma" else None
    except (FileNotFoundError, ValueError):
        return None


def run_diffusion_gemma(a, info, lora=None) -> np.ndarray:
    from megatron_csbp.checkpoint.model import load_checkpoint_model, single_process_megatron
    from megatron_csbp.data.megatron_data import build_tokenizer
    from megatron_csbp.generation import diffusion_gemma as dg
    from megatron_csbp.generation.lora import fold_adapters

    shape = info.shape
    try:
        config = dg.generation_config(
            dg.assets_dir(info), **{k: getattr(a, k) for k in DIFFUSION_GEMMA_SETTINGS},
            eos_token_id=a.eos_token_id if a.eos_token_id is None or len(a.eos_token_id) > 1 else a.eos_token_id[0],
            pad_token_id=a.pad_token_id)
    except ValueError as exc:
        raise ValueError(f"DiffusionGemma generation settings: {exc}") from None
    if a.max_new_tokens is not None and a.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {a.max_new_tokens}")
    tok = None
    if a.tokenizer_model:
        tok = build_tokenizer("SentencePieceTokenizer", a.tokenizer_model, shape.vocab_size)
    elif a.chat and dg.assets_dir(info):  # the tokenizer (and its chat template) converted with the model
        tok = build_tokenizer("HuggingFaceTokenizer", dg.assets_dir(info), None)
    ids = _prompt_ids(a, tok)
    _check_range(ids, shape.vocab_size)
    dtype = getattr(torch, a.dtype)
    with single_process_megatron():
        model, _ = load_checkpoint_model(info, params_dtype=dtype)
        if lora is not None:
            fold_adapters(model, *lora[:2])
        model.eval()
        sampler = dg.DiffusionGemmaSampler(model, dg.canvas_length(shape))
        torch.manual_seed(a.seed)
        out = sampler.generate(torch.from_numpy(ids), config, a.max_new_tokens)
    new = a.max_new_tokens if a.max_new_tokens is not None else out.shape[1] - ids.shape[1]
    out = out[:, : ids.shape[1] + new].numpy()
    print(f"[checkpoint {info.path}; DiffusionGemma, canvas {sampler.C}, {sampler.forward_calls} forward calls, "
          f"denoising steps per row {sampler.denoising_steps.tolist()}]")
    if tok is not None:
        for row in out:
            print(tok.detokenize(row.tolist()))
    elif a.output is None:
        print(out.tolist())
    return out


def run_bd3lm(a, lora=None) -> np.ndarray:
    from megatron_csbp.data.megatron_data import saved_tokenizer
    from megatron_csbp.generation import lora as lora_generation

    model, margs, step = (load_for_generation(a.load, a.ckpt_step) if lora is None
                          else lora_generation.load_for_generation(a.load, a.ckpt_step, lora))
    tokenizer_type = margs.get("tokenizer_type") or "SentencePieceTokenizer"
    tok = saved_tokenizer(tokenizer_type, a.tokenizer_model or margs.get("tokenizer_model"), margs.get("vocab_size"))
    ids = _prompt_ids(a, tok, null_tokenizer=tokenizer_type == "NullTokenizer",
                      template_spec=margs.get("chat_template") or "auto")
    _check_range(ids, margs["vocab_size"])
    if ids.shape[1] >= margs["seq_length"]:
        raise ValueError(f"--prompt has {ids.shape[1]} tokens; the model was trained on --seq-length "
                         f"{margs['seq_length']}")
    if a.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {a.temperature}")
    new = BD3LM_DEFAULT_NEW_TOKENS if a.max_new_tokens is None else a.max_new_tokens
    sampler = BlockDiffusionSampler(model, margs["vocab_size"], margs["mask_token_id"], tok.eod,
                                    margs["block_size"], use_cache=not a.no_kv_cache)
    rows = [prompt + sampler.generate(prompt, new, a.steps_per_block, a.temperature, a.seed,
                                      max_length=margs["seq_length"], order=a.unmask_order, threshold=a.threshold)
            for prompt in ids.tolist()]
    print(f"[checkpoint {a.load} iteration {step}; {sampler.forward_calls} forward calls]")
    if a.output is None or a.prompt is not None:
        for row in rows:
            print(tok.detokenize(row))  # decoded together: the word boundary at the prompt's end stays
    width = max(len(r) for r in rows)
    return np.asarray([r + [tok.eod] * (width - len(r)) for r in rows], dtype=np.int64)


def main(argv: Optional[Sequence[str]] = None) -> np.ndarray:
    """The `generate` app; a `ValueError` (a bad checkpoint, prompt or setting) is its one-line error
    under `utils.cli.run` (`python -m megatron_csbp.generate`)."""
    filter_warnings()  # hide the library warnings a user cannot act on
    info_to_stderr()  # stdout is the generated text
    p = build_parser()
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if a.output is not None and not os.path.isdir(os.path.dirname(os.path.abspath(a.output))):
        p.error(f"--output {a.output}: its folder does not exist")
    from megatron_csbp.generation.lora import read_lora

    lora = read_lora(a.load, a.ckpt_step)  # a LoRA checkpoint: its recorded base with the adapters folded in
    info = _diffusion_gemma(lora[2], None) if lora else _diffusion_gemma(a.load, a.ckpt_step)
    out = run_diffusion_gemma(a, info, lora) if info is not None else run_bd3lm(a, lora)
    if a.output is not None:
        np.save(a.output, out)
        print(f"wrote {out.shape[0]} x {out.shape[1]} ids -> {a.output}")
    sys.stdout.flush()
    return out


def sample_text(argv: Sequence[str]) -> str:
    """What `python -m megatron_csbp.generate ARGV` prints after its "[checkpoint ...]" line, decoded
    in this process (the default run's samples, `training.demo.finish_demo`); a failure as one line."""
    import contextlib
    import io

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(list(argv))
    except (Exception, SystemExit) as exc:
        return f"(generation failed: {exc})"
    return out.getvalue().strip().split("\n", 1)[-1]
