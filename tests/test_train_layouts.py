"""Same seed, same data => same loss curve (fp32, <= 1e-5 relative) under every layout, including
the initial weights: 1 rank vs CSBP on 2 ranks vs TP=2 x CSBP=2 on 4 ranks (more layouts: -m slow)."""
import pytest

from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank

ITERS = ["--train-iters", "4"]


@pytest.fixture(scope="module")
def reference():
    return run_distributed(train_rank, 1, TINY + ITERS)[0]["losses"]


def _check(results, reference):
    assert len(reference) == 4
    for r in results:
        assert r["losses"] == pytest.approx(reference, rel=1e-5, abs=0)


def test_reference_learns(reference):
    assert reference[-1] < reference[0]


def test_csbp_two_ranks(reference):
    _check(run_distributed(train_rank, 2, TINY + ITERS + ["--context-parallel-size", "2",
                                                          "--block-parallel-size", "2"]), reference)


@pytest.mark.slow  # suite budget (docs/testing.md)
def test_tp2_csbp2_four_ranks_distributed_optimizer(reference):
    _check(run_distributed(train_rank, 4, TINY + ITERS + ["--tensor-model-parallel-size", "2",
                                                          "--context-parallel-size", "2", "--block-parallel-size", "2",
                                                          "--use-distributed-optimizer"]), reference)


def test_dp2_times_csbp_four_ranks(reference):
    """Data parallelism over CSBP shard groups (DP 2 x CP 2 / BP 2 on 4 ranks). 3 iterations on the
    reference's 4-iteration schedule: step 1 runs at the warmup's lr 0, so iteration 3's loss is the
    first to read a DP-reduced gradient (step 2's)."""
    results = run_distributed(train_rank, 4, TINY + ["--train-iters", "3", "--lr-decay-iters", "4",
                                                     "--context-parallel-size", "2", "--block-parallel-size", "2"])
    for r in results:
        assert r["losses"] == pytest.approx(reference[:3], rel=1e-5, abs=0)
    assert reference[2] != pytest.approx(reference[1], rel=1e-4)  # step 2 moved the weights


@pytest.mark.slow
@pytest.mark.parametrize("flags,world", [
    (["--context-parallel-size", "2"], 2),
    (["--block-parallel-size", "2"], 2),
    (["--block-parallel-size", "2", "--block-ownership", "contiguous"], 2),
    (["--context-parallel-size", "2", "--block-parallel-size", "2", "--attention-transport", "ring"], 2),
    (["--context-parallel-size", "2", "--block-parallel-size", "4"], 4),
    (["--tensor-model-parallel-size", "2"], 2),
])
def test_more_layouts(reference, flags, world):
    _check(run_distributed(train_rank, world, TINY + ITERS + flags), reference)


@pytest.mark.slow
def test_ar_objective_layout_invariant():
    ref = run_distributed(train_rank, 1, TINY + ITERS + ["--objective", "ar"])[0]["losses"]
    res = run_distributed(train_rank, 2, TINY + ITERS + ["--objective", "ar", "--context-parallel-size", "2",
                                                         "--block-parallel-size", "2"])
    for r in res:
        assert r["losses"] == pytest.approx(ref, rel=1e-5)
