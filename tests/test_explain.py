"""`python -m megatron_csbp.explain`: per-rank tiles, rows, pairs and the send graph of CP, BP and
CSBP from layout metadata; CSBP sends half of CP's bytes, BP none; every rank's allowed pairs sum
to the whole mask's; a PNG and the text are written."""
import pytest

from megatron_csbp.explain import explain, main


@pytest.mark.parametrize("transport", ["allgather", "ring"])
def test_three_layouts_pairs_and_traffic(transport):
    L, B, P = 256, 16, 4
    cp, bp, csbp = (explain(L, B, c, b, transport=transport, groups=2, head_dim=8) for c, b in [(P, 1), (1, P), (P, P)])
    whole = L * (L + B)  # the block-causal mask's allowed pairs
    assert sum(r["allowed_pairs"] for r in cp["ranks"]) == whole
    assert sum(r["allowed_pairs"] for r in csbp["ranks"]) == whole
    assert sum(r["allowed_pairs"] for r in bp["ranks"]) > whole  # BP recomputes clean prefixes
    row = 2 * 2 * 8 * 2
    for r in range(P):  # CP: K/V of 2L/P rows to P-1 ranks and back; CSBP: the L/P clean rows
        assert cp["ranks"][r]["sent_per_layer"] == 2 * (P - 1) * (2 * L // P) * row
        assert csbp["ranks"][r]["sent_per_layer"] * 2 == cp["ranks"][r]["sent_per_layer"]
        assert bp["ranks"][r]["sent_per_layer"] == 0
    assert all(sum(r["held"]) == r["rows"] for r in csbp["ranks"])


def test_cli_writes_text_and_png(tmp_path, capsys):
    png, txt = tmp_path / "e.png", tmp_path / "e.txt"
    main(["--seq-length", "256", "--block-size", "16", "--context-parallel-size", "2", "--block-parallel-size", "2",
          "--compare", "--png", str(png), "--text", str(txt)])
    assert png.stat().st_size > 1000 and "layout csbp" in txt.read_text() and "layout cp" in txt.read_text()


def test_bad_layout_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--seq-length", "100", "--block-size", "16", "--block-parallel-size", "2"])
    assert "--seq-length" in capsys.readouterr().err
