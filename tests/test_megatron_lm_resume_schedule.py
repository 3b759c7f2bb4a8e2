"""A resume whose learning-rate flags differ from the checkpoint's does what Megatron-LM's pretrain()
does on the installed megatron-core (issue 32, deliverable 3; checkpoint/state.py
`check_resumed_schedule`):

- neither --override-opt_param-scheduler nor --use-checkpoint-opt_param-scheduler: a changed schedule
  is refused (Megatron-LM: megatron-core's AssertionError after its argument dump; here one line that
  names the flag and the two ways on);
- --use-checkpoint-opt_param-scheduler: the checkpoint's schedule;
- --override-opt_param-scheduler: the flags' schedule (decay style, warmup, decay steps);
- a changed --lr / --min-lr: megatron-core 0.16.1 loads the optimizer's parameter groups with the
  checkpoint's max_lr/min_lr, so the learning rate stays the checkpoint's (with either flag);
  megatron-core 0.19 matches parameter groups by max_lr/min_lr and cannot load them: refused in one
  line (Megatron-LM core_v0.19.0: "Could not find parameter group").

Before: the trainer built its scheduler with use_checkpoint_opt_param_scheduler=True (a changed
schedule silently kept the checkpoint's, and neither flag existed), and on megatron-core 0.19 a
changed --lr ended in megatron-core's multi-line ValueError. The learning rates are pinned against
megatron-core's schedule written out (`lr_at`), and, -m slow, against Megatron-LM's pretrain() on the
same flags (its log line)."""
import math
import re

import pytest

from tests.distributed import run_distributed
from tests.train_helpers import TINY, error_lines, run_train, train_rank

ITERS = ["--train-iters", "4"]


