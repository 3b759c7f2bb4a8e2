"""--sft-trajectory-turns all (diffusiongemma-sft): a multi-turn record (an agent trajectory) becomes
one sample per assistant turn, the record up to that turn rendered as the model is prompted there
and only that turn supervised; the record's samples form one dataset item of T rows, so they share
an optimizer step (--global-batch-size counts records); packed, a record's turns are packed
together. BD3-LM supervises every turn in one sample (tests/test_sft_chat_template.py)."""
import json

import pytest
import torch

from megatron_csbp.data.megatron_data import build_tokenizer, collate
from megatron_csbp.data.sft import SFTDataset, render, turn_samples

TRAJ = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a loop."},
                     {"role": "assistant", "content": "for"}, {"role": "user", "content": "Another?"},
                     {"role": "assistant", "content": "while"}, {"role": "user", "content": "And a third?"},
                     {"role": "assistant", "content": "a recursive call"}]}
PAIR = {"prompt": "Dict?", "response": "A mapping."}
B, L = 8, 96


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("SentencePieceTokenizer", None, None)


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "traj.jsonl"
    p.write_text(json.dumps(TRAJ) + "\n" + json.dumps(PAIR) + "\n")
    return str(p)


def test_one_sample_per_assistant_turn_prefix_clean(tok):
    samples = turn_samples(TRAJ, tok)
    assert len(samples) == 3
    for (ids, mask), k, answer in zip(samples, (3, 5, 7), ("for", "while", "a recursive call")):
        prefix = {"messages": TRAJ["messages"][:k]}
        assert ids == render(prefix, tok)[0]  # the record up to this turn, as the model is prompted there
        assert [i for i, m in zip(ids, mask) if m] == tok.tokenize(answer) + [tok.eod]  # only this turn


def test_a_records_turns_are_one_item_and_share_a_step(path, tok):
    ds = SFTDataset(path, tok, L, align_response_to=B, trajectory_turns="all")
    assert len(ds) == 2 and ds[0]["tokens"].shape == (3, L)
    pad = tok.tokenizer.pad
    for j in range(3):
        mask = ds[0]["loss_mask"][j]
        assert int(mask.argmax()) % B == 0 and mask.sum() > 0
    assert ds[1]["loss_mask"][1:].sum() == 0 and bool((ds[1]["tokens"][1:] == pad).all())  # empty rows
    batch = collate(ds, [0, 1])
    assert batch["tokens"].shape == (6, L) and batch["sample_index"].tolist() == [0, 1, 2, 3, 4, 5]
    assert torch.equal(batch["tokens"][:3], ds[0]["tokens"])
    # The objective counts the turns as samples: 3 + 1 with a response; empty rows no pairs.
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective

    obj = DiffusionGemmaSFTObjective(B, tok.vocab_size, pad_id=pad)
    den = obj.denominator(batch["loss_mask"], batch["tokens"])
    assert den[0] == 4 and den[1] == sum(int(((t != pad) | (m > 0)).sum()) - 1
                                         for t, m in zip(batch["tokens"][:4], batch["loss_mask"][:4]))
    # Packed: a record's turns are packed together (documents), never with another record's.
    packed = SFTDataset(path, tok, L, align_response_to=B, pack=True, trajectory_turns="all")
    assert packed[0]["document_ids"].dim() == 2 and packed[0]["tokens"].shape[1] == L
    rows0 = packed[0]["loss_mask"].sum(dim=1) > 0
    assert int(packed[0]["document_ids"][rows0].max()) >= 1  # several turns in one sequence
    assert packed.conversations == 4 and "4 conversations" in packed.describe_packing()


def test_trajectory_turns_flag_rules(path, capsys):
    from megatron_csbp.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--sft-data-path", path, "--sft-trajectory-turns", "all"], world_size=1)
    assert "--sft-trajectory-turns all makes one sample per assistant turn for --objective diffusiongemma-sft" in \
        capsys.readouterr().err
