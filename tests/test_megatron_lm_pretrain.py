"""Megatron-LM's own `pretrain()` (tag core_v0.16.1 on megatron-core 0.16.1, core_v0.19.0 on 0.19.2)
trains a BDLM through the plugin (examples/megatron_lm/pretrain_bdlm.py) on CPU gloo ranks launched
with torchrun.

Runs when Megatron-LM's training package is found (`megatron_csbp.utils.megatron_lm_path`:
MEGATRON_LM_PATH, else the cache directory of docs/megatron-lm.md for the installed megatron-core);
the script is launched without MEGATRON_LM_PATH (unless the caller set it) and finds the same one
itself. The default test launches three runs:
  A. 1 rank, 3 iterations, no evaluation (--eval-interval unset: the plugin's default), a torch_dist
     checkpoint at iteration 2;
  B. CSBP (CP 2 + BP 2: Megatron sees --context-parallel-size 2, i.e. 2 ranks), 3 iterations, an
     evaluation after iteration 2;
  C. 1 rank, --load A's iteration-2 checkpoint, iteration 3.
B's losses equal A's (Megatron's 6-digit log lines exactly; TensorBoard's fp32 values to 1e-5, the
tolerance of tests/test_train_layouts.py: fp32 sums in another order on 2 ranks, ~1e-7 relative
per operation over a 2-layer model), so neither the layout nor the evaluation moves the training
loss. C's iteration 3 equals A's bit for bit (TensorBoard float32). The other combinations
(1 rank with evaluation, CSBP without, CSBP resume) are -m slow."""
import os
import re
import subprocess
import sys

import pytest

from megatron_csbp.utils.megatron_lm_path import find, missing_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLM = find()
pytestmark = pytest.mark.skipif(not MLM, reason=missing_message())


def null_tokenizer(vocab_size=64):
    """megatron-core's NullTokenizer(--vocab-size), the one Megatron-LM and the trainer build: ids
    0..V-1 plus EOD V on megatron-core 0.16.1, ids 0..V-1 with EOD V-1 on 0.19.2."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(vocab_size)

# The Megatron-LM flags of a tiny CPU run (docs/megatron-lm.md lists why each CPU flag is needed).
ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 1 --global-batch-size 2 --block-size 8 --vocab-size 64 --tokenizer-type NullTokenizer "
        "--mock-data --attention-dropout 0 --hidden-dropout 0 --position-embedding-type rope "
        "--normalization RMSNorm --disable-bias-linear --lr 1e-3 --train-iters 3 --log-interval 1 "
        "--distributed-backend gloo --transformer-impl local --use-cpu-initialization "
        "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion "
        "--no-bias-dropout-fusion --no-rope-fusion").split()
CSBP = ["--context-parallel-size", "2", "--block-parallel-size", "2"]
NO_EVAL = ["--eval-iters", "0", "--eval-interval", "1000"]
# Run A leaves --eval-interval unset (Megatron-LM 0.16.1 alone fails on that; the plugin sets it)
NO_EVAL_UNSET_INTERVAL = ["--eval-iters", "0"]
EVAL_AT_2 = ["--eval-iters", "1", "--eval-interval", "2"]
LOG = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def launch(tmp_path, name, nproc, argv):
    """torchrun examples/megatron_lm/pretrain_bdlm.py argv: (return code, output). Megatron-LM is not
    put on PYTHONPATH: the script finds it (MEGATRON_LM_PATH only when the caller set it). `--standalone`:
    torchrun binds a free port itself, so runs on one machine (two test sessions) never collide."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "examples", "megatron_lm", "pretrain_bdlm.py"), *argv]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    (tmp_path / f"{name}.log").write_text(out)
    return proc.returncode, out


@pytest.mark.slow  # 2 Megatron-LM launches (~2 min on the shared 2 cores); tests/test_suite_ports.py guards by default
def test_two_launches_at_once_do_not_collide(tmp_path):
    """Two test sessions on one machine (a developer's and CI's) launching pretrain() at once: with the
    fixed --master-port of before, one run's store took the port of the other's (EADDRINUSE: 4 of 10
    failed that way). Each binds only while Megatron initializes and trains, so both run 1 iteration."""
    from concurrent.futures import ThreadPoolExecutor

    argv = [a for a in ARGV if a not in ("--train-iters", "3")] + ["--train-iters", "1"] + NO_EVAL
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda name: launch(tmp_path, name, 1, argv), ["first", "second"]))
    for code, out in runs:
        assert code == 0 and "EADDRINUSE" not in out, out[-3000:]
        assert re.search(r"iteration\s+1/\s*1 \|", out), out[-3000:]


