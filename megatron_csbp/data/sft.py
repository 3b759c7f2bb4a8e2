"""SFT data: jsonl of prompt/response pairs or conversations (tools, tool calls, tool turns), with
loss masks so prompts stay clean. Formats, chat templates, masks: docs/sft.md.

A Hugging Face tokenizer's chat template renders records (`ChatTemplate`, `--chat-template`); the
plain rendering (no template) writes each turn as `"<Role>: " + content + "\\n"`, an assistant's
content followed by EOD instead. Loss mask = 1 on assistant content (and tool calls) with its
end-of-turn token (plain: the EOD), 0 on everything else. The BD3-LM objective only ever masks
(noises) supervised tokens, so prompts stay clean in the noisy stream too. Samples are truncated
or padded to `--seq-length`; padding is EOD with loss mask 0 (aligned samples of
diffusiongemma-sft: the pad id, `sft_pad_id`).

`pack=True` (`--pack-sequences`): conversations go first-fit into sequences of `--seq-length`
(each into the first sequence with room, in file order; one longer than a sequence is cut and
fills one alone), each keeps its own loss mask (prompt 0: clean; response 1: noised) and gets a
document id; the rest of a sequence is EOD padding (mask 0), a document of its own. With
`--reset-attention-mask` / `--reset-position-ids` those ids are the documents (a multi-turn
conversation holds several EODs but is one document). `packing_efficiency`: conversation tokens
over sequence tokens.
"""
from __future__ import annotations

import os
import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megatron_csbp.data.corpus import ASSET_DIR, jsonl_lines, load_records

_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "model": "assistant", "system": "system", "tool": "tool", "function": "tool"}
_HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


