"""Explain a layout: per rank, the rows it holds, the mask's tiles its queries compute, and who
sends it which K/V, from the layout metadata alone (static; no process group, one process for a
P-rank layout).

  python -m megatron_csbp.explain --seq-length 256 --block-size 32 --context-parallel-size 4 \\
      --block-parallel-size 4 [--num-query-groups 8 --kv-channels 128] [--out DIR]
  python -m megatron_csbp.explain --recipe examples/recipes/nemotron_diffusion_14b_256k_csbp.yaml --out DIR

Takes the trainer's flags (others are ignored) or a recipe. Prints, per rank: rows held (noisy
blocks, clean ranges), allowed (query, key) pairs, K/V bytes sent and received per layer and pass
(full-attention layers), K/V held from other ranks per layer; writes `explain.txt` and, with
matplotlib, `explain.png` (per rank: the tiles of its queries x the 2L logical keys [noisy ; clean],
computed full / computed partial / skipped, and the keys it holds; beside them the send/receive
graph with bytes per layer).

Where the numbers come from: rows from `layout.SequenceLayout.rows`; tiles and pairs from
`layout.rows.PartialMask` (the tile table the kernels use); bytes from the exchange each layout
runs (`attention/strategies.py`): CP all-gathers every rank's rows, CSBP a ring's clean rows, BP
nothing; K/V per row 2 x G x d x s (tests/test_explain.py checks them against the planner's
`planner/work.py` and a dense brute force). Sizes: per rank O(rows + tiles); at 256K tokens on 16
ranks, with the default of at most 64 key tiles, 32K rows and 64 x 4 tiles per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, logical_rows
from megatron_csbp.layout.rows import PartialMask, index_runs


@dataclass
class RankView:
    rank: int
    noisy_blocks: List[int]
    clean_ranges: List[Tuple[int, int]]
    rows: int
    noisy_rows: int
    clean_rows: int
    allowed_pairs: int
    tiles: Optional[object] = None  # TileTable of the rank's rows x the 2L logical keys
    held_keys: Optional[object] = None  # bool [2L]: logical keys this rank holds
    sends: Dict[int, int] = field(default_factory=dict)  # dst rank -> bytes per layer per pass
    recv: Dict[int, int] = field(default_factory=dict)
    kv_row_bytes: int = 0

    @property
    def kv_held_bytes(self) -> int:
        """K/V one layer keeps for backward: the rank's own rows and what it received."""
        return self.rows * self.kv_row_bytes + self.bytes_received

    @property
    def bytes_sent(self) -> int:
        return sum(self.sends.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.recv.values())


def _ranges(positions) -> List[Tuple[int, int]]:
    return [(s.start, s.stop) for s in index_runs(torch.tensor(sorted(int(x) for x in positions), dtype=torch.long))]


