"""Megatron-LM's training, checkpoint and logging flags in the trainer (training/megatron_flags.py),
each doing what it does in Megatron-LM: --train-samples, --lr-warmup-fraction, --finetune,
--no-load-optim, --no-load-rng, --overlap-grad-reduce / --overlap-param-gather, --ckpt-format,
--save-retain-interval, --wandb-project / --wandb-exp-name / --wandb-save-dir."""
import json
import os

import pytest

from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank


def parse(argv, world_size=1):
    from megatron_csbp.training.arguments import build_parser, validate_args

    return validate_args(build_parser().parse_args(list(argv)), world_size)


@pytest.mark.parametrize("extra,named", [
    (["--train-samples", "8", "--train-iters", "2"], "--train-iters or --train-samples"),
    (["--train-samples", "6"], "--train-samples 6 must be a positive multiple of --global-batch-size 4"),
    (["--lr-warmup-fraction", "0.1"], "--lr-warmup-iters or --lr-warmup-fraction"),  # TINY has --lr-warmup-iters 1
    (["--num-workers", "-1"], "--num-workers must be >= 0"),
    (["--ckpt-format", "torch"], "--ckpt-format torch: the trainer writes and reads torch_dist"),
    (["--finetune"], "--finetune needs --load"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--save", "x", "--save-interval", "2", "--save-retain-interval", "3"],
     "--save-retain-interval 3 must be a positive multiple of --save-interval 2"),
    (["--wandb-project", "p", "--save", "x"], "--wandb-project needs --wandb-exp-name"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be positive"),
])
def test_bad_flag_values_name_the_flag(extra, named):
    with pytest.raises(ValueError, match=named):
        parse(TINY + extra)


def test_train_samples_sets_the_iterations():
    assert parse(TINY + ["--train-samples", "12"]).train_iters == 3
    assert parse(TINY).train_iters == 100


@pytest.mark.slow  # suite budget (docs/testing.md)
def test_warmup_fraction_finetune_no_load_optim_and_retention(tmp_path):
    save = str(tmp_path / "ckpt")
    i = TINY.index("--lr-warmup-iters")
    base = TINY[:i] + TINY[i + 2:]
    # --lr-warmup-fraction 0.5 of 4 iterations x 4 samples: warmup over 8 samples (Megatron's steps),
    # so lr after iteration 1 (4 samples) is lr * 4 / 8.
    argv = base + ["--train-iters", "4", "--lr-warmup-fraction", "0.5", "--save", save, "--save-interval", "1",
                   "--save-retain-interval", "2", "--exit-interval", "3"]
    first = run_distributed(train_rank, 1, argv)[0]
    lrs = {h["iteration"]: h["lr"] for h in first["history"]}
    assert lrs[1] == pytest.approx(1e-2 * 4 / 8, rel=1e-12), lrs
    # --save-retain-interval 2: iteration 1 was deleted when 2 was saved; 2 (a multiple) and 3 (latest) stay
    kept = sorted(d for d in os.listdir(save) if d.startswith("iter_"))
    assert kept == ["iter_0000002", "iter_0000003"], kept

    # --no-load-optim: resumes at iteration 3 with a fresh optimizer and scheduler (Megatron: the
    # schedule restarts), so its lr equals the fresh run's first one
    res = run_distributed(train_rank, 1, base + ["--train-iters", "4", "--lr-warmup-fraction", "0.5", "--load", save,
                                                 "--no-load-optim", "--no-load-rng"])[0]
    assert res["history"][0]["iteration"] == 4 and res["history"][0]["lr"] == pytest.approx(lrs[1], rel=1e-12)

    # --finetune: the weights of iteration 3, iteration 0, no optimizer state: the first step's loss
    # is the resumed weights' loss on the first batch, not the fresh model's
    fine = run_distributed(train_rank, 1, base + ["--train-iters", "1", "--load", save, "--finetune"])[0]
    fresh = run_distributed(train_rank, 1, base + ["--train-iters", "1"])[0]
    assert fine["iteration"] == 1 and fine["history"][0]["consumed_samples"] == 4
    assert fine["losses"][0] != fresh["losses"][0]
    assert fine["losses"][0] == pytest.approx(fresh["losses"][0], rel=0.5)  # same data, trained weights


@pytest.mark.slow  # suite budget (4-rank DP run)
def test_overlap_flags_give_the_same_losses(tmp_path):
    """DP = 2 with the distributed optimizer: overlapping the gradient reduce-scatter and the
    parameter all-gather changes when collectives run, not what they sum (two addends per element:
    commutative, so bit-identical)."""
    argv = TINY + ["--train-iters", "3", "--use-distributed-optimizer"]
    plain = run_distributed(train_rank, 2, argv)[0]["losses"]
    save = str(tmp_path / "ckpt")
    overlap = run_distributed(train_rank, 2, argv + ["--overlap-grad-reduce", "--overlap-param-gather",
                                                     "--save", save])[0]["losses"]
    assert overlap == plain, (overlap, plain)
    assert os.path.isdir(os.path.join(save, "iter_0000003"))


@pytest.mark.slow  # suite budget
def test_num_workers_read_the_same_batches():
    """--num-workers 2: DataLoader workers read the micro-batches ahead, in the sampler's order; the
    losses are those of reading them in the training process (identical inputs, identical math)."""
    argv = TINY + ["--train-iters", "3"]
    assert run_distributed(train_rank, 1, argv + ["--num-workers", "2"])[0]["losses"] == \
        run_distributed(train_rank, 1, argv)[0]["losses"]


def test_wandb_offline_logs_megatron_names(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wdir = tmp_path / "wandb"
    res = run_distributed(train_rank, 1, TINY + ["--train-iters", "2", "--wandb-project", "csbp-test",
                                                 "--wandb-exp-name", "tiny", "--wandb-save-dir", str(wdir)])[0]
    runs = [p for p in (wdir / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(runs) == 1, list((wdir / "wandb").iterdir())
    history = wandb_history(next(runs[0].glob("*.wandb")))
    assert [h["_step"] for h in history] == [1, 2]
    assert [h["lm loss"] for h in history] == pytest.approx(res["losses"])
    assert all("grad-norm" in h and "learning-rate" in h for h in history)


def wandb_history(path):
    """The history rows of a wandb transaction log (`run-*.wandb`: a 7-byte header, then LevelDB-log
    records of 32 KiB blocks holding `wandb_internal_pb2.Record` messages)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunk, rows = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST piece of a record
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow  # suite budget (15 s): fp16 saves and resumes by default in tests/test_checkpoint_precision.py; this is the loss-scale run
def test_fp16_trains_with_megatrons_loss_scale():
    """--fp16 (Megatron's mixed precision: float16 weights, fp32 main weights, dynamic loss scale).
    The first loss is the fp32 model's rounded to float16 weights and activations: unit roundoff
    u16 = 4.9e-4 per operation, about 20 roundings along a path through 2 layers and the output
    layer, so |fp16 - fp32| / fp32 <= 20 u16 ~ 1e-2; bound 3e-2. Every step's loss is finite, and
    steps whose scaled gradients overflow (the dynamic scale starts at 2^32, Megatron's default) are
    skipped, not applied."""
    import math

    argv = TINY + ["--train-iters", "4"]
    fp32 = run_distributed(train_rank, 1, argv)[0]
    fp16 = run_distributed(train_rank, 1, argv + ["--fp16", "--initial-loss-scale", "1024"])[0]
    assert all(math.isfinite(x) for x in fp16["losses"])
    assert abs(fp16["losses"][0] - fp32["losses"][0]) <= 3e-2 * abs(fp32["losses"][0]), (fp16["losses"], fp32["losses"])
    assert any(not h.get("skipped", False) for h in fp16["history"] if "loss" in h)  # it trains
    with pytest.raises(ValueError, match="give --bf16 or --fp16, not both"):
        parse(argv + ["--fp16", "--bf16"])


def _bf16_grads_rank(rank, world_size, argv):
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    with Trainer(TrainerConfig.from_args(parse_args(list(argv)))) as trainer:
        dtypes = sorted({(str(b.param_dtype), str(b.grad_dtype)) for d in trainer.ddps for b in d.buffers})
        result = trainer.train()
    return {"grad_dtypes": dtypes, "losses": [h["loss"] for h in result["history"] if "loss" in h]}


def test_grad_reduce_in_bf16_is_megatrons():
    """--grad-reduce-in-bf16 (Megatron-LM's; the planner prints it for its lean memory settings):
    with --bf16 the bf16 parameters' DDP gradient buffers are bfloat16 instead of fp32, on 2
    data-parallel ranks. The first loss comes before any update, so it is the --bf16 run's to the
    bit; later losses differ by the gradients' rounding only (|d loss| <= lr x |grad| x 2^-8 per
    step is far below the 5e-2 bound). Without --bf16 the flag is refused in one line."""
    import math

    argv = TINY + ["--train-iters", "3", "--bf16"]
    fp32_grads = run_distributed(_bf16_grads_rank, 2, argv)[0]
    bf16_grads = run_distributed(_bf16_grads_rank, 2, argv + ["--grad-reduce-in-bf16"])[0]
    # (param dtype, grad dtype) per DDP buffer: the norms' weights stay fp32 under --bf16, their
    # gradients too (Megatron's rule: without fp32 reduction a gradient has its parameter's dtype)
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    assert fp32_grads["grad_dtypes"] == [(bf16, fp32), (fp32, fp32)]
    assert bf16_grads["grad_dtypes"] == [(bf16, bf16), (fp32, fp32)]
    assert bf16_grads["losses"][0] == fp32_grads["losses"][0]
    assert all(math.isfinite(x) and abs(x - y) <= 5e-2 * abs(y)
               for x, y in zip(bf16_grads["losses"], fp32_grads["losses"]))
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16 reduces bfloat16 gradients: it needs --bf16"):
        parse(TINY + ["--grad-reduce-in-bf16"])
