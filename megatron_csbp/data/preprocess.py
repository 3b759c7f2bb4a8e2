"""jsonl -> Megatron indexed dataset (.bin/.idx), in the spirit of Megatron-LM's
`tools/preprocess_data.py`:

    python -m megatron_csbp.data.preprocess --input docs.jsonl --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod

writes `data/corpus_text_document.bin/.idx` (one document per jsonl line, field `--json-keys`,
default `text`), readable by `megatron.core.datasets.indexed_dataset.IndexedDataset` and usable as
`--data-path data/corpus_text_document`. `--input` may also be the shipped corpus (`shipped`).

For a converted Hugging Face model, tokenize with its own tokenizer (transformers' AutoTokenizer from
the folder `convert hf-to-megatron` copies beside the checkpoint):

    python -m megatron_csbp.data.preprocess --input shipped --output-prefix data/qwen --append-eod \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model ckpt/qwen3/hf_assets
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from typing import Iterable, Optional, Sequence

import torch

from megatron_csbp.data.corpus import DEFAULT_CORPUS, jsonl_lines


def _lines(path: str):
    """(line number, line) of the non-blank lines of a UTF-8 text file (gzip by its .gz name); a file that
    is not one is named."""
    try:
        yield from jsonl_lines(path)
    except (UnicodeDecodeError, gzip.BadGzipFile) as exc:
        what = f"byte 0x{exc.object[exc.start]:02x}" if isinstance(exc, UnicodeDecodeError) else "not gzip data"
        raise ValueError(f"--input {path} is not UTF-8 text ({what}); --input is jsonl(.gz), one "
                         "{\"text\": \"...\"} object per document") from None


def iter_jsonl(path: str, key: str) -> Iterable[str]:
    for lineno, line in _lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--input {path}: line {lineno} is not JSON ({exc}); --input is jsonl, one "
                             f'{{"{key}": "..."}} object per document') from None
        if key not in record:
            raise ValueError(f"--input {path}: line {lineno} has no key {key!r} (see --json-keys)")
        yield record[key]


def preprocess(input_path: str, output_prefix: str, tokenizer, json_key: str = "text",
               append_eod: bool = True) -> str:
    """Tokenize every document and write `{output_prefix}_{json_key}_document.bin/.idx`."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = f"{output_prefix}_{json_key}_document"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    # written under temporary names and renamed at the end: a failed or interrupted run leaves no
    # .bin without its .idx (nor a stale pair half replaced)
    tmp = f"{prefix}.tmp-{os.getpid()}"
    try:
        builder = IndexedDatasetBuilder(tmp + ".bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
        n = 0
        for text in iter_jsonl(input_path, json_key):
            ids = list(tokenizer.tokenize(text)) + ([tokenizer.eod] if append_eod else [])
            if not ids:
                continue
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            n += 1
        if n == 0:
            raise ValueError(f"--input {input_path} has no non-empty documents")
        builder.finalize(tmp + ".idx")
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
    return prefix


def main(argv: Optional[Sequence[str]] = None) -> str:
    from megatron_csbp.data.megatron_data import TOKENIZER_TYPES, build_tokenizer
    from megatron_csbp.utils.cli import ArgumentParser, filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on

    # errors are one line (no usage dump before them), as in every command of the package
    p = ArgumentParser(prog="python -m megatron_csbp.data.preprocess", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="jsonl(.gz) file, or 'shipped' for the shipped corpus")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model (default: the shipped one), or for HuggingFaceTokenizer a local "
                        "tokenizer folder (e.g. a converted checkpoint's hf_assets)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: Megatron-LM's meaning on the installed megatron-core (0.16: data ids "
                        "0..V-1 plus EOD V; 0.19: V ids, data ids 0..V-2, EOD V-1); --append-eod appends the EOD")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=1, help="accepted for Megatron-LM compatibility")
    a = p.parse_args(argv)
    if a.input == "shipped":
        a.input = DEFAULT_CORPUS
    if not os.path.exists(a.input):
        p.error(f"--input {a.input} does not exist")
    out = None
    try:
        tok = build_tokenizer(a.tokenizer_type, a.tokenizer_model, a.vocab_size)
        for key in a.json_keys:
            out = preprocess(a.input, a.output_prefix, tok, key, a.append_eod)
            print(f"wrote {out}.bin and {out}.idx")
    except ValueError as exc:
        p.error(str(exc))
    return out


if __name__ == "__main__":
    from megatron_csbp.utils.cli import run

    sys.exit(run(main))