def messages_of(record: Dict, where: str) -> Tuple[List[Dict], Optional[List]]:
    """(messages with roles system/user/assistant/tool, tools or None) of one SFT record."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: an SFT record is a JSON object")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: tools must be a list of tool (function) schemas")
    if "prompt" in record and "response" in record:
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}], tools
    conv = record.get("conversations", record.get("messages"))
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{where}: an SFT record needs prompt/response or a non-empty conversations/messages list")
    out = []
    for t in conv:
        role = _ROLE_ALIASES.get(str(t.get("role", t.get("from", ""))).lower()) if isinstance(t, dict) else None
        content = t.get("content", t.get("value")) if role else None
        calls = t.get("tool_calls") if role == "assistant" else None
        if role is None or not (isinstance(content, str) or (calls and content is None)):
            raise ValueError(f"{where}: turn {t!r} needs role (system/user/assistant/tool) and content "
                             "(an assistant turn: content and/or tool_calls)")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"{where}: tool_calls of turn {t!r} must be a list")
        out.append({**{k: v for k, v in t.items() if k not in ("from", "value")}, "role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: the conversation has no assistant turn (nothing to learn)")
    return out, tools


def render(record: Dict, tokenizer, where: str = "record", template: Optional["ChatTemplate"] = None
           ) -> Tuple[List[int], List[int]]:
    """(token ids, loss mask) of one record, before truncation/padding: through `template`
    (`ChatTemplate`) or, without one, the plain rendering (module docstring)."""
    return render_messages(*messages_of(record, where), tokenizer, where, template)


def turn_samples(record: Dict, tokenizer, where: str = "record", template: Optional["ChatTemplate"] = None
                 ) -> List[Tuple[List[int], List[int]]]:
    """`--sft-trajectory-turns all`: one (ids, loss mask) per assistant turn i, the record up to
    that turn rendered as the model is prompted there (messages[:i + 1]), only turn i supervised."""
    messages, tools = messages_of(record, where)
    return [render_messages(messages[: i + 1], tools, tokenizer, where, template, last_turn=True)
            for i, m in enumerate(messages) if m["role"] == "assistant"]


def render_messages(messages, tools, tokenizer, where: str, template: Optional["ChatTemplate"] = None,
                    last_turn: bool = False) -> Tuple[List[int], List[int]]:
    """`render` of messages; `last_turn`: only the last message's (an assistant turn's) tokens supervised."""
    if template is not None:
        return template.render(messages, tools, where, last_turn)
    if tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        raise ValueError(f"{where}: tools, tool calls and tool turns need a chat template (--chat-template auto with "
                         "a Hugging Face tokenizer that has one, or --chat-template FILE)")
    ids: List[int] = []
    mask: List[int] = []
    for k, m in enumerate(messages):
        header = tokenizer.tokenize(_HEADERS[m["role"]])
        if m["role"] == "assistant":
            body, supervised = tokenizer.tokenize(m["content"]) + [tokenizer.eod], not last_turn or k == len(messages) - 1
        else:
            body, supervised = tokenizer.tokenize(m["content"] + "\n"), False
        ids += header + body
        mask += [0] * len(header) + [int(supervised)] * len(body)
    return ids, mask


_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplate:
    """SFT records through a Hugging Face tokenizer's chat template (`apply_chat_template`): the
    ids are exactly the template's; the loss mask is 1 on each assistant turn's content and tool
    calls with its end-of-turn token. From the template's `{% generation %}` markers where it has
    them, else by rendering prefixes: turn i spans from the end of messages[:i] rendered with the
    generation prompt to the end of messages[:i + 1] (trailing whitespace left out)."""

    def __init__(self, hf_tokenizer, template: Optional[str] = None, source: str = "the tokenizer's"):
        self.tok, self.template, self.source = hf_tokenizer, template, source
        text = hf_tokenizer.get_chat_template(template) if template is None else template
        self.markers = bool(_GENERATION_MARKER.search(text))

    def describe(self) -> str:
        how = "its generation markers" if self.markers else "rendered prefixes"
        return f" > SFT data: rendered with {self.source} chat template (loss masks from {how})"

    def _apply(self, messages, tools, **options):
        return self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template, **options)

    def text(self, messages, tools=None, generation_prompt: bool = False) -> str:
        return self._apply(messages, tools, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt(self, messages, tools=None) -> List[int]:
        """The ids a model trained on this template is given to answer after `messages`."""
        enc = self._apply(messages, tools, tokenize=True, return_dict=True, add_generation_prompt=True)
        return list(enc["input_ids"])

    def render(self, messages, tools, where: str, last_turn: bool = False) -> Tuple[List[int], List[int]]:
        """`last_turn`: only the last message's tokens are supervised (`turn_samples`)."""
        try:
            enc = self._apply(messages, tools, tokenize=True, return_dict=True,
                              return_assistant_tokens_mask=self.markers)
            ids = list(enc["input_ids"])
            if self.markers:
                mask = list(enc["assistant_masks"])
                if last_turn:
                    head = len(self.prompt(messages[:-1], tools))
                    mask = [0] * head + mask[head:]
            else:
                mask = self._prefix_mask(messages, tools, ids, where, last_turn)
        except ValueError:
            raise
        except Exception as exc:  # jinja's TemplateError, or what a template's own raise_exception says
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{where}: the chat template cannot render this record ({first})") from None
        if not any(mask):
            raise ValueError(f"{where}: the chat template marks no assistant token (nothing to learn)")
        return ids, [int(bool(m)) for m in mask]

    def _prefix_mask(self, messages, tools, ids, where: str, last_turn: bool = False) -> List[int]:
        full = self.text(messages, tools)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or (last_turn and i < len(messages) - 1):
                continue
            head = self.text(messages[:i], tools, generation_prompt=True)
            turn = self.text(messages[: i + 1], tools).rstrip()
            if not (turn.startswith(head) and full.startswith(turn)):
                raise ValueError(f"{where}: the chat template renders turn {i} differently once later turns follow, so "
                                 "its loss mask cannot be derived from prefixes; add {% generation %} markers to the "
                                 "template (--chat-template FILE)")
            spans.append((len(head), len(turn)))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) != ids:
            raise ValueError(f"{where}: the rendered text tokenizes to other ids than apply_chat_template gives")
        return [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]


