"""`python -m megatron_csbp.explain`: its per-rank allowed pairs equal a dense brute-force count,
its bytes equal the planner's formula (`planner/work.py`, `planner/cost.py`), and the CLI writes
its text and picture."""
import pytest

from megatron_csbp.explain import main
from megatron_csbp.layout.explain import explain
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, dense_reference_mask
from megatron_csbp.planner.work import rank_work

CASES = [(64, 8, 2, 1), (64, 8, 1, 2), (64, 8, 2, 2), (96, 8, 4, 1), (96, 8, 1, 4), (96, 8, 4, 4), (96, 8, 2, 4)]


@pytest.mark.parametrize("L,B,cp,bp", CASES)
def test_allowed_pairs_equal_dense_brute_force(L, B, cp, bp):
    dense = dense_reference_mask(L, B)
    layout = SequenceLayout(BlockGeometry(L, B), cp, bp)
    for v in explain(L, B, cp, bp, kv_heads=2, head_dim=4, tile=16):
        rows = layout.rows(v.rank)
        logical = rows.position + L * rows.is_clean.long()
        assert v.allowed_pairs == int(dense[logical].sum())
        t = v.tiles  # the tile picture brackets the count: full tiles <= pairs <= occupied tiles
        if v.rows % 16 == 0:  # (a short last tile's padding rows count as allowed in `full`)
            assert int(t.full.sum()) * 16 * 16 <= v.allowed_pairs
        assert v.allowed_pairs <= int(t.occupied.sum()) * 16 * 16
        assert int(v.held_keys.sum()) == v.rows


@pytest.mark.parametrize("L,B,cp,bp", CASES)
def test_bytes_equal_the_planners_formula(L, B, cp, bp):
    G, d, s = 2, 4, 2
    kv_row = 2 * G * d * s
    works = rank_work(L, B, cp, bp, "mirrored", "block_causal", None)
    views = explain(L, B, cp, bp, kv_heads=G, head_dim=d, dtype_bytes=s, tile=16)
    S = len(views)
    for v, w in zip(views, works):
        assert (v.rows, v.noisy_rows, v.clean_rows, v.allowed_pairs) == (w.rows, w.noisy_rows, w.clean_rows,
                                                                          w.sparse_pairs)
        # cost.estimate's per-pass bytes: CP all rows to S-1 ranks, CSBP clean rows to the ring, BP none
        want = {"cp": w.rows * kv_row * (S - 1), "csbp": w.clean_rows * kv_row * (cp - 1)}.get(
            "cp" if bp == 1 else "csbp" if cp > 1 else "bp", 0)
        assert v.bytes_sent == want
        assert v.bytes_received == w.kv_rows_gathered * kv_row
        assert v.kv_held_bytes == (w.rows + w.kv_rows_gathered) * kv_row
    assert sum(v.bytes_sent for v in views) == sum(v.bytes_received for v in views)


def test_cli_writes_text_and_png(tmp_path, capsys):
    assert main(["--seq-length", "96", "--block-size", "8", "--context-parallel-size", "2",
                 "--block-parallel-size", "2", "--num-query-groups", "2", "--kv-channels", "4",
                 "--micro-batch-size", "1", "--out", str(tmp_path)]) == 0  # a trainer flag is ignored
    out = capsys.readouterr().out
    assert out.startswith("CSBP: CP 2 x BP 2") and "0 -> 1: 1536 B" in out
    assert (tmp_path / "explain.txt").read_text().startswith("CSBP")
    assert (tmp_path / "explain.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_layout_is_one_line(capsys):
    assert main(["--seq-length", "100", "--block-size", "10", "--context-parallel-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --seq-length 100 must be divisible by 2 x")


def test_sixteen_ranks_picture_is_legible(tmp_path, capsys):
    """16 ranks used to draw one 5742 x 506 strip (16 panels side by side): now a 4 x 4 grid of
    panels, at most 1800 pixels wide."""
    import matplotlib.image

    assert main(["--recipe", "examples/recipes/nemotron_diffusion_14b_256k_csbp.yaml", "--seq-length", "16384",
                 "--context-parallel-size", "4", "--block-parallel-size", "16", "--out", str(tmp_path)]) == 0
    h, w = matplotlib.image.imread(str(tmp_path / "explain.png")).shape[:2]
    assert w <= 1800 and 0.5 <= h / w <= 1.5, (w, h)


def _cells(lines, n):
    """The table's first n rows cut at the header's column starts."""
    header = lines[2]
    names = ["rank", "rows (noisy + clean)", "noisy blocks", "clean rows held", "allowed pairs", "K/V sent/layer",
             "received/layer", "K/V held/layer (own + received)"]
    starts = [header.index(name) for name in names]
    rows = lines[3:3 + n]
    cells = [[line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])] for line in rows]
    for line, row in zip(rows, cells):  # each column's slice is one cell: no neighbour's text in it, none cut off
        assert all(row) and not any("  " in c for c in row), row
        assert " ".join(row) == " ".join(line.split()), line
    return cells


def test_table_cells_stay_in_their_columns(capsys):
    """The header's columns started 4 characters right of the cells' (`rows (noisy + clean)` padded
    to 28, its header to 32); at the paper's 256K layout `65536 (32768 + 32768) 0-63` ran together and
    the clean ranges overflowed their column. Now each column is as wide as its widest cell."""
    from megatron_csbp.layout.explain import RankView, text_report

    assert main(["--recipe", "examples/recipes/nemotron_diffusion_14b_256k_csbp.yaml", "--seq-length", "16384"]) == 0
    cells = _cells(capsys.readouterr().out.splitlines(), 8)
    assert cells[0][:4] == ["0", "4096 (2048 + 2048)", "0-3 60-63", "[0,1024) [15360,16384)"], cells[0]
    # rank 0 of that recipe at its own 262144 tokens (the layout's numbers; explain() at 256K takes 20 s)
    mib = 2 ** 20
    v = RankView(rank=0, noisy_blocks=list(range(64)) + list(range(960, 1024)),
                 clean_ranges=[(0, 16384), (245760, 262144)], rows=65536, noisy_rows=32768, clean_rows=32768,
                 allowed_pairs=8598323200, sends={d: 128 * mib for d in range(1, 8)},
                 recv={d: 128 * mib for d in range(1, 8)}, kv_row_bytes=4096)
    cells = _cells(text_report([v], "title").splitlines(), 1)
    assert cells[0] == ["0", "65536 (32768 + 32768)", "0-63 960-1023", "[0,16384) [245760,262144)", "8598323200",
                        "896.00 MiB", "896.00 MiB", "1152.00 MiB"], cells[0]


def test_more_ranks_than_panels_draws_the_first_sixteen(tmp_path, capsys):
    from megatron_csbp.layout import explain as ex

    views = explain(256, 8, 32, 1, kv_heads=2, head_dim=4)
    ex.draw(views, "CP 32", str(tmp_path / "p.png"), 256)
    import matplotlib.image

    h, w = matplotlib.image.imread(str(tmp_path / "p.png")).shape[:2]
    assert w <= 1800 and h <= 1900, (w, h)