def pretrain(tmp_path, name, nproc, extra):
    tb = tmp_path / f"tb_{name}"
    argv = [a for a in ARGV if not ("--data-path" in extra and a == "--mock-data")]
    code, out = launch(tmp_path, name, nproc, [*argv, "--tensorboard-dir", str(tb), *extra])
    assert code == 0, out[-6000:]
    lines = {int(i): (loss, gn) for i, loss, gn in LOG.findall(out)}
    return dict(log=lines, out=out, tb=_scalars(tb))


def _scalars(tb):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def _same_losses(a, b):
    assert sorted(a["log"]) == sorted(b["log"]) == [1, 2, 3]
    # Across layouts the fp32 sums run in another order: the losses differ by a few fp32 roundings
    # (measured: 1 unit in the 7th digit of Megatron's printed loss, ~2e-7 relative). The bound,
    # 1e-5 relative, is 50x that; the printed grad norm has 3 decimals, so it may differ by one
    # unit of the last printed digit plus that error. Same layout (resume, evaluation) stays exact.
    for i in (1, 2, 3):
        (loss_a, gn_a), (loss_b, gn_b) = a["log"][i], b["log"][i]  # Megatron-LM's own log lines
        assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-5, abs=0), (i, loss_a, loss_b)
        assert abs(float(gn_b) - float(gn_a)) <= 1e-3 + 1e-5 * abs(float(gn_a)), (i, gn_a, gn_b)
        assert b["tb"]["lm loss"][i] == pytest.approx(a["tb"]["lm loss"][i], rel=1e-5, abs=0)
    for r in (a, b):
        assert all(v == v and abs(v) != float("inf") for v in r["tb"]["lm loss"].values())


def test_pretrain_one_rank_vs_csbp_with_eval_and_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    a = pretrain(tmp_path, "one_rank", 1, NO_EVAL_UNSET_INTERVAL + ["--save", str(ckpt), "--save-interval", "2"])
    # the first padding id of NullTokenizer(64): 65 on megatron-core 0.16.1 (64 ids + EOD), 64 on 0.19.2
    assert f"> block diffusion: --objective bd3lm, mask token id {null_tokenizer().vocab_size}" in a["out"]
    assert "> block diffusion: --eval-interval unset: set to 4 (--train-iters + 1" in a["out"]
    assert (ckpt / "iter_0000002").is_dir()
    b = pretrain(tmp_path, "csbp_eval", 2, CSBP + EVAL_AT_2)
    assert re.search(r"validation loss at iteration 2 \| lm loss value: \S+", b["out"])
    assert 2 in b["tb"]["lm loss validation"]
    _same_losses(a, b)
    c = pretrain(tmp_path, "resume", 1, NO_EVAL + ["--load", str(ckpt), "--ckpt-step", "2"])
    assert "successfully loaded checkpoint" in c["out"] and sorted(c["log"]) == [3]
    assert c["tb"]["lm loss"][3] == a["tb"]["lm loss"][3]  # bit for bit (float32)
    assert c["tb"]["grad-norm"][3] == a["tb"]["grad-norm"][3]


def test_refused_flag_is_one_line_before_megatron_argument_dump(tmp_path):
    """Issue 34: a flag the plugin refuses (here Megatron's default --position-embedding-type
    learned_absolute) used to end in a traceback after Megatron-LM's ~700-line argument dump; now the
    plugin's checks run before Megatron's validate_args and the run ends with one line, status 2."""
    i = ARGV.index("--position-embedding-type")
    code, out = launch(tmp_path, "refused", 1, ARGV[:i] + ARGV[i + 2:])
    assert code != 0
    assert "error: --position-embedding-type learned_absolute is not supported with block diffusion" in out
    assert "exitcode  : 2" in out  # torchrun's failure summary: the status of cli.fail (bad input)
    assert "------------------------ arguments ------------------------" not in out  # Megatron's dump
    assert "megatron_csbp/training/megatron_lm.py" not in out  # no traceback through the plugin


@pytest.mark.slow
def test_pretrain_evaluation_never_moves_training_losses(tmp_path):
    a = pretrain(tmp_path, "one_rank", 1, NO_EVAL)
    b = pretrain(tmp_path, "one_rank_eval", 1, ["--eval-iters", "1", "--eval-interval", "1"])
    assert b["tb"]["lm loss"] == a["tb"]["lm loss"]  # bit for bit: evaluation after every iteration
    c = pretrain(tmp_path, "csbp", 2, CSBP + NO_EVAL)
    _same_losses(a, c)


