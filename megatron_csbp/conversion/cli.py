"""`python -m megatron_csbp.convert {hf-to-megatron, megatron-to-hf, score, flags}`."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import numpy as np

from megatron_csbp.model.families import DTYPES, UnsupportedModelError, get_family
from megatron_csbp.utils.cli import ArgumentParser, filter_warnings


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_csbp.convert",
                                description="Hugging Face <-> Megatron torch_dist checkpoint conversion")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron", help="Hugging Face folder -> Megatron torch_dist release checkpoint")
    a.add_argument("--hf-path", required=True, help="folder with config.json and safetensors weights")
    b = sub.add_parser("megatron-to-hf", help="Megatron checkpoint (any parallel layout) -> Hugging Face folder")
    b.add_argument("--load", required=True, help="checkpoint folder (converted or saved by the trainer)")
    for sp, output, dtype in (
            (a, "new checkpoint folder (the trainer's --load)",
             "weight dtype of the checkpoint (default: the Hugging Face config's dtype)"),
            (b, "Hugging Face folder to write", "dtype of the written weights (default: the checkpoint's)")):
        sp.add_argument("--output", required=True, help=output)
        sp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=dtype)
    a.add_argument("--peft-adapter", default=None,
                   help="a PEFT LoRA adapter folder for the --hf-path model: --output becomes a LoRA checkpoint over "
                        "the base converted into OUTPUT/base (docs/lora.md)")
    b.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size")
    b.add_argument("--merge-lora", action="store_true",
                   help="a LoRA checkpoint: write the merged full model (W + alpha/rank * B A) instead of a PEFT "
                        "adapter folder")
    b.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer the model was trained with, if not where the checkpoint recorded it: a "
                        "sentencepiece .model file or a Hugging Face tokenizer folder (default: the checkpoint's "
                        "record; a DFlash drafter: its verifier's tokenizer)")
    c = sub.add_parser("score", help="logits of a Megatron checkpoint for token ids: next-token logits, or "
                                     "with --noisy-tokens the block-diffusion logits of the noisy rows")
    c.add_argument("--load", required=True, help="a checkpoint, or a LoRA checkpoint (its recorded base with the adapters)")
    c.add_argument("--tokens", required=True, help=".npy integer array [batch, seq] (the clean tokens)")
    c.add_argument("--output", required=True,
                   help=".npy float32 logits [batch, seq, vocab], with --noisy-tokens [batch, seq - P, vocab]")
    c.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    c.add_argument("--noisy-tokens", default=None,
                   help=".npy integer array [batch, seq] (or [batch, seq - P]): the noised copy; noisy block b "
                        "attends to the clean tokens before it and to itself, as in training")
    c.add_argument("--block-size", type=int, default=None, help="block (canvas) size B; must divide seq")
    c.add_argument("--prompt-length", type=int, default=0,
                   help="P: the first P tokens are prompt, with no noisy copy (a multiple of --block-size)")
    c.add_argument("--clean-attention", choices=("block_causal", "token_causal"), default=None,
                   help="clean stream mask (default: token_causal for DiffusionGemma, block_causal otherwise)")
    c.add_argument("--reset-attention-mask", action="store_true",
                   help="packed sequences: attention stays inside each document (ended by --eod-token-id)")
    c.add_argument("--reset-position-ids", action="store_true", help="positions restart at each document")
    c.add_argument("--eod-token-id", type=int, default=None, help="the EOD id that ends a document")
    d = sub.add_parser("flags", help="print the Megatron-LM flags that rebuild a checkpoint's model")
    d.add_argument("--load", required=True)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    filter_warnings()  # hide the library warnings a user cannot act on
    args = _parser().parse_args(argv)
    from megatron_csbp.checkpoint.drafter import is_drafter_checkpoint
    from megatron_csbp.checkpoint.files import read_checkpoint_model
    from megatron_csbp.conversion import api, drafter, lora as conversion_lora
    from megatron_csbp.generation.lora import read_lora
    from megatron_csbp.layout.packing import Packing

    lines = []  # what an export logs
    try:
        flag, src = {"megatron-to-hf": ("--load", getattr(args, "load", None)),
                     "hf-to-megatron": ("--hf-path", getattr(args, "hf_path", None))}.get(args.command, (None, None))
        out, into = os.path.realpath(getattr(args, "output", None) or "."), os.path.realpath(src or ".")
        if src and os.path.isdir(src) and os.path.commonpath([out, into]) == into:
            raise ValueError(f"--output {args.output} is {'the' if out == into else 'inside the'} {flag} folder {src}: "
                             "the written files would mix with the ones read; give a folder outside it")
        if args.command == "hf-to-megatron" and drafter.is_hf_drafter(args.hf_path):
            d = drafter.hf_to_megatron_drafter(args.hf_path, args.output, args.dtype)
            print(f"converted a DFlash drafter ({drafter.HF_MODEL_TYPE}: {d.num_layers} layers, hidden {d.hidden_size}, "
                  f"block {d.block_size}, target layers {d.target_layer_ids}) -> {args.output}")
            print("train it with: python -m megatron_csbp.dflash train --load " + args.output + " --features-path ...")
        elif args.command == "megatron-to-hf" and is_drafter_checkpoint(args.load):
            drafter.megatron_to_hf_drafter(args.load, args.output, args.dtype, args.tokenizer_model, log=lines.append)
            print(f"exported a DFlash drafter ({drafter.HF_MODEL_TYPE}) -> {args.output}")
        elif args.command == "hf-to-megatron" and args.peft_adapter:
            shape, lora = conversion_lora.import_peft_checkpoint(args.hf_path, args.peft_adapter, args.output, args.dtype)
            print(f"imported a PEFT adapter (rank {lora.rank}, alpha {lora.alpha}, {' '.join(lora.target_modules)}) "
                  f"over {shape.family} -> {args.output} (base: {os.path.join(args.output, 'base')})")
            print(f"train on with: --load {args.output} --pretrained-checkpoint {os.path.join(args.output, 'base')} "
                  f"--lora-rank {lora.rank} --lora-alpha {lora.alpha} --lora-target-modules {' '.join(lora.target_modules)}")
        elif args.command == "megatron-to-hf" and read_lora(args.load):
            shape = conversion_lora.export_lora_checkpoint(
                args.load, args.output, args.merge_lora, args.dtype, log=lines.append,
                max_shard_bytes=int(args.max_shard_size_gb * (1 << 30)), tokenizer_model=args.tokenizer_model)
            what = "merged with its LoRA adapters" if args.merge_lora else "LoRA adapters as a PEFT adapter"
            print(f"exported {shape.family} {what} -> {args.output}")
        elif args.command == "megatron-to-hf" and args.merge_lora:
            raise ValueError(f"--merge-lora: --load {args.load} is not a LoRA checkpoint (it holds a full model; export "
                             "it without --merge-lora)")
        elif args.command == "hf-to-megatron":
            shape = api.hf_to_megatron_checkpoint(args.hf_path, args.output, args.dtype)
            source = f" from {shape.diffusion_gemma['source']}" if shape.diffusion_gemma else ""
            print(f"converted {shape.family}{source} ({shape.num_layers} layers, hidden {shape.hidden_size}, "
                  f"vocab {shape.vocab_size}, {shape.params_dtype}) -> {args.output}")
            if not get_family(shape.family).has_megatron_lm_flags:
                print("train it with: python -m megatron_csbp.train --load " + args.output)
            else:
                print("Megatron flags that rebuild this model:")
                print("    " + api.flags_text(shape))
        elif args.command == "megatron-to-hf":
            shape = api.megatron_to_hf_checkpoint(args.load, args.output, args.dtype,
                                                  int(args.max_shard_size_gb * (1 << 30)), args.tokenizer_model,
                                                  log=lines.append)
            print(f"exported {shape.family} -> {args.output}")
        elif args.command == "score":
            noisy = None if args.noisy_tokens is None else np.load(args.noisy_tokens)
            packing = None
            if args.reset_attention_mask or args.reset_position_ids:
                if args.eod_token_id is None:
                    raise ValueError("--reset-attention-mask / --reset-position-ids need --eod-token-id N (the id "
                                     "that ends a document)")
                packing = Packing(args.eod_token_id, args.reset_attention_mask, args.reset_position_ids)
            elif args.eod_token_id is not None:
                raise ValueError("--eod-token-id is read only with --reset-attention-mask / --reset-position-ids")
            logits = api.score(args.load, np.load(args.tokens), args.batch_size, noisy, args.block_size,
                               args.prompt_length, args.clean_attention, packing)
            np.save(args.output, logits.astype(np.float32))
            print(f"wrote logits {tuple(logits.shape)} float32 -> {args.output}")
        elif args.command == "flags":
            print(api.flags_text(read_checkpoint_model(args.load).shape))
        if lines:  # an export's log, after its first line
            print("\n".join(lines))
    except (UnsupportedModelError, FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
