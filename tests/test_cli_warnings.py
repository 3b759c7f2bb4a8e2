"""Warnings a user cannot act on (megatron-core's TE/Apex notices, its FutureWarnings and those of
torch.distributed.checkpoint under megatron-core's dist_checkpointing) are filtered by every
`python -m megatron_csbp.*` command, in one place (`megatron_csbp.utils.cli.filter_warnings`).
Before, a short run printed 14 lines of them to stderr, and a resume 30 more per rank."""
import importlib
import os
import subprocess
import sys
import warnings

import pytest

from megatron_csbp.utils.cli import FILTERS

#: every `python -m megatron_csbp.X` command's main()
CLI_MAINS = ["training.loop", "generate", "conversion.cli", "planner.cli", "planner.validate", "dflash", "launch.recipes",
             "demo", "bench.__main__", "bench.decoding", "bench.kernel_rate", "bench.packing", "bench.pipeline", "data.preprocess", "data.tokenizer", "data.sft", "model.diffusiongemma.tiny"]

UNACTIONABLE = ("Transformer Engine", "Apex is not installed", "FutureWarning", "DeprecationWarning",
                "full scope is deprecated")


def _installed(filters) -> bool:
    return all(any(f[0] == action and f[2] is category and f[3] is not None and f[3].pattern == module
                   and (f[1].pattern if f[1] is not None else "") == message for f in filters)
               for action, message, category, module in FILTERS)


@pytest.mark.parametrize("module", CLI_MAINS)
def test_every_command_installs_the_filters(module, capsys):
    main = importlib.import_module(f"megatron_csbp.{module}").main
    with warnings.catch_warnings():
        warnings.resetwarnings()
        assert not _installed(warnings.filters)
        with pytest.raises(SystemExit):
            main(["--help"])
        assert _installed(warnings.filters), f"python -m megatron_csbp.{module} does not call filter_warnings()"
    capsys.readouterr()


def _train(argv, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "megatron_csbp.train",
           "--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
           "4", "--seq-length", "32", "--block-size", "8", "--micro-batch-size", "2", "--log-interval", "1",
           "--no-progress-bar", "--save", "ckpt"] + argv
    r = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow  # suite budget (29 s): every command installing the filters is checked by default
def test_a_short_run_and_its_resume_print_none_of_them(tmp_path):
    # the resume loads a checkpoint (and keeps its schedule: Megatron-LM refuses another --train-iters otherwise)
    for argv in (["--train-iters", "2"], ["--train-iters", "3", "--load", "ckpt", "--use-checkpoint-opt_param-scheduler"]):
        r = _train(argv, tmp_path)
        assert "iteration        2/" in r.stdout or "iteration        3/" in r.stdout
        print(f"stderr of {argv}: {r.stderr!r}")
        assert not [w for w in UNACTIONABLE if w in r.stderr], r.stderr
        assert "Warning" not in r.stderr, r.stderr


def test_a_two_rank_tensor_parallel_run_prints_none_of_them(tmp_path):
    """Every multi-rank run printed torch's FutureWarnings of the collectives megatron-core calls
    (`all_gather_into_tensor is deprecated`, 8 lines), a TP run 4 more asking for
    CUDA_DEVICE_MAX_CONNECTIONS=1, which means nothing on CPU."""
    from tests.train_helpers import TINY, train_command

    argv = TINY + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "2"]
    r = subprocess.run(train_command(argv, 2), cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # as torchrun sets it: no banner
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iteration        2/" in r.stdout
    assert r.stderr == "", r.stderr
