"""`python -m megatron_csbp.explain`: what one layout does per rank, drawn and printed.

Takes the trainer's layout flags (`--seq-length`, `--block-size`, `--context-parallel-size`,
`--block-parallel-size`, `--block-ownership`, `--attention-transport`, `--clean-attention`) plus
the K/V shape (`--num-query-groups`, `--kv-channels`, bytes per element) and, from the static
layout metadata alone (no process group, no model):

- per rank, the mask over the 2L logical rows [noisy ; clean] at tile granularity: tiles of the
  rank's query rows x every key, classified exactly (`PartialMask.tiles`) as computed full,
  computed partial or skipped (no allowed pair); the rows the rank holds are marked;
- the send/receive graph: bytes of K/V (forward) and of their gradients (backward) each rank sends
  to each other rank per layer (CP: K/V of every row; CSBP: clean rows within the ring; BP and a
  single rank: nothing);
- per rank: rows held, allowed pairs, bytes sent per layer, and the K/V bytes resident during one
  layer's attention (local rows + what arrives).

Text to stdout (and `--text FILE`), a PNG with `--png FILE`. Sizes: one [q tiles x k tiles] table
per rank (at 256K tokens, 16 ranks and 1024-row tiles: 32 x 512 tiles a rank, 16 x 16 KiB).
"""
from __future__ import annotations

import argparse
from typing import Dict, List

import torch

from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta, logical_rows
from megatron_csbp.layout.rows import PartialMask


def _logical(rows: RowMeta, L: int) -> torch.Tensor:
    return rows.position + L * rows.is_clean.long()


