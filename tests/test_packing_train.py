"""The trainer with Megatron's packed-document flags on a --data-path corpus of short documents
(Megatron's GPTDataset concatenates them with EOD): the loss curve under CSBP on 2 ranks equals
one rank's (fp32, 1e-5 relative as tests/test_train_layouts.py), and the flags change it (documents
no longer see each other)."""
import json

import pytest

from tests.distributed import run_distributed
from tests.train_helpers import train_rank

ARGS = ("--data-path {prefix} --split 100,0,0 --data-cache-path {cache} --num-layers 2 --hidden-size 32 "
        "--num-attention-heads 4 --num-query-groups 2 --seq-length 64 --block-size 8 --micro-batch-size 2 "
        "--global-batch-size 2 --train-iters 3 --log-interval 1 --lr 1e-2 --no-progress-bar")
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


@pytest.fixture(scope="module")
def argv(tmp_path_factory):
    from megatron_csbp.data.preprocess import main as preprocess_main

    tmp = tmp_path_factory.mktemp("packed")
    words = "the for statement is used to iterate over the elements of a sequence such as a string".split()
    with open(tmp / "docs.jsonl", "w") as f:
        for i in range(60):  # short documents: several per 64-token sample
            f.write(json.dumps({"text": " ".join(words[i % 5: i % 5 + 3 + i % 7])}) + "\n")
    prefix = preprocess_main(["--input", str(tmp / "docs.jsonl"), "--output-prefix", str(tmp / "c"), "--append-eod"])
    return ARGS.format(prefix=prefix, cache=tmp / "cache").split()


@pytest.mark.slow  # suite budget: tests/test_packing_model.py and test_packing_layouts.py cover the layouts by default
def test_packed_training_is_layout_invariant_and_differs_from_unpacked(argv):
    one = run_distributed(train_rank, 1, argv + PACKED)[0]["losses"]
    csbp = run_distributed(train_rank, 2, argv + PACKED + ["--context-parallel-size", "2", "--block-parallel-size", "2"])
    for r in csbp:
        assert r["losses"] == pytest.approx(one, rel=1e-5, abs=0)
    plain = run_distributed(train_rank, 1, argv)[0]["losses"]
    assert abs(plain[0] - one[0]) > 1e-4 * abs(one[0])


@pytest.mark.slow
def test_packed_training_under_pipeline_stages_equals_one_rank(argv):
    """Packed documents under PP 2 (and PP 2 x CSBP), two samples with different documents per
    micro-batch (they run one by one: a stage sends their hidden states side by side and the next
    gives each its slice), 4 micro-batches per iteration: one rank's loss curve."""
    flags = argv + PACKED + ["--global-batch-size", "8", "--num-layers", "4"]
    one = run_distributed(train_rank, 1, flags)[0]["losses"]
    for world, extra in ((2, []), (4, ["--context-parallel-size", "2", "--block-parallel-size", "2"])):
        for r in run_distributed(train_rank, world, flags + ["--pipeline-model-parallel-size", "2"] + extra):
            assert r["losses"] == pytest.approx(one, rel=1e-5, abs=0)
