"""SFT data: jsonl of prompt/response pairs or conversations, with loss masks so prompts stay clean.

Accepted records (one per line):

    {"prompt": "...", "response": "..."}
    {"conversations": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"messages": [...same...]}            {"conversations": [{"from": "human"|"gpt", "value": "..."}]}

Rendering (plain text through the tokenizer): each turn is `"<Role>: " + content + "\\n"`, except that
an assistant turn's content is followed by EOD instead of the newline. Loss mask = 1 on assistant
content tokens and the EOD that ends them, 0 on everything else (system/user turns and the role
headers). The BD3-LM objective only ever masks (noises) supervised tokens, so prompts stay clean in
the noisy stream too. Samples are truncated or padded to `--seq-length`; padding is EOD with loss
mask 0 (it stays clean: the model sees where the answer stopped).

`pack=True` (`--pack-sequences`): conversations go first-fit into sequences of `--seq-length`
(each into the first sequence with room, in file order; one longer than a sequence is cut and
fills one alone), each keeps its own loss mask (prompt 0: clean; response 1: noised) and gets a
document id; the rest of a sequence is EOD padding (mask 0), a document of its own. With
`--reset-attention-mask` / `--reset-position-ids` those ids are the documents (a multi-turn
conversation holds several EODs but is one document). `packing_efficiency`: conversation tokens
over sequence tokens.
"""
from __future__ import annotations

import gzip
import os
import json
from typing import Dict, List, Optional, Tuple

import torch

_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "model": "assistant", "system": "system"}
_HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


def _turns(record: Dict, where: str) -> List[Tuple[str, str]]:
    if "prompt" in record and "response" in record:
        return [("user", record["prompt"]), ("assistant", record["response"])]
    conv = record.get("conversations", record.get("messages"))
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{where}: an SFT record needs prompt/response or a non-empty conversations/messages list")
    turns = []
    for t in conv:
        role = _ROLE_ALIASES.get(str(t.get("role", t.get("from", ""))).lower())
        content = t.get("content", t.get("value"))
        if role is None or not isinstance(content, str):
            raise ValueError(f"{where}: turn {t!r} needs role (system/user/assistant) and content")
        turns.append((role, content))
    if not any(r == "assistant" for r, _ in turns):
        raise ValueError(f"{where}: the conversation has no assistant turn (nothing to learn)")
    return turns


def render(record: Dict, tokenizer, where: str = "record") -> Tuple[List[int], List[int]]:
    """(token ids, loss mask) of one record, before truncation/padding."""
    ids: List[int] = []
    mask: List[int] = []
    for role, content in _turns(record, where):
        header = tokenizer.tokenize(_HEADERS[role])
        ids += header
        mask += [0] * len(header)
        if role == "assistant":
            body = tokenizer.tokenize(content) + [tokenizer.eod]
            ids += body
            mask += [1] * len(body)
        else:
            body = tokenizer.tokenize(content + "\n")
            ids += body
            mask += [0] * len(body)
    return ids, mask


def prompt_ids(prompt: str, tokenizer) -> List[int]:
    """The ids a model trained on this format should be given to answer `prompt`."""
    return tokenizer.tokenize(_HEADERS["user"]) + tokenizer.tokenize(prompt + "\n") + \
        tokenizer.tokenize(_HEADERS["assistant"])


def align_response(ids: List[int], mask: List[int], multiple: int, pad_id: int) -> Tuple[List[int], List[int]]:
    """Left-pad with `pad_id` (loss mask 0) so that the first supervised token sits on a multiple of
    `multiple`: DiffusionGemma's SFT canvases start at the response (Hugging Face: s_b = prompt
    length + b * B), and the plugin's blocks sit at multiples of B."""
    first = mask.index(1) if 1 in mask else 0
    pad = (-first) % multiple
    return [pad_id] * pad + ids, [0] * pad + mask


def first_fit(lengths: List[int], capacity: int) -> List[List[int]]:
    """Bins (lists of item indices, in order) of first-fit packing: each item into the first bin
    with room for it, else a new bin. O(items x bins); lengths must be <= capacity."""
    bins: List[List[int]] = []
    room: List[int] = []
    for i, n in enumerate(lengths):
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