@pytest.mark.slow
def test_pretrain_csbp_resume_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    a = pretrain(tmp_path, "csbp", 2, CSBP + NO_EVAL + ["--save", str(ckpt), "--save-interval", "2"])
    c = pretrain(tmp_path, "csbp_resume", 2, CSBP + NO_EVAL + ["--load", str(ckpt), "--ckpt-step", "2"])
    assert c["tb"]["lm loss"][3] == a["tb"]["lm loss"][3]
    assert c["tb"]["grad-norm"][3] == a["tb"]["grad-norm"][3]


PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def short_documents(tmp_path) -> str:
    """An indexed corpus of short documents (3 to 12 tokens below NullTokenizer(64)'s EOD, each ended by
    that EOD: 64 on megatron-core 0.16.1, 63 on 0.19.2), so that every 32-token sample packs several;
    Megatron-LM's --data-path reads it."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    eod = int(null_tokenizer().eod)
    prefix = str(tmp_path / "short_docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    g = torch.Generator().manual_seed(5)
    for _ in range(400):
        n = int(torch.randint(3, 13, (1,), generator=g))
        builder.add_document(torch.cat([torch.randint(0, eod, (n,), generator=g), torch.tensor([eod])]), [n + 1])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.slow  # suite budget: test_megatron_lm_hooks checks the flags are accepted and reach the model by default
def test_pretrain_packed_documents_one_rank_vs_csbp(tmp_path):
    """Megatron's own packed-document flags (refused before issue 22) on a corpus of short
    documents: CSBP's losses equal one rank's (that they differ from the unpacked run, documents no
    longer attending each other: the slow test below)."""
    data = ["--data-path", short_documents(tmp_path), "--split", "100,0,0"]
    a = pretrain(tmp_path, "packed_one_rank", 1, NO_EVAL + PACKED + data)
    b = pretrain(tmp_path, "packed_csbp", 2, CSBP + NO_EVAL + PACKED + data)
    _same_losses(a, b)


@pytest.mark.slow
def test_pretrain_packed_documents_differ_from_unpacked(tmp_path):
    data = ["--data-path", short_documents(tmp_path), "--split", "100,0,0"]
    a = pretrain(tmp_path, "packed_one_rank", 1, NO_EVAL + PACKED + data)
    plain = pretrain(tmp_path, "plain_one_rank", 1, NO_EVAL + data)
    assert plain["tb"]["lm loss"][1] != pytest.approx(a["tb"]["lm loss"][1], rel=1e-4)


@pytest.mark.slow
def test_pretrain_pipeline_csbp_matches_one_rank(tmp_path):
    """PP 2 x CSBP (CP 2 + BP 2) in Megatron-LM's own loop: 4 ranks, 4 micro-batches per iteration
    (more than the 2 stages), tied embeddings synced by megatron-core; the same losses as one rank
    (which the trainer's tests/test_train_pipeline.py matches too)."""
    batch = ["--global-batch-size", "4"]
    a = pretrain(tmp_path, "one_rank_gb4", 1, NO_EVAL + batch)
    b = pretrain(tmp_path, "pp2_csbp", 4, NO_EVAL + batch + CSBP + ["--pipeline-model-parallel-size", "2"])
    _same_losses(a, b)


@pytest.mark.slow  # ~95 s on the shared 2-core machine
def test_pretrain_interleaved_pipeline_matches_one_rank(tmp_path):
    """Interleaved 1F1B in Megatron-LM's own loop: PP 2 x VP 2 (4 layers, one per virtual stage) on
    2 ranks, 4 micro-batches per iteration; the same losses as one rank. Megatron-LM turns on
    `deallocate_pipeline_outputs` and the interleaved schedule overlaps its P2P: before the CPU
    shim kept a sent output's storage alive (compat.pipeline.patch_output_deallocation), gloo sent
    freed memory and the losses changed from run to run (measured: 3 of 3 runs off one rank's)."""
    extra = ["--global-batch-size", "4", "--num-layers", "4"]
    a = pretrain(tmp_path, "one_rank_4l", 1, NO_EVAL + extra)
    b = pretrain(tmp_path, "pp2_vp2", 2, NO_EVAL + extra + ["--pipeline-model-parallel-size", "2",
                                                            "--num-layers-per-virtual-pipeline-stage", "1"])
    _same_losses(a, b)


# The trainer (python -m megatron_csbp.train) and Megatron-LM's pretrain() on the same --data-path
# corpus and flags (docs/megatron-lm.md "The trainer and pretrain() agree"). Given to both: the
# model flags whose trainer defaults are not Megatron-LM's (--swiglu is on in the trainer, and its
# --ffn-hidden-size is 8h/3 rounded up to 16 where Megatron-LM rounds 4h*2/3 down to 64: 0 here).
# The optimizer and schedule flags are left to their defaults, which are Megatron-LM's in both
# (--min-lr 0, --lr-decay-style linear, --adam-beta2 0.999, ...). NullTokenizer(--vocab-size 64) is
# Megatron-LM's in both (ids 0..63 plus EOD 64, padded to 128, mask id the padding id 65): before the
# trainer took that meaning (EOD 63, mask 62) pretrain() needed --mask-token-id 62
# --allow-mask-token-in-vocab here, and the packed-document flags, which read the EOD, disagreed.
SAME_RUN = ["--swiglu", "--ffn-hidden-size", "64"]


def _trainer_argv(tmp_path, name, extra):
    """ARGV for python -m megatron_csbp.train: it always initialises on the CPU generator (so it has
    no --use-cpu-initialization flag) and logs through --log-json (each iteration's fp32 loss)."""
    argv = [a for a in ARGV if a not in ("--mock-data", "--use-cpu-initialization")]
    return argv + ["--no-progress-bar", "--data-cache-path", str(tmp_path / f"cache_{name}")] + extra


def _mask_id_of_trainer(tmp_path):
    from megatron_csbp.training.arguments import parse_args

    return parse_args(_trainer_argv(tmp_path, "args", NO_EVAL + SAME_RUN + ["--mock-data"]), world_size=1).mask_token_id


def _trainer_equals_pretrain(trainer, run):
    """Each iteration's loss and gradient norm: the trainer's (its history) against pretrain()'s
    TensorBoard values (fp32). The same model, data, noise, normalisation and optimizer, so the
    only differences are fp32 sums in another order (the error model of `_same_losses`); 1e-5."""
    history = {h["iteration"]: h for h in trainer[0]["history"]}
    assert sorted(history) == sorted(run["tb"]["lm loss"]) == [1, 2, 3]
    for i in (1, 2, 3):
        assert history[i]["loss"] == pytest.approx(run["tb"]["lm loss"][i], rel=1e-5, abs=0), (i, history[i], run["tb"])
        assert history[i]["grad_norm"] == pytest.approx(run["tb"]["grad-norm"][i], rel=1e-5, abs=0), (i, history[i])


def _trainer_and_pretrain(tmp_path, name, nproc, extra):
    from tests.distributed import run_distributed
    from tests.train_helpers import train_rank

    data = ["--data-path", short_documents(tmp_path), "--split", "100,0,0"]
    run = pretrain(tmp_path, f"xc_{name}", nproc, NO_EVAL + data + SAME_RUN + extra)
    trainer = run_distributed(train_rank, nproc, _trainer_argv(tmp_path, name, NO_EVAL + data + SAME_RUN + extra))
    print(f"{name}: pretrain() lm loss {[run['tb']['lm loss'][i] for i in (1, 2, 3)]}, trainer "
          f"{[h['loss'] for h in trainer[0]['history'] if 'loss' in h]}")  # shown by pytest -s
    _trainer_equals_pretrain(trainer, run)
    return run, trainer


@pytest.mark.slow  # ~4 min on the shared 2-core machine: 2 pretrain() runs (1 and 2 ranks), 2 trainer runs
def test_trainer_and_pretrain_give_the_same_losses(tmp_path):
    """Issue 21: Megatron-LM's pretrain() and the plugin's trainer are one training run. On one rank
    and under CSBP (CP 2 + BP 2, 2 ranks) the trainer's losses and gradient norms equal pretrain()'s
    on the same corpus, on each megatron-core with its Megatron-LM tag (before this test: the trainer
    read text[:-1] of each sample where pretrain() diffuses labels = text[1:], and counted data
    tokens equal to the mask id in the loss denominator where pretrain() did not)."""
    one, trainer_one = _trainer_and_pretrain(tmp_path, "one_rank", 1, [])
    mask = null_tokenizer().vocab_size  # the first padding id: 65 on megatron-core 0.16.1, 64 on 0.19.2
    assert f"> block diffusion: --objective bd3lm, mask token id {mask}" in one["out"]
    assert trainer_one[0]["history"] and _mask_id_of_trainer(tmp_path) == mask
    _trainer_and_pretrain(tmp_path, "csbp", 2, CSBP)


@pytest.mark.slow  # ~4 min: pretrain() and the trainer on 4 ranks
def test_trainer_and_pretrain_agree_under_pipeline_csbp(tmp_path):
    """PP 2 x CSBP (CP 2 + BP 2, 4 ranks, 4 micro-batches per iteration): the same losses."""
    _trainer_and_pretrain(tmp_path, "pp_csbp", 4, ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2"]
                          + CSBP)


@pytest.mark.slow  # ~1 min: one pretrain() run and one trainer run, one rank
def test_trainer_and_pretrain_agree_on_packed_documents(tmp_path):
    """The packed-document flags read the EOD: with NullTokenizer's EOD the same id (64) in both, the
    trainer's losses and gradient norms under --reset-attention-mask --reset-position-ids
    --eod-mask-loss are pretrain()'s (before: the trainer's EOD was 63, so it packed other documents)."""
    from tests.distributed import run_distributed
    from tests.train_helpers import train_rank

    data = ["--data-path", short_documents(tmp_path), "--split", "100,0,0"]
    run = pretrain(tmp_path, "xc_packed", 1, NO_EVAL + data + SAME_RUN + PACKED)
    trainer = run_distributed(train_rank, 1, _trainer_argv(tmp_path, "packed", NO_EVAL + data + SAME_RUN + PACKED))
    _trainer_equals_pretrain(trainer, run)


LORA = ["--lora-rank", "4", "--lora-init", "random"]  # random: B != 0, so every adapter moves from iteration 1


@pytest.mark.slow  # ~3 min on the shared 2-core machine: a 1-rank trainer base, 2 pretrain() and 1 trainer run on 2 ranks
def test_pretrain_lora_csbp_matches_trainer_saves_adapters_and_resumes(tmp_path):
    """Issue 44: --lora-rank through Megatron-LM's pretrain() under CSBP (CP 2 + BP 2, 2 ranks) on a
    frozen base (--pretrained-checkpoint, a trainer checkpoint): (a) the trainer's losses and gradient
    norms with the same flags; (b) its checkpoint holds the adapters and their optimizer state only,
    beside megatron_csbp_lora.json naming the base; (c) --load of it with --pretrained-checkpoint
    continues with iteration 3 of the uninterrupted run bit for bit, so the base it trained on is the
    base it read (frozen: unchanged by 2 iterations). Before: pretrain() saved the base weights too,
    with no LoRA record, and Megatron-LM read --pretrained-checkpoint only when --load was empty."""
    import json

    from torch.distributed.checkpoint import FileSystemReader

    from megatron_csbp.lora import is_adapter
    from tests.distributed import run_distributed
    from tests.train_helpers import train_rank

    data = ["--data-path", short_documents(tmp_path), "--split", "100,0,0"] + NO_EVAL + SAME_RUN
    base, ckpt = tmp_path / "base", tmp_path / "lora"
    run_distributed(train_rank, 1, _trainer_argv(tmp_path, "base", data + ["--train-iters", "1", "--save", str(base)]))
    lora = CSBP + LORA + ["--pretrained-checkpoint", str(base)]
    run = pretrain(tmp_path, "lora_csbp", 2, data + lora + ["--save", str(ckpt), "--save-interval", "2"])
    assert "loaded the frozen base of the adapters from --pretrained-checkpoint" in run["out"]
    _trainer_equals_pretrain(run_distributed(train_rank, 2, _trainer_argv(tmp_path, "lora_csbp", data + lora)), run)

    saved = ckpt / "iter_0000002"
    keys = list(FileSystemReader(str(saved)).read_metadata().state_dict_metadata)
    model = [k for k in keys if k.split(".", 1)[0] in ("decoder", "embedding", "output_layer")]
    assert len(model) == 8 and all(is_adapter(k) for k in model), keys  # 4 targets x (A, B), layers stacked
    assert not [k for k in keys if k.endswith(("weight", ".bias"))], keys  # no base weight, nor its Adam state
    record = json.loads((saved / "megatron_csbp_lora.json").read_text())
    assert record["lora"]["rank"] == 4 and record["base"]["path"] == str(base) and record["base"]["iteration"] == 1

    resumed = pretrain(tmp_path, "lora_resume", 2, data + lora + ["--load", str(ckpt), "--ckpt-step", "2"])
    assert "successfully loaded checkpoint" in resumed["out"] and sorted(resumed["log"]) == [3]
    assert resumed["tb"]["lm loss"][3] == run["tb"]["lm loss"][3]
    assert resumed["tb"]["grad-norm"][3] == run["tb"]["grad-norm"][3]
