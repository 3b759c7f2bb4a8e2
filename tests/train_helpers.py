"""Shared helpers of the training tests (module level, so spawned ranks can import them)."""
TINY = ("--mock-data --vocab-size 64 --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
        "--num-query-groups 2 --seq-length 32 --block-size 8 --micro-batch-size 2 --global-batch-size 4 "
        "--log-interval 1 --lr 1e-2 --min-lr 1e-3 --lr-warmup-iters 1 --no-progress-bar").split()


def train_rank(rank, world_size, argv):
    from megatron_csbp.training.loop import main
    result = main(list(argv))
    return {"losses": [h["loss"] for h in result["history"] if "loss" in h],
            "history": result["history"], "iteration": result["iteration"]}


def train_command(argv, nproc=None, torchrun_flags=(), torchrun="torch.distributed.run"):
    """`python -m megatron_csbp.train ARGV` (one process, no torchrun) or, with `nproc`, under torchrun
    (the module `torchrun`: torch's, or megatron_csbp.launch.torchrun)."""
    import sys
    if nproc is None:
        return [sys.executable, "-m", "megatron_csbp.train"] + list(argv)
    return ([sys.executable, "-m", torchrun, "--standalone", "--nproc-per-node", str(nproc)]
            + list(torchrun_flags) + ["-m", "megatron_csbp.train"] + list(argv))


def run_train(argv, nproc=None, timeout=300):
    """Run the trainer CLI to the end; the CompletedProcess (text stdout/stderr)."""
    import subprocess
    return subprocess.run(train_command(argv, nproc), capture_output=True, text=True, timeout=timeout)


def error_lines(text):
    """The lines a CLI printed as its error (`error: ...`, megatron_csbp/utils/cli.py)."""
    return [line for line in text.splitlines() if line.startswith("error")]


def json_log(path):
    """The records of a --log-json file, in the order written."""
    import json
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
