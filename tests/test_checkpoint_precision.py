"""--bf16 / --fp16 checkpoints: save, resume bit for bit, with and without the distributed optimizer,
with megatron-core's fp32 torch-norm weights beside the low-precision parameters (in their own
optimizer group, and with --add-bias-linear in one group with bf16 biases); --fp16 resumes its
dynamic loss scale. One rank and CSBP 2 ranks."""
import pytest

from tests.distributed import run_distributed
from tests.train_helpers import TINY


def _run(rank, world_size, argv, root, resume):
    """4 iterations saving at 2 and 4, or (`resume`) the resume from 2 to 4. The loss curve, the
    parameter dtypes, the loss scale at the end and (resume) before and right after the load."""
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    extra = ["--load", root, "--ckpt-step", "2"] if resume else ["--save", root, "--save-interval", "2"]
    with Trainer(TrainerConfig.from_args(parse_args(TINY + list(argv) + extra + ["--train-iters", "4"]))) as t:
        out = {"dtypes": sorted({str(p.dtype) for p in t.model.parameters()}),
               "fresh_scale": float(t.optimizer.get_loss_scale())}
        load = t.load

        def load_and_read_scale():
            loaded = load()
            out["loaded_scale"] = float(t.optimizer.get_loss_scale())
            return loaded

        t.load = load_and_read_scale
        result = t.train()
        out.update(losses=[h["loss"] for h in result["history"]], iteration=result["iteration"],
                   end_scale=float(t.optimizer.get_loss_scale()))
    return out


def _save_then_resume(rank, world_size, cases):
    """Both runs of each case in one process (one rank: a world can be made again after the last)."""
    return [(_run(rank, world_size, argv, root, False), _run(rank, world_size, argv, root, True))
            for argv, root in cases]


DIST = ["--use-distributed-optimizer"]
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "1"]


def _check(name, full, resumed):
    assert "torch.float32" in full["dtypes"] and len(full["dtypes"]) == 2, (name, full["dtypes"])  # fp32 norms too
    assert resumed["iteration"] == 4, name
    assert resumed["losses"] == full["losses"][2:], f"{name}: resume must continue the loss curve bit for bit"


def test_low_precision_save_and_resume_one_rank(tmp_path):
    """Before megatron-core's mixed-dtype optimizer fixes (compat/optimizer.py) --bf16 and --fp16
    without the distributed optimizer stopped at the first save ("Param id 9 does not match any
    model sharded param"), --bf16 --add-bias-linear with it too (a size mismatch in the DP-zero
    gather: bf16 biases and fp32 norms share the no-weight-decay group); the other two cases saved
    before (single-dtype groups). The fp16 loss scale doubles after each step without overflow
    (--loss-scale-window 1), so a resume that restarted it at --initial-loss-scale would differ."""
    cases = [(["--bf16"], "bf16"), (["--bf16", "--add-bias-linear"] + DIST, "bf16_bias_dist"),
             (["--bf16"] + DIST, "bf16_dist"), (FP16, "fp16"), (FP16 + DIST, "fp16_dist")]
    results = run_distributed(_save_then_resume, 1, [(a, str(tmp_path / n)) for a, n in cases])[0]
    for (_, name), (full, resumed) in zip(cases, results):
        _check(name, full, resumed)
        if name.startswith("fp16"):
            assert resumed["fresh_scale"] == 1024.0
            assert resumed["loaded_scale"] != 1024.0, (name, resumed)  # the checkpoint's scale, not the flag's
            assert resumed["end_scale"] == full["end_scale"], name


def test_bf16_save_and_resume_csbp_two_ranks(tmp_path):
    """CSBP (CP 2 + BP 2: one shard group of 2 ranks) in bf16 without the distributed optimizer
    (with it: tests/test_checkpoint.py's CSBP layout, fp32, and the one-rank cases above)."""
    argv, root = ["--bf16", "--context-parallel-size", "2", "--block-parallel-size", "2"], str(tmp_path / "csbp")
    full = run_distributed(_run, 2, argv, root, False)
    resumed = run_distributed(_run, 2, argv, root, True)
    for f, r in zip(full, resumed):
        _check("csbp", f, r)
