"""Shared helpers of the training tests (module level, so spawned ranks can import them)."""
TINY = ("--mock-data --vocab-size 64 --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
        "--num-query-groups 2 --seq-length 32 --block-size 8 --micro-batch-size 2 --global-batch-size 4 "
        "--log-interval 1 --lr 1e-2 --min-lr 1e-3 --lr-warmup-iters 1 --no-progress-bar").split()


def train_rank(rank, world_size, argv):
    from megatron_csbp.training.loop import main
    result = main(list(argv))
    return {"losses": [h["loss"] for h in result["history"] if "loss" in h],
            "history": result["history"], "iteration": result["iteration"]}
