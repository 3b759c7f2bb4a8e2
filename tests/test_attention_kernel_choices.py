"""Every `--attention-kernel` choice of the trainer's parser, run by the trainer on CPU: auto,
cpu_flash, tiled and math train (auto is cpu_flash without CUDA; all four give the same losses within
an fp32 reordering bound); flex evaluates
(FlexAttention has no CPU backward, so training it is refused by flag) and equals math; flash is
refused by flag before any process group (flash-attn is CUDA-only) instead of a traceback from
inside the model build."""
import pytest

from tests.distributed import run_distributed
from tests.train_helpers import TINY


def kernel_choices():
    from megatron_csbp.training.arguments import build_parser

    action = next(a for a in build_parser()._actions if "--attention-kernel" in a.option_strings)
    return list(action.choices)


def _runs(rank, world, argvs):
    from megatron_csbp.training.loop import main

    out = []
    for argv in argvs:  # one process, one trainer after another
        r = main(list(argv))
        out.append({"losses": [h["loss"] for h in r["history"] if "loss" in h],
                    "eval": [h["eval_loss"] for h in r["history"] if "eval_loss" in h]})
    return out


def test_every_attention_kernel_choice_runs_on_cpu(capsys):
    import torch

    from megatron_csbp.training.arguments import parse_args

    choices = kernel_choices()
    assert set(choices) == {"auto", "cpu_flash", "tiled", "math", "flex", "flash"}  # a new choice needs a line below
    train = ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1"]
    evaluate = ["--skip-train", "--eval-iters", "1"]
    runs = {k: TINY + train + ["--attention-kernel", k] for k in ("auto", "cpu_flash", "tiled", "math")}
    runs.update({"flex-eval": TINY + evaluate + ["--attention-kernel", "flex"],
                 "math-eval": TINY + evaluate + ["--attention-kernel", "math"]})
    results = dict(zip(runs, run_distributed(_runs, 1, list(runs.values()))[0]))
    print({k: v for k, v in results.items()})
    for k in ("auto", "cpu_flash", "tiled", "math"):
        assert len(results[k]["losses"]) == 2 and len(results[k]["eval"]) == 1
        assert all(torch.isfinite(torch.tensor(results[k]["losses"] + results[k]["eval"])))
    assert results["auto"] == results["cpu_flash"]  # the same kernel on CPU
    # tiled / cpu_flash vs math, fp32: the same sums in another order (tiles or flash pieces merged by
    # LSE), a few ulps (6e-8) per value carried through 2 layers, 2 steps: far inside 1e-5
    for k in ("tiled", "cpu_flash"):
        for a, b in zip(results[k]["losses"] + results[k]["eval"],
                        results["math"]["losses"] + results["math"]["eval"]):
            assert abs(a - b) <= 1e-5 * abs(b), (k, a, b)
    (flex,), (math,) = results["flex-eval"]["eval"], results["math-eval"]["eval"]
    assert abs(flex - math) <= 1e-5 * abs(math), (flex, math)
    # flex cannot train on CPU, flash cannot run: one argument error each, naming the flag
    for kernel, needle in (("flex", "--attention-kernel flex (or --attention-backend flash/fused) trains on CUDA only"),
                           ("flash", "--attention-kernel flash runs on CUDA only")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            parse_args(TINY + ["--attention-kernel", kernel], world_size=1)
        assert needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_choice_lines_follow_the_current_stderr(monkeypatch):
    """An app that sends the choice lines to stderr (generate, dflash evaluate) keeps sending them to
    whatever sys.stderr is when a line is printed: under pytest an in-process app ran with a captured
    stderr that is closed afterwards, and holding that stream broke every later test's first forward
    with 'I/O operation on closed file' (CI of round 23)."""
    import io
    import sys

    import torch

    from megatron_csbp.attention.kernels import capability

    monkeypatch.setattr(capability, "_TO_STDERR", False)
    monkeypatch.setattr(capability, "_LOGGED", set())
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    capability.info_to_stderr()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    first.close()
    capability.choose("tiled", torch.device("cpu"), 8, torch.float32)
    assert "attention kernel: tiled for head dim 8" in sys.stderr.getvalue()
