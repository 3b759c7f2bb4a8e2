"""`python -m megatron_csbp.dflash {prepare-features,train,export,evaluate}`: DFlash drafters.

- `prepare-features`: the verifier's hidden states at `--target-layer-ids` over an indexed dataset,
  each document run on its own, in resumable memory-mapped shards; under torchrun the verifier is
  tensor-parallel with transformers' TP plan (data/features.py).
- `train`: `python -m megatron_csbp.train --objective dflash` (the `Trainer`) with this command's
  older defaults; single / CP / BP / CSBP (model/dflash.py, objectives/dflash.py).
- `export`: a drafter checkpoint (an import, or the trainer's newest torch_dist checkpoint) ->
  Hugging Face `MuseGlimmerAssistantModel` directory.
- `evaluate`: transformers' DFlash decoding against the verifier alone on held-out documents
  (identical outputs, tokens per verifier and drafting step) beside the training-time estimator
  and the bound docs/dflash.md derives (generation/speculative.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


from megatron_csbp.utils.cli import ArgumentParser, filter_warnings, run


# ---- prepare-features ----------------------------------------------------------------------------

def verifier_hf_path(hf_path: Optional[str] = None, load: Optional[str] = None) -> str:
    """The verifier as a Hugging Face directory: `hf_path`, or the Megatron checkpoint `load`
    exported to a temporary directory (process-local: under torchrun every rank exports its own
    copy, so no shared file system is assumed)."""
    if (hf_path is None) == (load is None):
        raise ValueError("give the verifier as --hf-path (Hugging Face) or --load (Megatron checkpoint), one of them")
    if load is None:
        return hf_path
    import tempfile

    from megatron_csbp.conversion.api import megatron_to_hf_checkpoint

    tmp = tempfile.mkdtemp(prefix="verifier_hf_")
    megatron_to_hf_checkpoint(load, tmp, dtype="float32")
    return tmp


# ---- command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_csbp.dflash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("prepare-features", help="capture verifier hidden states over an indexed dataset")
    f.add_argument("--hf-path", default=None, help="verifier: Hugging Face checkpoint directory")
    f.add_argument("--load", default=None, help="verifier: Megatron checkpoint converted or trained here")
    f.add_argument("--data-path", required=True, help="Megatron indexed dataset prefix (PREFIX.bin / PREFIX.idx)")
    f.add_argument("--seq-length", type=int, required=True)
    f.add_argument("--target-layer-ids", type=int, nargs="+", required=True, help="0-based verifier decoder layers")
    f.add_argument("--output", required=True)
    f.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    f.add_argument("--max-sequences", type=int, default=None)
    f.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    f.add_argument("--eod-token-id", type=int, default=None, help="appended to documents that lack it")
    f.add_argument("--tokenizer-model", default=None, help="sentencepiece model whose EOD is appended")
    f.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="under torchrun: the verifier tensor-parallel over this many ranks (transformers' TP plan; "
                        "must divide the number of ranks and the verifier's attention heads), the remaining "
                        "factor capturing disjoint shards; default: all ranks")
    f.add_argument("--no-progress-bar", action="store_true")

    sub.add_parser("train", add_help=False, help="train a drafter: python -m megatron_csbp.train --objective dflash "
                   "(this subcommand hands its flags over, with its older defaults)")
    e = sub.add_parser("export", help="drafter checkpoint -> Hugging Face MuseGlimmerAssistantModel")
    e.add_argument("--load", required=True)
    e.add_argument("--output", required=True)
    e.add_argument("--tokenizer-model", default=None,
                   help="the verifier's tokenizer folder (default: the one the drafter's checkpoint recorded)")

    v = sub.add_parser("evaluate", help="transformers' DFlash decoding vs the verifier alone, held-out prompts")
    v.add_argument("--verifier", required=True)
    v.add_argument("--drafter", required=True, help="exported Hugging Face drafter")
    v.add_argument("--features-path", default=None, help="prompts: the last --eval-sequences captured sequences")
    v.add_argument("--prompts-data-path", default=None,
                   help="prompts instead from the last --eval-sequences documents of this indexed dataset")
    v.add_argument("--eval-sequences", type=int, default=8)
    v.add_argument("--prompt-length", type=int, default=32)
    v.add_argument("--max-new-tokens", type=int, default=48)
    v.add_argument("--logit-tolerance", type=float, default=1e-3,
                   help="relative bound on the logit gap between the estimate's drafter forward and serving's "
                        "(eps = this x max(1, max |logit|)); slots with a top-2 margin within 2 eps are uncertain")
    return p


def check_args(a) -> None:
    if a.command == "prepare-features" and (a.seq_length <= 0 or a.shard_size <= 0):
        raise ValueError("--seq-length and --shard-size must be positive")
    if a.command == "evaluate" and not (a.features_path or a.prompts_data_path):
        raise ValueError("evaluate needs --features-path or --prompts-data-path (where the prompts come from)")
    if a.command == "evaluate" and not a.logit_tolerance > 0:
        raise ValueError(f"--logit-tolerance must be > 0, got {a.logit_tolerance}")
    if a.command == "evaluate" and a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")


#: `dflash train`'s defaults where the trainer's differ (architecture ones only without --load:
#: a loaded drafter's shape decides those)
TRAIN_DEFAULTS = ["--lr", "3e-3", "--train-iters", "100", "--weight-decay", "0", "--adam-beta2", "0.95",
                  "--micro-batch-size", "1", "--log-interval", "10", "--lr-decay-style", "constant"]
ARCHITECTURE_DEFAULTS = ["--num-layers", "1", "--block-size", "8"]


def train(argv: Sequence[str]):
    """`dflash train ...`: `python -m megatron_csbp.train --objective dflash ...` (the `Trainer`)."""
    from megatron_csbp.training.loop import main as train_main

    argv = list(argv)
    defaults = TRAIN_DEFAULTS + ([] if "--load" in argv else ARCHITECTURE_DEFAULTS)
    return train_main(defaults + ["--objective", "dflash"] + argv)


def main(argv: Optional[Sequence[str]] = None):
    filter_warnings()  # hide the library warnings a user cannot act on
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return train(argv[1:])
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        check_args(a)
    except ValueError as exc:
        parser.error(str(exc))
    if a.command == "prepare-features":
        from megatron_csbp.data.features import prepare_features

        result = prepare_features(a, verifier_hf_path(a.hf_path, a.load))
        print(json.dumps(result))
        return result
    if a.command == "export":  # the drafter as a Hugging Face folder, with its verifier's tokenizer
        from megatron_csbp.conversion.drafter import megatron_to_hf_drafter

        megatron_to_hf_drafter(a.load, a.output, tokenizer_model=a.tokenizer_model, log=print)
        print(a.output)
        return a.output
    from megatron_csbp.attention.kernels.capability import info_to_stderr
    from megatron_csbp.generation.speculative import evaluate_cli

    info_to_stderr()  # stdout is the evaluation's JSON
    return evaluate_cli(a)


if __name__ == "__main__":
    sys.exit(run(main))