class SFTDataset(torch.utils.data.Dataset):
    """`align_response_to=B` left-pads each sample (with `pad_id`, default the tokenizer's pad or
    EOD) so its response starts on a block boundary (`--objective diffusiongemma-sft`). `pack`:
    first-fit packing of conversations (module docstring); samples then carry `document_ids`."""

    def __init__(self, path: str, tokenizer, seq_length: int, align_response_to: Optional[int] = None,
                 pad_id: Optional[int] = None, pack: bool = False):
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad", None)
            pad_id = tokenizer.eod if pad_id is None or pad_id < 0 else pad_id
        opener = gzip.open if path.endswith(".gz") else open
        self.samples = []
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"--sft-data-path {path}:{n} is not JSON ({exc})") from None
                ids, mask = render(record, tokenizer, f"--sft-data-path {path}:{n}")
                if align_response_to:
                    ids, mask = align_response(ids, mask, align_response_to, pad_id)
                    if pack:  # packed: every conversation starts on a block edge, so its response does too
                        tail = (-len(ids)) % align_response_to
                        ids, mask = ids + [pad_id] * tail, mask + [0] * tail
                ids, mask = ids[:seq_length], mask[:seq_length]
                if pack:
                    if not any(mask):
                        raise ValueError(f"--sft-data-path {path}:{n}: the response starts after --seq-length "
                                         f"{seq_length} tokens (nothing supervised)")
                    self.samples.append((ids, mask))
                    continue
                pad = seq_length - len(ids)
                ids += [tokenizer.eod] * pad
                mask += [0] * pad
                if not any(mask):
                    raise ValueError(f"--sft-data-path {path}:{n}: the response starts after --seq-length "
                                     f"{seq_length} tokens (nothing supervised)")
                self.samples.append((torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.float32)))
        if not self.samples:
            raise ValueError(f"--sft-data-path {path} holds no records")
        self.packing_efficiency = None
        if pack:
            self._pack(tokenizer.eod, seq_length)

    def _pack(self, eod: int, seq_length: int) -> None:
        convs = self.samples
        bins = first_fit([len(ids) for ids, _ in convs], seq_length)
        self.samples = []
        for members in bins:
            ids, mask, doc = [], [], []
            for d, i in enumerate(members):
                ids += convs[i][0]
                mask += convs[i][1]
                doc += [d] * len(convs[i][0])
            pad = seq_length - len(ids)
            ids, mask, doc = ids + [eod] * pad, mask + [0] * pad, doc + [len(members)] * pad
            self.samples.append((torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.float32),
                                 torch.tensor(doc, dtype=torch.long)))
        self.conversations = len(convs)
        self.packing_efficiency = sum(len(ids) for ids, _ in convs) / (len(bins) * seq_length)

    def describe_packing(self) -> str:
        return (f" > SFT packing: {self.conversations} conversations into {len(self.samples)} sequences of "
                f"{self.samples[0][0].numel()} tokens (first fit), packing efficiency "
                f"{100 * self.packing_efficiency:.1f}% (conversation tokens / sequence tokens)")

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        sample = self.samples[int(idx) % len(self.samples)]
        out = {"tokens": sample[0].clone(), "loss_mask": sample[1].clone()}
        if len(sample) == 3:
            out["document_ids"] = sample[2].clone()
        return out


# ---- a small real SFT set from the shipped corpus -----------------------------------------------

SFT_ASSET = "pydoc_sft.jsonl"


def pydoc_sft_records(max_response_chars: int = 400) -> List[Dict[str, str]]:
    """Prompt/response pairs from the shipped Python-reference corpus: "What is <section title>?"
    answered by the section's first prose paragraph (cut at the last sentence end that fits)."""
    from megatron_csbp.data.corpus import load_records

    out = []
    for rec in load_records():
        paras = [p.strip() for p in rec["text"].split("\n\n") if p.strip()]
        if len(paras) < 2 or "\n" in paras[0]:
            continue
        title, answer = paras[0], next((p for p in paras[1:] if "::=" not in p and len(p) > 40), None)
        if answer is None:
            continue
        if len(answer) > max_response_chars:
            cut = answer[:max_response_chars]
            end = cut.rfind(". ")
            answer = cut[: end + 1] if end > 40 else cut
        out.append({"prompt": f"Explain this part of the Python language reference: {title}", "response": answer})
    return out


def default_sft_path() -> str:
    from megatron_csbp.data.corpus import ASSET_DIR

    return os.path.join(ASSET_DIR, SFT_ASSET)


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m megatron_csbp.data.sft [--output FILE]`: (re)build the shipped SFT set."""
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    import argparse

    p = argparse.ArgumentParser(prog="python -m megatron_csbp.data.sft", description=main.__doc__)
    p.add_argument("--output", default=default_sft_path())
    args = p.parse_args(argv)
    records = pydoc_sft_records()
    with open(args.output, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} prompt/response pairs -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