def lr_at(it, style, lr=1e-2, min_lr=1e-3, warmup=1, decay=4):
    """megatron-core's OptimizerParamScheduler after `it` steps (TINY: --lr 1e-2 --min-lr 1e-3,
    --lr-warmup-iters 1, --lr-decay-iters = --train-iters 4; steps counted in iterations here, the
    scheduler's samples divided by --global-batch-size)."""
    if it <= warmup:
        return lr * it / warmup
    ratio = (it - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + (lr - min_lr) * coeff


def lrs(result):
    return {h["iteration"]: h["lr"] for h in result["history"] if "lr" in h}


def lr_keyed_param_groups():
    from megatron_csbp.checkpoint.state import param_groups_keyed_by_lr

    return param_groups_keyed_by_lr()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """4 iterations of TINY (linear decay), saved at iteration 2."""
    d = tmp_path_factory.mktemp("sched")
    ckpt = str(d / "ckpt")
    full = run_distributed(train_rank, 1, TINY + ITERS + ["--save", ckpt, "--save-interval", "2"])[0]
    assert lrs(full) == pytest.approx({i: lr_at(i, "linear") for i in (1, 2, 3, 4)}, rel=1e-12)
    return ckpt, full


def resume(ckpt, extra):
    return run_distributed(train_rank, 1, TINY + ITERS + ["--load", ckpt, "--ckpt-step", "2"] + extra)[0]


def test_changed_schedule_refused_without_flag_and_overridden_with_it(saved):
    ckpt, full = saved
    proc = run_train(TINY + ITERS + ["--load", ckpt, "--ckpt-step", "2", "--lr-decay-style", "cosine"])
    assert proc.returncode == 1, proc.stderr[-3000:]  # a checkpoint refusal (CheckpointError)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "--lr-decay-style gives lr_decay_style cosine, the checkpoint's is linear" in lines[0]
    assert "--use-checkpoint-opt_param-scheduler" in lines[0] and "--override-opt_param-scheduler" in lines[0]
    over = resume(ckpt, ["--lr-decay-style", "cosine", "--override-opt_param-scheduler"])
    assert lrs(over) == pytest.approx({3: lr_at(3, "cosine"), 4: lr_at(4, "cosine")}, rel=1e-12)
    assert lr_at(3, "cosine") != pytest.approx(lr_at(3, "linear"), rel=1e-3)


def test_changed_lr_per_megatron_core_version(saved):
    ckpt, full = saved
    argv = TINY + ITERS + ["--load", ckpt, "--ckpt-step", "2"]
    argv[argv.index("--lr") + 1] = "2e-2"
    if lr_keyed_param_groups():  # megatron-core 0.19: the optimizer cannot load the groups
        proc = run_train(argv + ["--use-checkpoint-opt_param-scheduler"])
        assert proc.returncode == 1, proc.stderr[-3000:]  # a checkpoint refusal (CheckpointError)
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and "Could not find parameter group" not in proc.stderr
        assert "with --lr 0.02 (the checkpoint's 0.01)" in lines[0]
        assert "matches the optimizer's parameter groups by their max_lr/min_lr" in lines[0]
    else:  # megatron-core 0.16.1: the checkpoint's parameter groups carry max_lr 1e-2
        kept = run_distributed(train_rank, 1, argv + ["--use-checkpoint-opt_param-scheduler"])[0]
        assert lrs(kept) == {3: lrs(full)[3], 4: lrs(full)[4]}


@pytest.mark.slow
def test_use_checkpoint_keeps_the_schedule_and_override_keeps_the_groups_lr(saved):
    ckpt, full = saved
    kept = resume(ckpt, ["--lr-decay-style", "cosine", "--use-checkpoint-opt_param-scheduler"])
    assert lrs(kept) == {3: lrs(full)[3], 4: lrs(full)[4]}
    if not lr_keyed_param_groups():
        argv = TINY + ITERS + ["--load", ckpt, "--ckpt-step", "2", "--override-opt_param-scheduler"]
        argv[argv.index("--min-lr") + 1] = "5e-3"
        over = run_distributed(train_rank, 1, argv)[0]
        assert lrs(over) == {3: lrs(full)[3], 4: lrs(full)[4]}  # min_lr 1e-3 from the parameter groups


# ---- against Megatron-LM's pretrain() -------------------------------------------------------------

def _pretrain_lrs(tmp_path, name, extra):
    from tests.test_megatron_lm_pretrain import ARGV, launch

    argv = [a for a in ARGV if a not in ("--train-iters", "3")] + ["--train-iters", "4", "--eval-iters", "0",
                                                                     "--eval-interval", "1000"]
    code, out = launch(tmp_path, name, 1, argv + extra)
    found = {int(i): float(v) for i, v in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: (\S+) \|", out)}
    return code, out, found


@pytest.mark.slow  # ~6 min on the shared 2-core machine: 4 pretrain() runs and 4 trainer runs
def test_trainer_resume_rules_are_pretrain_s(tmp_path):
    """The same save and resumes through Megatron-LM's pretrain() (its flags: --lr 1e-3 --min-lr 1e-4, no
    warmup) and through the trainer: the same learning rates (Megatron's log prints 7 digits), the
    same refusals."""
    from tests.test_megatron_lm_pretrain import MLM, _trainer_argv

    if not MLM:
        pytest.skip("Megatron-LM's training package is not found (tests/test_megatron_lm_pretrain.py)")
    base = ["--min-lr", "1e-4"]
    ck_p, ck_t = str(tmp_path / "ck_p"), str(tmp_path / "ck_t")
    code, out, _ = _pretrain_lrs(tmp_path, "save", base + ["--save", ck_p, "--save-interval", "2"])
    assert code == 0, out[-3000:]
    targv = _trainer_argv(tmp_path, "t", ["--mock-data", "--eval-iters", "0", "--eval-interval", "1000",
                                          "--swiglu", "--ffn-hidden-size", "64"] + base)
    targv[targv.index("--train-iters") + 1] = "4"
    run_distributed(train_rank, 1, targv + ["--save", ck_t, "--save-interval", "2"])
    cases = [("style_override", ["--lr-decay-style", "cosine", "--override-opt_param-scheduler"]),
             ("style_checkpoint", ["--lr-decay-style", "cosine", "--use-checkpoint-opt_param-scheduler"]),
             ("lr_checkpoint", ["--lr", "2e-3", "--use-checkpoint-opt_param-scheduler"]),
             ("style_refused", ["--lr-decay-style", "cosine"])]
    for name, extra in cases:
        code, out, mlm = _pretrain_lrs(tmp_path, name, base + extra + ["--load", ck_p, "--ckpt-step", "2"])
        try:
            t = run_distributed(train_rank, 1, targv + extra + ["--load", ck_t, "--ckpt-step", "2"])[0]
        except RuntimeError as e:
            t = str(e)
        if code != 0:  # Megatron-LM stopped (its assertion / parameter-group error): so does the trainer
            assert isinstance(t, str) and "cannot resume" in t, (name, out[-2000:])
            continue
        assert not isinstance(t, str), (name, t[-2000:])
        assert sorted(mlm) == [3, 4]
        for i in (3, 4):
            # Megatron prints the fp32 learning rate with 7 digits (2.318020E-04 for the trainer's float
            # 2.3180194847e-4, whose fp32 value is 2.3180195421e-4): 2.2e-7 relative print error + 6e-8 fp32
            assert lrs(t)[i] == pytest.approx(mlm[i], rel=1e-6, abs=0), (name, i, lrs(t)[i], mlm[i])
