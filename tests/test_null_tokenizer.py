"""`--tokenizer-type NullTokenizer --vocab-size V` means what it means in Megatron-LM everywhere
(the trainer, data.preprocess, generate): ids 0..V-1 plus EOD V (V + 1 ids), the model's
vocabulary that padded to --make-vocab-size-divisible-by, and the default mask id the Megatron-LM
hooks' (the first padding id, V + 1). A checkpoint saved when the trainer read V as "V ids, EOD
V - 1, mask V - 2" is refused with one line naming --vocab-size and the rule, and rebuilt with its
own tokenizer by the readers of checkpoints (tests/test_fail_loudly.py, on its trained checkpoint)."""
import argparse

import pytest
import torch

from megatron_csbp.data.megatron_data import build_tokenizer, saved_tokenizer
from megatron_csbp.model.builder import embedding_rows
from megatron_csbp.training.arguments import parse_args
from tests.train_helpers import TINY


def test_null_tokenizer_is_megatron_lms():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    tok = build_tokenizer("NullTokenizer", None, 64)
    ref = NullTokenizer(64)  # megatron-core's class, the one Megatron-LM's --tokenizer-type NullTokenizer builds
    assert (tok.vocab_size, tok.eod, tok.mask_token_id) == (ref.vocab_size, ref.eod, None) == (65, 64, None)
    assert tok.tokenize("5 17  42\n") == [5, 17, 42] and tok.detokenize([5, 17, 64]) == "5 17 64"
    # a run's (or a checkpoint's) tokenizer vocabulary, EOD included, gives back the same tokenizer
    assert (saved_tokenizer("NullTokenizer", None, 65).vocab_size, saved_tokenizer("NullTokenizer", None, 65).eod) \
        == (65, 64)


def test_trainer_reads_vocab_size_as_megatron_lm_and_takes_the_hooks_mask_id(capsys):
    from megatron_csbp.megatron_lm import resolve_mask_token_id

    a = parse_args(TINY, world_size=1)  # --mock-data --vocab-size 64
    assert (a.vocab_size, a.eod_token_id, embedding_rows(a), a.mask_token_id) == (65, 64, 128, 65)
    # the hooks, over Megatron-LM's args and tokenizer (mask -1: none), pick the same id
    hooks = argparse.Namespace(objective="bd3lm", mask_token_id=None, padded_vocab_size=128,
                               allow_mask_token_in_vocab=False)
    assert resolve_mask_token_id(hooks, build_tokenizer("NullTokenizer", None, 64)) == a.mask_token_id
    # V = 127: V + 1 = 128 ids fill the padded vocabulary, no padding id is free (as in the hooks)
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--vocab-size", "127"], world_size=1)
    assert "error: --objective bd3lm needs --mask-token-id" in capsys.readouterr().err
    a = parse_args(TINY + ["--vocab-size", "128"], world_size=1)
    assert (a.vocab_size, a.eod_token_id, embedding_rows(a), a.mask_token_id) == (129, 128, 256, 129)


def test_mock_data_draws_only_the_real_ids():
    from megatron_csbp.objectives.data import mock_datasets

    a = parse_args(TINY, world_size=1)
    train, valid = mock_datasets(a)
    ids = torch.cat([ds[i]["tokens"] for ds in (train, valid) for i in range(200)])
    assert int(ids.min()) == 0 and int(ids.max()) == 63  # ids 0..V-1: never the EOD 64 nor the mask id 65


def test_preprocess_appends_megatron_lms_eod(tmp_path):
    """`data.preprocess --tokenizer-type NullTokenizer --vocab-size 64 --append-eod`: documents end
    with 64, the EOD the trainer (and Megatron-LM's pretrain()) reads for packed documents."""
    import json

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_csbp.data.preprocess import main as preprocess_main

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("5 17 42", "0 63")))
    prefix = preprocess_main(["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "d"),
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--append-eod"])
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 17, 42, 64], [0, 63, 64]]
    assert parse_args(TINY[3:] + ["--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                                  "--vocab-size", "64", "--split", "100,0,0"],
                      world_size=1).eod_token_id == 64
