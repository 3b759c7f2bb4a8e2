"""The shipped real-English corpus: the Python language reference topics of CPython's stdlib.

Source: `pydoc_data.topics` (the text behind `help("if")`, `help("assignment")`, ...), generated
from the CPython documentation and distributed with every CPython under the PSF License. It needs
no network. Each topic is cut into documents at its section headings; hard-wrapped prose
paragraphs are re-flowed onto one line, indented blocks (grammar, code) keep their line breaks.
Sections that several topics repeat verbatim are kept once, so a held-out split cannot leak.

The documents ship as `assets/pydoc_topics.jsonl.gz` (one JSON object per line: `id`, `topic`,
`text`) so that every machine trains on the same bytes whatever its Python version. They are
rebuilt by `python -m megatron_csbp.data.tokenizer build` (see docs/install.md).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import textwrap
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

ASSET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
CORPUS_FILE = "pydoc_topics.jsonl.gz"
DEFAULT_CORPUS = os.path.join(ASSET_DIR, CORPUS_FILE)

_UNDERLINE = re.compile(r"^([=\-*~])\1*$")


def _split_sections(topic_text: str) -> List[Tuple[str, List[str]]]:
    """(heading, body lines) of each section; headings are lines underlined with = - * ~."""
    lines = topic_text.split("\n")
    sections: List[Tuple[str, List[str]]] = [("", [])]  # the text before the first heading
    i = 0
    while i < len(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if lines[i].strip() and _UNDERLINE.match(nxt) and len(nxt) == len(lines[i]):
            sections.append((lines[i].strip(), []))
            i += 2
        else:
            sections[-1][1].append(lines[i])
            i += 1
    return [(heading, body) for heading, body in sections if heading or any(x.strip() for x in body)]


def _reflow(lines: Sequence[str]) -> str:
    """Blank-line separated paragraphs: prose joined onto one line, indented blocks kept."""
    paragraphs, current = [], []
    for line in list(lines) + [""]:
        if line.strip():
            current.append(line.rstrip())
            continue
        if current:
            if current[0].startswith((" ", "\t")):
                paragraphs.append(textwrap.dedent("\n".join(current)))
            else:
                paragraphs.append(" ".join(" ".join(x.split()) for x in current))
            current = []
    return "\n\n".join(paragraphs)


def extract_pydoc_documents(topics: Optional[Dict[str, str]] = None) -> List[Dict[str, str]]:
    """Documents (dicts with `id`, `topic`, `text`) from `pydoc_data.topics`, in sorted topic order."""
    if topics is None:
        from pydoc_data.topics import topics  # stdlib, PSF License
    docs, seen = [], set()
    for topic in sorted(topics):
        for k, (heading, body) in enumerate(_split_sections(topics[topic])):
            text = _reflow(body)
            if heading:
                text = heading + "\n\n" + text if text else heading
            # stray headings and one-line stubs; several topics repeat sections: keep the first, no train/eval leak
            if len(text) < 200 or text in seen:
                continue
            seen.add(text)
            docs.append({"id": f"{topic}/{k}", "topic": topic, "text": text})
    return docs


def write_documents(docs: Iterable[Dict[str, str]], path: str) -> None:
    """Byte-reproducible gzip jsonl (no timestamp, no file name in the gzip header)."""
    raw = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode("utf-8")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
        gz.write(raw)


def jsonl_lines(path: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) of each non-blank line of a UTF-8 text file, gzip when named .gz: the one
    jsonl(.gz) reader (the corpus, SFT data, `data.preprocess --input`)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        yield from ((n, line) for n, line in enumerate(f, 1) if line.strip())


def load_records(path: Optional[str] = None) -> List[Dict[str, str]]:
    """All records of a jsonl(.gz) corpus, the shipped one by default."""
    path = path or DEFAULT_CORPUS
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"corpus {path} not found; rebuild the shipped assets with `python -m megatron_csbp.data.tokenizer build`"
        )
    records = []
    for n, line in jsonl_lines(path):
        rec = json.loads(line)
        if not isinstance(rec.get("text"), str):
            raise ValueError(f"{path}:{n}: every record needs a string 'text' field")
        records.append(rec)
    if not records:
        raise ValueError(f"corpus {path} holds no documents")
    return records


def load_documents(path: Optional[str] = None) -> List[str]:
    """The texts of a jsonl(.gz) corpus with a `text` field, the shipped one by default."""
    return [r["text"] for r in load_records(path)]


def split_documents(docs: Sequence[str], eval_fraction: float = 0.1, seed: int = 0) -> Tuple[List[str], List[str]]:
    """Held-out split by document (a document is wholly train or wholly eval), deterministic in seed."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents for a held-out split, got {len(docs)}")
    keyed = sorted(range(len(docs)), key=lambda i: hashlib.sha256(f"{seed}:{docs[i]}".encode()).hexdigest())
    n_eval = min(len(docs) - 1, max(1, round(eval_fraction * len(docs))))
    eval_ids = set(keyed[:n_eval])
    return [d for i, d in enumerate(docs) if i not in eval_ids], [d for i, d in enumerate(docs) if i in eval_ids]


def pack_token_stream(token_lists: Iterable[Sequence[int]], seq_length: int, eod: int) -> torch.Tensor:
    """Concatenate documents, each followed by `eod`, and cut the stream into rows of `seq_length`.

    The incomplete tail (fewer than `seq_length` tokens) is dropped; an error is raised when not
    even one full row fits, rather than padding silently.
    """
    if seq_length <= 0:
        raise ValueError(f"--seq-length must be positive, got {seq_length}")
    stream = [int(i) for ids in token_lists for i in [*ids, eod]]  # each document followed by eod
    rows = len(stream) // seq_length
    if rows == 0:
        raise ValueError(f"{len(stream)} tokens cannot fill one sequence of --seq-length {seq_length}")
    return torch.tensor(np.asarray(stream[: rows * seq_length], dtype=np.int64)).view(rows, seq_length)


def unigram_entropy(token_lists: Iterable[Sequence[int]], vocab_size: int) -> float:
    """Entropy in nats/token of the empirical unigram distribution of the given tokens."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in token_lists:
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)
    total = counts.sum()
    if total == 0:
        raise ValueError("no tokens to measure")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())
