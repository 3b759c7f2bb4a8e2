"""`python -m megatron_csbp.data.inspect --sft-data-path FILE [tokenizer flags] [--chat-template ...]`:
each SFT record as the trainer renders it (docs/sft.md), supervised spans marked `[[...]]`; with
`--json` one JSON object per record, `{"line", "input_ids", "loss_mask"}`, before truncation and
padding."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import List, Optional, Sequence


def marked_text(tokenizer, ids: Sequence[int], mask: Sequence[int]) -> str:
    """The rendered text, each run of supervised tokens between [[ and ]]."""
    runs = itertools.groupby(zip(ids, mask), key=lambda pair: pair[1])
    texts = ((supervised, tokenizer.detokenize([int(i) for i, _ in run])) for supervised, run in runs)
    return "".join(f"[[{text}]]" if supervised else text for supervised, text in texts)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_csbp.data.megatron_data import TOKENIZER_TYPES, build_tokenizer
    from megatron_csbp.data.sft import chat_template, describe_rendering, read_records, render
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()
    p = argparse.ArgumentParser(prog="python -m megatron_csbp.data.inspect", description=__doc__)
    # the trainer's flags of the same names and meaning (config/options.py, a layer above this one)
    p.add_argument("--sft-data-path", required=True)
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None, help="default SentencePieceTokenizer")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    p.add_argument("--chat-template", default="auto", help="auto, none or a Jinja chat template file (docs/sft.md)")
    p.add_argument("--load", default=None, help="with HuggingFaceTokenizer: the checkpoint whose hf_assets is the "
                                                "default --tokenizer-model (the trainer's rule)")
    p.add_argument("--json", action="store_true", help="one JSON object per record: line, input_ids, loss_mask")
    a = p.parse_args(argv)
    kind = a.tokenizer_type or "SentencePieceTokenizer"
    model = a.tokenizer_model or (os.path.join(a.load, "hf_assets") if a.load and kind == "HuggingFaceTokenizer" else None)
    try:
        tok = build_tokenizer(kind, model, a.vocab_size)
        template = chat_template(tok, a.chat_template)
        if not a.json:
            print(describe_rendering(template).strip())
        for n, record, where in read_records(a.sft_data_path):
            ids, mask = render(record, tok, where, template)
            if a.json:
                print(json.dumps({"line": n, "input_ids": ids, "loss_mask": mask}))
            else:
                print(f"--- line {n}: {len(ids)} tokens, {sum(mask)} supervised")
                print(marked_text(tok, ids, mask))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