def chat_template(tokenizer, spec: Optional[str] = "auto") -> Optional[ChatTemplate]:
    """`--chat-template`: auto (the Hugging Face tokenizer's own template, None without one), none,
    or a Jinja template file or text (a Hugging Face tokenizer needed)."""
    if spec in (None, "none"):
        return None
    hf = hugging_face_tokenizer(tokenizer)
    if spec == "auto":
        return ChatTemplate(hf) if hf is not None and getattr(hf, "chat_template", None) else None
    check_chat_template(spec, hf is not None)
    if is_template_text(spec):
        return ChatTemplate(hf, spec, "the --chat-template")
    return ChatTemplate(hf, Path(spec).read_text(encoding="utf-8"), spec)


def is_template_text(spec: str) -> bool:
    """--chat-template holds the Jinja text itself (Megatron-LM's meaning of the flag), not a file."""
    return "{{" in spec or "{%" in spec


def check_chat_template(spec: Optional[str], hugging_face: bool) -> None:
    """--chat-template FILE names a file, and the tokenizer is a Hugging Face one."""
    if spec in (None, "auto", "none"):
        return
    if not hugging_face:
        raise ValueError(f"--chat-template {spec}: a template file needs --tokenizer-type HuggingFaceTokenizer")
    if not is_template_text(spec) and not os.path.isfile(spec):
        raise ValueError(f"--chat-template {spec}: no such file (give auto, none, a Jinja chat template file or its "
                         "text)")


def describe_rendering(template: Optional[ChatTemplate]) -> str:
    """The log line saying how SFT records become tokens."""
    return template.describe() if template is not None else \
        " > SFT data: plain rendering (\"User: \" ... \"Assistant: \" ... EOD; no chat template)"


