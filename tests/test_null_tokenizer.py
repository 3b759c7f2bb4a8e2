"""`--tokenizer-type NullTokenizer --vocab-size V` means what Megatron-LM means by it on the installed
megatron-core, everywhere (the trainer, data.preprocess, generate): megatron-core 0.16.1's Megatron-LM
reads ids 0..V-1 plus EOD V (V + 1 ids), 0.19's reads V ids with EOD V-1. In both the EOD is the
tokenizer's last id, the model's vocabulary is that padded to --make-vocab-size-divisible-by, and the
default mask id is the Megatron-LM hooks' (the first padding id), so neither the EOD nor the mask id
is ever a data id (text holding one is refused). A checkpoint saved under the other meaning is
refused with one line naming --vocab-size and the rule, or resumes with the flag that line gives
(tests/test_fail_loudly.py, on its trained checkpoint)."""
import argparse
import importlib

import pytest
import torch

from megatron_csbp.data.megatron_data import build_tokenizer, null_tokenizer_rule, saved_tokenizer
from megatron_csbp.model.builder import embedding_rows
from megatron_csbp.training.arguments import parse_args
from tests.train_helpers import TINY

#: (vocabulary, EOD) of Megatron-LM's NullTokenizer for --vocab-size 64: megatron-core 0.16.1's, 0.19's
MEGATRON_LM_MEANINGS = ((65, 64), (64, 63))


def megatron_lm_null_tokenizer(vocab_size: int):
    """What Megatron-LM's `--tokenizer-type NullTokenizer --vocab-size V` builds, by Megatron-LM's own
    `build_tokenizer(args)`, which megatron-core ships (0.16.1: `tokenizers.text.utils.build_tokenizer`,
    what its pretrain_gpt.py imports; 0.19: `tokenizers.utils.build_tokenizer`, what its pretrain_gpt.py
    and global_vars import): an independent reference for the plugin's own tokenizer factory."""
    for name in ("megatron.core.tokenizers.utils.build_tokenizer", "megatron.core.tokenizers.text.utils.build_tokenizer"):
        try:
            module = importlib.import_module(name)
            break
        except ImportError:
            continue
    else:
        raise AssertionError("megatron-core ships neither of Megatron-LM's build_tokenizer modules")
    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=vocab_size, rank=0, pad_vocab_size=False,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1)
    return module.build_tokenizer(args)


def test_null_tokenizer_is_megatron_lms():
    ref = megatron_lm_null_tokenizer(64)
    assert (ref.vocab_size, ref.eod) in MEGATRON_LM_MEANINGS
    for flag in (64, 100):
        tok, ref = build_tokenizer("NullTokenizer", None, flag), megatron_lm_null_tokenizer(flag)
        assert (tok.vocab_size, tok.eod, tok.mask_token_id) == (ref.vocab_size, ref.eod, None)
        assert tok.eod == tok.vocab_size - 1  # the last id
        # a run's (or a checkpoint's) tokenizer vocabulary, EOD included, gives back the same tokenizer
        again = saved_tokenizer("NullTokenizer", None, tok.vocab_size)
        assert (again.vocab_size, again.eod) == (tok.vocab_size, tok.eod)
    tok = build_tokenizer("NullTokenizer", None, 64)
    last = tok.eod - 1  # the largest data id
    assert tok.tokenize(f"5 17  {last}\n") == [5, 17, last] and tok.detokenize([5, 17, tok.eod]) == f"5 17 {tok.eod}"
    # text is data: the EOD (and ids above it: padding, the mask id) never stands for a data id
    for bad in (tok.eod, tok.eod + 1, -1):
        with pytest.raises(ValueError, match=rf"NullTokenizer text holds the ids 0\.\.{last} \(EOD {tok.eod}; "
                                             rf"--tokenizer-type NullTokenizer --vocab-size V is Megatron-LM's .*\), "
                                             rf"got {bad}$"):
            tok.tokenize(f"5 {bad} 6")


def test_trainer_reads_vocab_size_as_megatron_lm_and_takes_the_hooks_mask_id(capsys):
    from megatron_csbp.training.megatron_lm import resolve_mask_token_id

    ref = megatron_lm_null_tokenizer(64)
    a = facts = parse_args(TINY, world_size=1)  # --mock-data --vocab-size 64
    # the mask id: the first padding id, above the EOD
    assert (a.vocab_size, facts.eod_token_id, embedding_rows(a), a.mask_token_id) == (ref.vocab_size, ref.eod, 128,
                                                                                  ref.vocab_size)
    # the hooks, over Megatron-LM's args and tokenizer (mask -1: none), pick the same id
    hooks = argparse.Namespace(objective="bd3lm", mask_token_id=None, padded_vocab_size=128,
                               allow_mask_token_in_vocab=False)
    assert resolve_mask_token_id(hooks, build_tokenizer("NullTokenizer", None, 64)) == a.mask_token_id
    # the flag whose tokenizer has 128 ids fills the padded vocabulary: no padding id is free (as in the hooks)
    full = 64 + 128 - ref.vocab_size
    assert megatron_lm_null_tokenizer(full).vocab_size == 128
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--vocab-size", str(full)], world_size=1)
    assert "error: --objective bd3lm needs --mask-token-id" in capsys.readouterr().err
    a = facts = parse_args(TINY + ["--vocab-size", str(full + 1)], world_size=1)
    assert (a.vocab_size, facts.eod_token_id, embedding_rows(a), a.mask_token_id) == (129, 128, 256, 129)


def test_mock_data_draws_only_the_real_ids():
    from megatron_csbp.objectives.data import mock_datasets

    a = facts = parse_args(TINY, world_size=1)
    train, valid = mock_datasets(a)
    ids = torch.cat([ds[i]["tokens"] for ds in (train, valid) for i in range(200)])
    # the data ids: never the EOD nor the mask id (the first padding id)
    assert int(ids.min()) == 0 and int(ids.max()) == facts.eod_token_id - 1 and a.mask_token_id > facts.eod_token_id


def test_preprocess_appends_megatron_lms_eod(tmp_path, capsys):
    """`data.preprocess --tokenizer-type NullTokenizer --vocab-size 64 --append-eod`: documents end
    with Megatron-LM's EOD, the id the trainer (and Megatron-LM's pretrain()) reads for packed
    documents; a document holding the EOD is refused in one line."""
    import json

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_csbp.data.preprocess import main as preprocess_main

    eod = megatron_lm_null_tokenizer(64).eod
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--append-eod"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("5 17 42", f"0 {eod - 1}")))
    prefix = preprocess_main(["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "d")] + flags)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 17, 42, eod], [0, eod - 1, eod]]
    assert parse_args(TINY[3:] + ["--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                                  "--vocab-size", "64", "--split", "100,0,0"],
                      world_size=1).eod_token_id == eod
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": f"3 {eod}"}) + "\n")
    with pytest.raises(SystemExit):
        preprocess_main(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "bad")] + flags)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: NullTokenizer text holds the ids 0..{eod - 1} (EOD {eod}; {null_tokenizer_rule()}), "
                        f"got {eod}"), err
