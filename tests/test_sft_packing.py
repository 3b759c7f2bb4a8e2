"""--sft-data-path with --pack-sequences: first-fit packing of conversations, loss masks kept per
conversation (prompt clean, response noised), document ids per conversation (a multi-turn
conversation with several EODs is one document), the packing efficiency; the trainer accepts it
and, with --reset-attention-mask, a packed sequence's loss equals the sum of its conversations
run alone (documents start on block edges here: each conversation is padded to a block multiple)."""
import json

import pytest
import torch

from megatron_csbp.data.megatron_data import build_tokenizer, collate
from megatron_csbp.data.sft import SFTDataset, first_fit, render
from tests.distributed import run_distributed
from tests.train_helpers import train_rank

RECORDS = [
    {"prompt": "Explain tuples.", "response": "Immutable sequences of items."},
    {"messages": [{"role": "user", "content": "Name a loop."}, {"role": "assistant", "content": "for"},
                  {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "while"}]},
    {"prompt": "What is a list?", "response": "A mutable sequence of items, written in brackets."},
    {"prompt": "Dict?", "response": "A mapping."},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("SentencePieceTokenizer", None, None)


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "sft.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(p)


def test_first_fit():
    assert first_fit([5, 4, 3, 2, 6, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert first_fit([8, 8], 8) == [[0], [1]]


def test_packed_dataset_keeps_masks_and_documents(path, tok):
    L = 64
    rendered = [render(r, tok) for r in RECORDS]
    ds = SFTDataset(path, tok, L, pack=True)
    lengths = [len(ids) for ids, _ in rendered]
    bins = first_fit(lengths, L)
    assert len(ds) == len(bins) < len(RECORDS)
    assert ds.packing_efficiency == pytest.approx(sum(lengths) / (len(bins) * L))
    assert "packing efficiency" in ds.describe_packing()
    for b, members in enumerate(bins):
        s = ds[b]
        p = 0
        for d, i in enumerate(members):
            ids, mask = rendered[i]
            assert s["tokens"][p:p + len(ids)].tolist() == ids
            assert s["loss_mask"][p:p + len(ids)].tolist() == mask
            assert bool((s["document_ids"][p:p + len(ids)] == d).all())
            p += len(ids)
        assert bool((s["tokens"][p:] == tok.eod).all()) and s["loss_mask"][p:].sum() == 0
        assert bool((s["document_ids"][p:] == len(members)).all())  # padding: a document of its own
    # The two-turn conversation holds two EODs but is one document.
    two_turn = next(b for b, m in enumerate(bins) if 1 in m)
    d = bins[two_turn].index(1)
    assert int((ds[two_turn]["tokens"][ds[two_turn]["document_ids"] == d] == tok.eod).sum()) == 2
    batch = collate(ds, [0, 1])
    assert batch["document_ids"].shape == (2, L)
    # Aligned (a block multiple per conversation): every document starts on a block edge.
    aligned = SFTDataset(path, tok, L, align_response_to=8, pack=True)
    for i in range(len(aligned)):
        ids = aligned[i]["document_ids"]
        starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), ids[1:] != ids[:-1]])).flatten()
        assert bool((starts % 8 == 0).all())


def test_pack_sequences_needs_sft_data(capsys):
    from megatron_csbp.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--vocab-size", "64", "--pack-sequences"], world_size=1)
    assert "--pack-sequences packs conversations: it needs --sft-data-path" in capsys.readouterr().err


@pytest.mark.slow
def test_trainer_with_packed_sft(path):
    argv = (f"--sft-data-path {path} --pack-sequences --reset-attention-mask --reset-position-ids --num-layers 2 "
            "--hidden-size 32 --num-attention-heads 4 --seq-length 64 --block-size 8 --micro-batch-size 2 "
            "--global-batch-size 2 --train-iters 2 --log-interval 1 --no-progress-bar").split()
    one = run_distributed(train_rank, 1, argv)[0]["losses"]
    csbp = run_distributed(train_rank, 2, argv + ["--context-parallel-size", "2", "--block-parallel-size", "2"])
    for r in csbp:
        assert r["losses"] == pytest.approx(one, rel=1e-5, abs=0)
