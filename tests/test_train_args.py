"""Bad flags are refused before any process group exists, with the flag and the rule named."""
import subprocess

import pytest

from megatron_csbp.training.arguments import parse_args
from tests.train_helpers import TINY, error_lines, train_command


def _err(argv, world, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags,world,needle", [
    (["--block-size", "12"], 1, "--block-size 12 does not divide --seq-length 32"),
    (["--context-parallel-size", "2", "--block-parallel-size", "3"], 6, "--block-parallel-size 3 must be a multiple of --context-parallel-size 2"),
    (["--mask-token-id", "128"], 1, "--mask-token-id 128 is outside the vocabulary [0, 128)"),  # padded 65 ids
    (["--mask-token-id", "-1"], 1, "--mask-token-id -1 is outside"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--context-parallel-size", "2", "--block-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--global-batch-size", "6"], 4, "--global-batch-size 6 must be a multiple of --micro-batch-size 2 x data-parallel size 4"),
    (["--seq-length", "36", "--block-size", "4", "--context-parallel-size", "4"], 4, "divisible by 2 x max"),
    (["--block-parallel-size", "8", "--seq-length", "48"], 8, "fewer than --block-parallel-size 8"),
    (["--noise-eps-min", "0"], 1, "--noise-eps-min/--noise-eps-max"),
])
def test_refused_with_named_flag(flags, world, needle, capsys):
    assert needle in _err(TINY + flags, world, capsys)


def test_sentencepiece_defaults_and_good_args(tmp_path):
    import json

    from megatron_csbp.data.corpus import load_documents
    from megatron_csbp.data.preprocess import main as preprocess_main

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in load_documents()[:3]))
    prefix = preprocess_main(["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "d"),
                              "--append-eod"])
    a = facts = parse_args(["--data-path", prefix, "--seq-length", "64", "--block-size", "16"], world_size=1)
    from megatron_csbp.data.tokenizer import SentencePieceTokenizer
    tok = SentencePieceTokenizer()
    assert a.vocab_size == tok.vocab_size and a.mask_token_id == tok.mask_token_id and facts.eod_token_id == tok.eod
    a = facts = parse_args(TINY + ["--context-parallel-size", "2", "--block-parallel-size", "4"], world_size=8)
    assert facts.data_parallel_size == 2 and facts.num_microbatches == 1


@pytest.mark.parametrize("flags,world,check_only", [
    (["--sequence-parallel", "--attention-backend", "local"], 1, False),  # dropped under TP 1; the kernel it implies
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     False),  # interleaved 1F1B: the virtual pipeline size
    (["--load", "/no/such/ckpt", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/no/such.model"],
     1, True),  # launch --check: the notes of what it skipped
])
def test_validation_writes_only_declared_flags(flags, world, check_only):
    """Validation changes nothing the user gave: the namespace keeps every flag's value as given
    (nothing written, added or removed). What the rules derive (an unset flag filled, the
    tokenizer's vocabulary, the sizes, the --load shape and step, the EOD, launch --check's notes)
    lives in the returned frozen `Resolved`, the derived flag values beside the given ones. Whitelist:
    only `placeholders`, which launch --check sets before validating (an input, not derived)."""
    import copy
    from dataclasses import FrozenInstanceError

    from megatron_csbp.config.options import OPTIONS
    from megatron_csbp.objectives.registry import registered_objectives
    from megatron_csbp.training.arguments import build_parser, validate_args

    declared = {o.name for o in OPTIONS} | {f.dest for c in registered_objectives().values() for f in c.flags}
    args = build_parser().parse_args(TINY + flags)
    assert set(vars(args)) == declared
    args.placeholders = set()
    given = copy.deepcopy(vars(args))
    facts = validate_args(args, world, check_only=check_only)
    assert vars(args) == given  # nothing given is changed (nor added, nor removed)
    assert set(facts.derived) <= declared and vars(facts.flags) == given
    if "--sequence-parallel" in flags:  # given, resolved off under TP 1 (as Megatron-LM does); the kernel implied
        assert facts.flags.sequence_parallel and not facts.sequence_parallel
        assert (facts.flags.attention_kernel, facts.attention_kernel) == ("auto", "tiled")
    with pytest.raises(FrozenInstanceError):
        facts.vocab_size = 1
    assert facts.world_size == world and (facts.check_notes != []) == check_only


def test_cli_exit_message():
    """Under torchrun an argument error is one line, once (rank 0), with no usage dump and no rank
    traceback (before: the 80-line usage once per rank plus the tracebacks); torchrun exits nonzero
    and its failure summary carries the line."""
    out = subprocess.run(train_command(TINY + ["--block-size", "5"], nproc=2), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    line = "error: --block-size 5 does not divide --seq-length 32"
    assert [x[:len(line)] for x in error_lines(text)] == [line], text[-3000:]
    assert "usage:" not in text and "megatron_csbp/training" not in text  # no usage, no rank traceback
    assert f"traceback : {line}" in text  # torchrun's summary names the cause