def prompt_ids(prompt: str, tokenizer, template: Optional[ChatTemplate] = None) -> List[int]:
    """The ids a model trained on this format should be given to answer `prompt`."""
    turn = [{"role": "user", "content": prompt}]
    if template is not None:
        return template.prompt(turn)
    return render_messages(turn, None, tokenizer, "--prompt")[0] + tokenizer.tokenize(_HEADERS["assistant"])


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
    bins, room = [], []  # item indices, room left
    for i, n in enumerate(lengths):
        b = next((b for b, r in enumerate(room) if n <= r), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= n
    return bins


def read_records(path: str) -> Iterator[Tuple[int, Dict, str]]:
    """(line number, record, "--sft-data-path FILE:LINE") of each non-empty line of an SFT jsonl."""
    for n, line in jsonl_lines(path):
        where = f"--sft-data-path {path}:{n}"
        try:
            yield n, json.loads(line), where
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON ({exc})") from None


def sft_pad_id(tokenizer) -> int:
    """What aligned SFT samples (`align_response_to`) pad with: the tokenizer's own pad (the one
    under `MegatronTokenizerAdapter`, whose `pad` Megatron's datasets read), else its EOD."""
    pad = getattr(getattr(tokenizer, "tokenizer", tokenizer), "pad", None)
    return tokenizer.eod if pad is None or pad < 0 else int(pad)


def hugging_face_tokenizer(tokenizer):
    """The transformers tokenizer under the trainer's tokenizer (None: not a Hugging Face one)."""
    return getattr(getattr(tokenizer, "tokenizer", tokenizer), "tok", None)


class SFTDataset(torch.utils.data.Dataset):
    """`align_response_to=B` left-pads each sample (with `sft_pad_id`) so its
    response starts on a block boundary (`--objective diffusiongemma-sft`). `pack`: first-fit
    packing of conversations (module docstring); samples then carry `document_ids`.
    `trajectory_turns="all"`: one conversation per assistant turn (`turn_samples`); an item is then
    a trajectory, [T, L] rows (T: the most rows a trajectory needs, the rest empty: padding, mask
    0), so its turns share an optimizer step; packed, a trajectory's turns are packed together."""

    def __init__(self, path: str, tokenizer, seq_length: int, align_response_to: Optional[int] = None,
                 pack: bool = False, template: Optional[ChatTemplate] = None, trajectory_turns: str = "record"):
        pad_id = sft_pad_id(tokenizer)
        fill = pad_id if align_response_to else tokenizer.eod  # aligned (diffusiongemma-sft): padding is no AR pair
        groups = []  # per record: its conversations [(ids, mask)]
        for _, record, where in read_records(path):
            convs = (turn_samples(record, tokenizer, where, template) if trajectory_turns == "all"
                     else [render(record, tokenizer, where, template)])
            groups.append([self._fit(ids, mask, seq_length, align_response_to, pad_id, pack, where)
                           for ids, mask in convs])
        if not groups:
            raise ValueError(f"--sft-data-path {path} holds no records")
        self.conversations = sum(len(g) for g in groups)
        if not pack:
            rows = [[self._row(ids, mask, fill, seq_length) for ids, mask in g] for g in groups]
        elif trajectory_turns == "all":
            rows = [self._pack(g, fill, seq_length) for g in groups]
        else:
            rows = [[r] for r in self._pack([c for g in groups for c in g], fill, seq_length)]
        self.sequences = sum(len(r) for r in rows)
        tokens = sum(len(ids) for g in groups for ids, _ in g)
        self.packing_efficiency = tokens / (self.sequences * seq_length) if pack else None
        if trajectory_turns != "all":
            self.samples = [r[0] for r in rows]
            return
        width = max(len(r) for r in rows)
        empty = self._row([], [], fill, seq_length) + ((torch.zeros(seq_length, dtype=torch.long),) if pack else ())
        self.samples = [tuple(torch.stack(parts) for parts in zip(*(r + [empty] * (width - len(r))))) for r in rows]

    @staticmethod
    def _fit(ids, mask, seq_length, align_response_to, pad_id, pack, where):
        """One conversation aligned and cut to `seq_length` (padding comes later)."""
        if align_response_to:
            ids, mask = align_response(ids, mask, align_response_to, pad_id)
            if pack:  # packed: every conversation starts on a block edge, so its response does too
                tail = (-len(ids)) % align_response_to
                ids, mask = ids + [pad_id] * tail, mask + [0] * tail
        ids, mask = ids[:seq_length], mask[:seq_length]
        if not any(mask):
            raise ValueError(f"{where}: the response starts after --seq-length {seq_length} tokens (nothing supervised)")
        return ids, mask

    @staticmethod
    def _row(ids, mask, fill, seq_length):
        pad = seq_length - len(ids)
        return (torch.tensor(ids + [fill] * pad, dtype=torch.long),
                torch.tensor(mask + [0] * pad, dtype=torch.float32))

    @staticmethod
    def _pack(convs, fill: int, seq_length: int) -> list:
        rows = []
        for members in first_fit([len(ids) for ids, _ in convs], seq_length):
            ids = [t for i in members for t in convs[i][0]]
            mask = [t for i in members for t in convs[i][1]]
            doc = [d for d, i in enumerate(members) for _ in convs[i][0]]
            doc += [len(members)] * (seq_length - len(doc))  # the padding: a document of its own
            rows.append(SFTDataset._row(ids, mask, fill, seq_length) + (torch.tensor(doc, dtype=torch.long),))
        return rows

    def describe_packing(self) -> str:
        return (f" > SFT packing: {self.conversations} conversations into {self.sequences} sequences of "
                f"{self.samples[0][0].shape[-1]} tokens (first fit), packing efficiency "
                f"{100 * self.packing_efficiency:.1f}% (conversation tokens / sequence tokens)")

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        sample = self.samples[int(idx) % len(self.samples)]  # (tokens, loss mask[, document ids])
        return {k: t.clone() for k, t in zip(("tokens", "loss_mask", "document_ids"), sample)}


# ---- a small real SFT set from the shipped corpus -----------------------------------------------

SFT_ASSET = "pydoc_sft.jsonl"


def pydoc_sft_records(max_response_chars: int = 400) -> List[Dict[str, str]]:
    """Prompt/response pairs from the shipped Python-reference corpus: "What is <section title>?"
    answered by the section's first prose paragraph (cut at the last sentence end that fits)."""
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
    Path(args.output).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {len(records)} prompt/response pairs -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