def explain(L: int, B: int, cp: int, bp: int, ownership: str = "mirrored", transport: str = "allgather",
            clean_attention: str = "block_causal", groups: int = 8, head_dim: int = 128, elem_bytes: int = 2,
            tile: int = 0) -> Dict:
    geometry = BlockGeometry(L, B, clean_attention)
    layout = SequenceLayout(geometry, cp, bp, ownership)
    P = layout.shard_group_size
    tile = tile or max(B, (2 * L) // 64)
    keys = logical_rows(L)
    row_bytes = 2 * groups * head_dim * elem_bytes  # K and V of one row
    ranks = []
    send = [[0] * P for _ in range(P)]  # bytes per layer, forward + backward, src -> dst
    for r in range(P):
        rows = layout.rows(r)
        order = torch.argsort(_logical(rows, L))
        q = rows.select(order)
        mask = PartialMask.of(q, keys, geometry)
        table = mask.tiles(tile, tile)
        state = table.full.long() * 2 + (table.occupied & ~table.full).long()  # 0 skip, 1 partial, 2 full
        held = torch.zeros(2 * L, dtype=torch.bool)
        held[_logical(rows, L)] = True
        ranks.append({"rank": r, "rows": len(rows), "noisy_rows": int((~rows.is_clean).sum()),
                      "allowed_pairs": mask.allowed_pairs(), "tiles": state, "held": held,
                      "q_logical": _logical(q, L)})
    kind = layout.kind
    for r in range(P):
        if kind == "cp":
            peers = [p for p in range(P) if p != r]
            moved = len(layout.rows(r))
        elif kind == "csbp":
            peers = [p for p in layout.ring_ranks(r) if p != r]
            moved = len(layout.ring_clean_rows(r)[layout.ring_of(r)[1]])
        else:
            peers, moved = [], 0
        if transport == "ring" and peers:
            # P-1 shifts of one chunk to the next member; gradients the other way around
            ring = layout.ring_ranks(r) if kind == "csbp" else list(range(P))
            i = ring.index(r)
            send[r][ring[(i + 1) % len(ring)]] += len(peers) * moved * row_bytes
            send[r][ring[(i - 1) % len(ring)]] += len(peers) * moved * row_bytes
            continue
        for p in peers:
            # forward: this rank's K/V rows to p; backward: p's gradients of them come back (p sends)
            send[r][p] += moved * row_bytes
            send[p][r] += moved * row_bytes
    for r in range(P):
        received = sum(send[p][r] for p in range(P)) // 2  # forward K/V that arrive
        ranks[r].update(sent_per_layer=sum(send[r]), kv_resident_bytes=ranks[r]["rows"] * row_bytes + received)
    return {"seq_length": L, "block_size": B, "cp": cp, "bp": bp, "kind": kind, "ownership": ownership,
            "transport": transport, "tile": tile, "row_bytes": row_bytes, "ranks": ranks, "send": send}


def render_text(e: Dict) -> str:
    MiB = 2 ** 20
    out = [f"layout {e['kind']} (CP {e['cp']}, BP {e['bp']}, {e['ownership']} ownership, {e['transport']}), "
           f"L = {e['seq_length']}, block {e['block_size']}, K+V {e['row_bytes']} bytes a row",
           "", "| rank | rows held | noisy rows | allowed pairs (M) | sent / layer (MiB, fwd+bwd) | K/V resident (MiB) "
           "| tiles full / partial / skipped |", "|---|---|---|---|---|---|---|"]
    for r in e["ranks"]:
        t = r["tiles"]
        out.append(f"| {r['rank']} | {r['rows']} | {r['noisy_rows']} | {r['allowed_pairs'] / 1e6:.2f} | "
                   f"{r['sent_per_layer'] / MiB:.2f} | {r['kv_resident_bytes'] / MiB:.2f} | "
                   f"{int((t == 2).sum())} / {int((t == 1).sum())} / {int((t == 0).sum())} |")
    out += ["", "send graph, MiB per layer (row: from, column: to; forward K/V + backward gradients)", ""]
    P = len(e["send"])
    out.append("| from \\ to | " + " | ".join(str(p) for p in range(P)) + " |")
    out.append("|---" * (P + 1) + "|")
    for r in range(P):
        out.append(f"| {r} | " + " | ".join(f"{e['send'][r][p] / MiB:.2f}" for p in range(P)) + " |")
    return "\n".join(out)


def render_png(explained: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#f2f2f2", "#f4a261", "#2a9d8f"])  # skipped, partial, full
    cols = max(len(e["ranks"]) for e in explained)
    fig, axes = plt.subplots(len(explained), cols, figsize=(2.6 * cols, 2.9 * len(explained)), squeeze=False)
    for i, e in enumerate(explained):
        L, T = e["seq_length"], e["tile"]
        for j in range(cols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(e["ranks"]):
                ax.axis("off")
                continue
            r = e["ranks"][j]
            ax.imshow(r["tiles"].numpy(), cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
            ax.axvline(L / T - 0.5, color="k", lw=0.5)  # noisy | clean keys
            sent = e["ranks"][j]["sent_per_layer"] / 2 ** 20
            ax.set_title(f"{e['kind'].upper()} rank {j}: {r['rows']} rows\n{r['allowed_pairs'] / 1e6:.2f}M pairs, "
                         f"{sent:.1f} MiB sent/layer", fontsize=7)
            if j == 0:
                ax.set_ylabel(f"{e['kind'].upper()} (CP {e['cp']}, BP {e['bp']})\nquery rows held", fontsize=7)
            ax.set_xlabel("keys: noisy | clean", fontsize=6)
    fig.suptitle("tiles of each rank's query rows x all keys: green computed full, orange computed partial, "
                 "grey skipped", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_csbp.explain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--block-parallel-size", type=int, default=1)
    p.add_argument("--block-ownership", choices=("mirrored", "contiguous"), default="mirrored")
    p.add_argument("--attention-transport", choices=("allgather", "ring"), default="allgather")
    p.add_argument("--clean-attention", choices=("block_causal", "token_causal"), default="block_causal")
    p.add_argument("--num-query-groups", type=int, default=8)
    p.add_argument("--kv-channels", type=int, default=128)
    p.add_argument("--bytes-per-element", type=int, default=2)
    p.add_argument("--tile", type=int, default=0, help="rows per drawn tile (default max(B, 2L/64))")
    p.add_argument("--compare", action="store_true",
                   help="draw CP, BP and CSBP of the same size side by side (size: max of the two parallel sizes)")
    p.add_argument("--png", default=None)
    p.add_argument("--text", default=None)
    a = p.parse_args(argv)
    common = dict(ownership=a.block_ownership, transport=a.attention_transport, clean_attention=a.clean_attention,
                  groups=a.num_query_groups, head_dim=a.kv_channels, elem_bytes=a.bytes_per_element, tile=a.tile)
    try:
        if a.compare:
            P = max(a.context_parallel_size, a.block_parallel_size)
            sizes = [(P, 1), (1, P), (P, P)]
        else:
            sizes = [(a.context_parallel_size, a.block_parallel_size)]
        explained = [explain(a.seq_length, a.block_size, cp, bp, **common) for cp, bp in sizes]
    except ValueError as exc:  # the layout's own rule, naming the flag
        p.error(str(exc))
    text = "\n\n".join(render_text(e) for e in explained)
    print(text)
    if a.text:
        with open(a.text, "w") as f:
            f.write(text + "\n")
    if a.png:
        render_png(explained, a.png)
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