def explain(seq_length: int, block_size: int, cp: int, bp: int, schedule: str = "mirrored",
            clean_attention: str = "block_causal", kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int = 2,
            tile: Optional[int] = None) -> List[RankView]:
    """Per-rank view of a layout (see the module docstring)."""
    L, B = seq_length, block_size
    geometry = BlockGeometry(L, B, clean_attention)
    layout = SequenceLayout(geometry, cp, bp, schedule)
    P = layout.shard_group_size
    tile = tile or max(1, -(-2 * L // 64))
    keys = logical_rows(L)
    kv_row = 2 * kv_heads * head_dim * dtype_bytes
    views = []
    for r in range(P):
        rows = layout.rows(r)
        clean = rows.is_clean
        mask = PartialMask.of(rows, keys, geometry)
        held = torch.zeros(2 * L, dtype=torch.bool)
        held[torch.where(clean, rows.position + L, rows.position)] = True
        views.append(RankView(
            rank=r, noisy_blocks=sorted({int(p) // B for p in rows.position[~clean]}),
            clean_ranges=_ranges(rows.position[clean]), rows=len(rows), noisy_rows=int((~clean).sum()),
            clean_rows=int(clean.sum()), allowed_pairs=int(mask.allowed_pairs()), tiles=mask.tiles(tile, tile),
            held_keys=held, kv_row_bytes=kv_row))
    # the exchange each layout runs on a full-attention layer, one pass
    for v in views:
        if layout.kind == "cp":
            dsts, rows_sent = range(P), v.rows
        elif layout.kind == "csbp":
            dsts, rows_sent = layout.ring_ranks(v.rank), v.clean_rows
        else:
            dsts, rows_sent = [], 0
        for d in dsts:
            if d != v.rank:
                v.sends[d] = views[d].recv[v.rank] = rows_sent * kv_row
    return views


#: the per-rank table: (header, right-aligned)
COLUMNS = (("rank", True), ("rows (noisy + clean)", False), ("noisy blocks", False), ("clean rows held", False),
           ("allowed pairs", True), ("K/V sent/layer", True), ("received/layer", True),
           ("K/V held/layer (own + received)", True))


def table(header: List[Tuple[str, bool]], rows: List[List[str]], sep: str = "  ") -> List[str]:
    """Lines of a table whose columns are as wide as their widest cell (header included), so no
    cell runs into the next; right-aligned columns for numbers."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, (h, _) in enumerate(header)]

    def line(cells):
        return sep.join(c.rjust(w) if right else c.ljust(w)
                        for c, w, (_, right) in zip(cells, widths, header)).rstrip()

    return [line([h for h, _ in header])] + [line(r) for r in rows]


def text_report(views: List[RankView], title: str) -> str:
    mib = 2 ** 20
    rows = []
    for v in views:
        blocks = " ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in _ranges(v.noisy_blocks))
        clean = " ".join(f"[{a},{b})" for a, b in v.clean_ranges)
        rows.append([str(v.rank), f"{v.rows} ({v.noisy_rows} + {v.clean_rows})", blocks, clean, str(v.allowed_pairs),
                     f"{v.bytes_sent / mib:.2f} MiB", f"{v.bytes_received / mib:.2f} MiB",
                     f"{v.kv_held_bytes / mib:.2f} MiB"])
    out = [title, ""] + table(list(COLUMNS), rows)
    out += ["", "send/receive graph (bytes per full-attention layer, one pass; forward, backward and a recompute "
                "forward each move this much):"]
    edges = [(v.rank, d, b) for v in views for d, b in sorted(v.sends.items())]
    out += [f"  {s} -> {d}: {b} B" for s, d, b in edges] or ["  none (every rank holds the keys its queries need)"]
    out.append(f"total allowed pairs {sum(v.allowed_pairs for v in views)}, "
               f"total K/V moved per layer per pass {sum(b for _, _, b in edges)} B")
    return "\n".join(out)


#: the picture's limits: rank panels per row, and ranks drawn (explain.txt lists every rank)
PANEL_COLUMNS, MAX_PANELS = 4, 16


def draw(views: List[RankView], title: str, path: str, seq_length: int) -> None:
    """explain.png: a panel per rank (at most MAX_PANELS, PANEL_COLUMNS to a row, so 16 ranks are a
    4 x 4 grid of legible panels, not one 5742-pixel-wide strip) and the send/receive graph."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    P, L = len(views), seq_length
    shown = views[:MAX_PANELS]
    cols = min(len(shown), PANEL_COLUMNS)
    prow = -(-len(shown) // cols)
    fig = plt.figure(figsize=(3.0 * cols + 4.2, 3.8 * prow + 1.2))
    # per row of panels: the tiles, the held keys, a gap for the next row's titles
    grid = fig.add_gridspec(3 * prow - 1, cols + 1, height_ratios=([12, 1, 3.2] * prow)[:-1],
                            width_ratios=[3] * cols + [4.2], hspace=0.3, wspace=0.12)
    cmap = ListedColormap(["#f2f2f2", "#f4a582", "#2166ac"])  # skipped, partial, full
    for i, v in enumerate(shown):
        r, c = divmod(i, cols)
        t = v.tiles
        img = (t.occupied.int() + (t.full & t.occupied).int()).numpy()
        ax = fig.add_subplot(grid[3 * r, c])
        ax.imshow(img, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
        ax.axvline(L / t.k_tile - 0.5, color="k", lw=0.8)  # noisy keys | clean keys
        ax.axhline(v.noisy_rows / t.q_tile - 0.5, color="k", lw=0.8, ls=":")
        ax.set_title(f"rank {v.rank}: {v.noisy_rows} noisy + {v.clean_rows} clean rows\n"
                     f"{v.allowed_pairs} pairs, sends {v.bytes_sent / 1024:.0f} KiB/layer", fontsize=8)
        ax.set(xticks=[], yticks=[])
        if c == 0:
            ax.set_ylabel("query rows [noisy ; clean]", fontsize=7)
        hx = fig.add_subplot(grid[3 * r + 1, c])
        held = v.held_keys.numpy().reshape(1, -1).astype(int)
        hx.imshow(held, cmap=ListedColormap(["white", "#1b7837"]), aspect="auto", vmin=0, vmax=1,
                  interpolation="nearest")
        hx.set_xticks([0, L, 2 * L - 1], ["0", "L", "2L"], fontsize=6)
        hx.set_yticks([0], ["held"], fontsize=6)
        if r == prow - 1:
            hx.set_xlabel("keys: noisy [0, L) | clean [L, 2L)", fontsize=7, labelpad=1)
    gx = fig.add_subplot(grid[:, cols])
    sent = {b for v in views for b in v.sends.values()}
    total = sum(v.bytes_sent for v in views)
    edges = sum(len(v.sends) for v in views)
    label = ("no K/V moves" if not sent else
             f"each arrow: {', '.join(f'{b / 1024:.0f} KiB' for b in sorted(sent))} per layer per pass\n"
             f"total {total / 2 ** 20:.2f} MiB per layer per pass")
    if P <= MAX_PANELS:
        angles = np.linspace(np.pi / 2, np.pi / 2 - 2 * np.pi, P, endpoint=False)
        xy = np.stack([np.cos(angles), np.sin(angles)], 1)
        for v in views:
            for d in v.sends:
                gx.annotate("", xy=tuple(xy[d] * 0.82), xytext=tuple(xy[v.rank] * 0.82),
                            arrowprops=dict(arrowstyle="-|>", lw=0.8 if edges <= 64 else 0.4, color="#555",
                                            shrinkA=6, shrinkB=6, connectionstyle="arc3,rad=0.12"))
        for v in views:
            gx.scatter(*xy[v.rank], s=500 if P <= 8 else 250, color="#2166ac", zorder=3)
            gx.text(*xy[v.rank], str(v.rank), color="white", ha="center", va="center", fontsize=10 if P <= 8 else 8,
                    zorder=4)
    else:  # too many ranks for a readable graph: what it would show, in words (explain.txt lists every edge)
        gx.text(0, 0, f"{P} ranks, {edges} sends\n(explain.txt lists each)", ha="center", va="center", fontsize=9)
    gx.set_title("K/V sent (full-attention layer)\n" + label, fontsize=8)
    gx.set(xlim=(-1.3, 1.3), ylim=(-1.3, 1.3), aspect="equal")
    gx.axis("off")
    legend = {"#2166ac": "computed, full tile", "#f4a582": "computed, partial tile", "#f2f2f2": "skipped",
              "#1b7837": "key held by this rank"}
    fig.legend(handles=[Patch(color=c, label=label) for c, label in legend.items()], loc="lower center", ncol=4,
               fontsize=8, frameon=False)
    if P > len(shown):
        title += f"\n(ranks 0-{len(shown) - 1} of {P} drawn; explain.txt lists every rank)"
    fig.suptitle(title, fontsize=10)
    top, bottom = 1 - (0.6 + 0.3 * (title.count("\n") + 1)) / fig.get_figheight(), 0.7 / fig.get_figheight()
    fig.subplots_adjust(left=0.03, right=0.99, top=top, bottom=bottom)
    fig.savefig(path, dpi=110)
    plt.close(fig)
