"""The planner's packing input: a document-length distribution and the one packed sample the
planner counts (`--doc-length N` or `--doc-length-histogram FILE`). Torch-free; the one parser of
a length histogram and the one packing rule of the project's planning tools (the planner and
`python -m megatron_csbp.bench.packing` both draw through `pack_starts`).

The sample: documents laid from position 0 in order until the sequence of L positions is full,
the last one cut at L (as Megatron's GPTDataset packs documents into a sample). With
`--doc-length N` every document has N tokens; with a histogram, each next length is drawn from it
(weights = the counts) by numpy's PCG64 generator seeded with `--doc-length-seed` (default 0), so
a plan is reproducible. Kept: the document starts, at most L ints (at 256K tokens, the long-tailed
SFT histogram of docs/benchmarks/sft_doc_lengths.txt: ~330 documents; worst case, 1-token
documents, 256K ints = 2 MiB)."""
from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

import numpy as np


def read_histogram(path: str) -> Dict[int, float]:
    """Document-length histogram: JSON {"length": count, ...} or lines "length count" ('#' comments)."""
    flag = f"--doc-length-histogram {path}"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read it ({e.strerror})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        raw = None
    if raw is None:
        hist = {}
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                parts = line.split()
                if len(parts) != 2:
                    raise ValueError(f"{flag}:{n}: expected 'length count', got {line!r}")
                try:
                    hist[int(parts[0])] = float(parts[1])
                except ValueError:
                    raise ValueError(f"{flag}:{n}: expected an integer length and a number, got {line!r}") from None
    elif not isinstance(raw, dict):
        raise ValueError(f"{flag}: JSON must be an object {{length: count}}")
    else:
        try:
            hist = {int(k): float(v) for k, v in raw.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"{flag}: lengths must be integers and counts numbers ({e})") from None
    if not hist or any(k <= 0 or v < 0 for k, v in hist.items()) or sum(hist.values()) <= 0:
        raise ValueError(f"{flag}: lengths must be positive and counts non-negative, not all 0")
    return hist


def pack_starts(seq_length: int, doc_length: Optional[int] = None, histogram: Optional[Dict[int, float]] = None,
                seed: int = 0) -> Tuple[int, ...]:
    """First position of every document of one packed sample of `seq_length` positions (module
    docstring: the packing rule)."""
    if (doc_length is None) == (histogram is None):
        raise ValueError("give one of --doc-length or --doc-length-histogram")
    if doc_length is not None:
        if doc_length <= 0:
            raise ValueError(f"--doc-length must be positive, got {doc_length}")
        return tuple(range(0, seq_length, doc_length))
    if seed < 0:
        raise ValueError(f"--doc-length-seed must be >= 0, got {seed}")
    lengths = np.array(sorted(histogram), dtype=np.int64)
    weights = np.array([histogram[int(k)] for k in lengths], dtype=np.float64)
    rng = np.random.default_rng(seed)
    starts, p = [], 0
    while p < seq_length:
        starts.append(p)
        p += int(lengths[rng.choice(len(lengths), p=weights / weights.sum())])
    return tuple(starts)
