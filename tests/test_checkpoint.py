"""dist_checkpointing (torch_dist) checkpoints: resume == uninterrupted training (bit for bit),
loading under another layout (CSBP -> TP=2), and atomic saves (a crash leaves the previous one)."""
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank

CSBP = ["--context-parallel-size", "2", "--block-parallel-size", "2", "--use-distributed-optimizer"]


def test_resume_exact_and_cross_layout(tmp_path):
    save = str(tmp_path / "ckpt")
    full = run_distributed(train_rank, 2, TINY + CSBP + ["--train-iters", "4", "--save", save,
                                                         "--save-interval", "2"])[0]["losses"]
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    resumed = run_distributed(train_rank, 2, TINY + CSBP + ["--train-iters", "4", "--load", save,
                                                            "--ckpt-step", "2"])[0]
    assert resumed["iteration"] == 4
    assert resumed["losses"] == full[2:], "resume must continue the loss curve bit for bit"
    # Another layout: TP = 2 (and DP/CP/BP = 1) reads the CSBP checkpoint (model + distributed
    # optimizer state resharded) and continues the same curve.
    other = run_distributed(train_rank, 2, TINY + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                                                   "--train-iters", "4", "--load", save, "--ckpt-step", "2"])[0]
    # fp32 layout tolerance of the suite (tests/test_train_layouts.py): TP 2 only reorders sums (row-
    # parallel linears, vocab-parallel cross entropy: <= 64-term sums here, ~sqrt(64) u = 5e-7
    # relative random-walk rounding) and Adam carries the relative gradient error into the update
    # scaled by lr; bound 1e-5 relative, 20x that; a wrongly resharded tensor moves losses by O(1e-2).
    assert other["losses"] == pytest.approx(full[2:], rel=1e-5)


def _atomic(rank, world_size, root):
    from megatron_csbp.checkpoint import files, state
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    s = Trainer(TrainerConfig.from_args(parse_args(TINY + ["--train-iters", "3"]))).build()
    s.train_step(0)
    state.save_checkpoint(root, 1, s.model, s.optimizer, s.scheduler, 4)
    saved = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    s.train_step(4)
    crashed = False
    try:
        state.save_checkpoint(root, 2, s.model, s.optimizer, s.scheduler, 8, _fail_after_write=True)
    except RuntimeError:
        crashed = True
    leftovers = sorted(os.listdir(root))
    tracker = files.read_tracker(root)
    info = state.load_checkpoint(root, s.model, s.optimizer, s.scheduler)
    restored = all(torch.equal(saved[n], p.detach()) for n, p in s.model.named_parameters())
    # The next save removes the half-written directory.
    state.save_checkpoint(root, 2, s.model, s.optimizer, s.scheduler, 8)
    return dict(crashed=crashed, leftovers=leftovers, tracker=tracker, info=info, restored=restored,
                after=sorted(os.listdir(root)))


def test_crash_during_save_leaves_previous_checkpoint(tmp_path):
    r = run_distributed(_atomic, 1, str(tmp_path / "ck"))[0]
    assert r["crashed"]
    assert any(".tmp-" in n for n in r["leftovers"]) and "iter_0000002" not in r["leftovers"]
    assert r["tracker"] == 1 and r["info"]["iteration"] == 1 and r["info"]["consumed_samples"] == 4
    assert r["restored"]
    assert r["after"] == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
