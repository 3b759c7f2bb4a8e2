"""Failing loudly (issue 20): a diverged run stops naming the iteration and never saves non-finite
weights; bad flags, a missing step, flags that disagree with the checkpoint, a checkpoint an
objective needs but --load does not hold, and damaged checkpoint files are each one line naming
the flag or file; `python -m megatron_csbp.train` without torchrun runs one process."""
import os
import re
import shutil

import pytest

from megatron_csbp.checkpoint import files
from megatron_csbp.training.arguments import build_parser, parse_args, validate_args
from tests.train_helpers import TINY, error_lines, run_train


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint folder the trainer wrote (iteration 2), by `python -m megatron_csbp.train`
    without torchrun."""
    save = str(tmp_path_factory.mktemp("failloud") / "ckpt")
    return save, run_train(TINY + ["--train-iters", "2", "--save", save])


@pytest.mark.quick
def test_train_without_torchrun_runs_one_process(saved):
    save, out = saved
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world 1 = TP 1" in out.stdout
    assert files.read_tracker(save) == 2


def _one_line(argv, capsys, world=1):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "usage:" not in err, err  # one line, no usage dump
    return err.strip()


@pytest.mark.parametrize("flags,line", [
    (["--micro-batch-size", "0"], "error: --micro-batch-size must be positive, got 0"),
    (["--global-batch-size", "-4"], "error: --global-batch-size must be positive, got -4"),
    (["--train-iters", "-1"], "error: --train-iters must be at least 0, got -1"),
    (["--ckpt-step", "2"], "error: --ckpt-step 2 needs --load DIR"),
    (["--bogus-flag"], "error: unrecognized arguments: --bogus-flag (see python -m megatron_csbp.train --help)"),
    # a prefix of --block-parallel-size is not that flag (Megatron-LM's parser: allow_abbrev=False)
    (["--block-parallel", "1"], "error: unrecognized arguments: --block-parallel 1 (see python -m megatron_csbp.train --help)"),
    (["--objective", "fast-dllm-v2", "--mask-token-id", "5"],
     "error: --objective fast-dllm-v2 adapts a pretrained autoregressive model: give --load DIR (a checkpoint, "
     "e.g. from python -m megatron_csbp.convert hf-to-megatron)"),
])
@pytest.mark.quick
def test_bad_flags_one_line(flags, line, capsys):
    assert _one_line(TINY + flags, capsys) == line


def test_checkpoint_refusals_name_the_flag(saved, tmp_path, capsys):
    save, out = saved
    assert out.returncode == 0
    # a step that was not saved: the saved ones are listed
    assert _one_line(TINY + ["--load", save, "--ckpt-step", "99"], capsys) == \
        f"error: --ckpt-step 99: --load {save} has no iter_0000099 (it holds iterations 2)"
    # another model than the checkpoint's: the first differing flag, before megatron-core reads anything
    for flags, line in ((["--hidden-size", "64"], "--hidden-size 64 differs from the checkpoint's 32"),
                        (["--num-layers", "3"], "--num-layers 3 differs from the checkpoint's 2"),
                        (["--num-query-groups", "4"], "--num-query-groups 4 differs from the checkpoint's 2"),
                        (["--untie-embeddings-and-output-weights"],
                         "--untie-embeddings-and-output-weights True differs from the checkpoint's False")):
        assert _one_line(TINY + ["--load", save] + flags, capsys) == \
            f"error: {line} (--load {save}, iter_0000002/bdlm_meta.json): resume with the model flags it was trained with"
    parse_args(TINY + ["--load", save], world_size=1)  # the same flags resume
    # a mistyped --load with an objective that adapts a pretrained model
    typo = str(tmp_path / "no_such_ckpt")
    assert _one_line(TINY + ["--load", typo, "--objective", "fast-dllm-v2", "--mask-token-id", "5"], capsys) == \
        (f"error: --objective fast-dllm-v2 adapts a pretrained autoregressive model: --load {typo} holds no "
         "checkpoint (no latest_checkpointed_iteration.txt; the folder does not exist)")
    # Megatron's --finetune (whichever parser declares it) starts from --load's weights too
    args = build_parser().parse_args(TINY + ["--load", typo])
    args.finetune = True
    with pytest.raises(ValueError, match=re.escape(f"--finetune starts from the weights of --load: --load {typo} "
                                                   "holds no checkpoint")):
        validate_args(args, 1)


def test_eval_iters_defaults_to_megatron_100_when_evaluating():
    assert parse_args(TINY + ["--eval-interval", "2"], world_size=1).eval_iters == 100
    assert parse_args(TINY + ["--skip-train"], world_size=1).eval_iters == 100
    assert parse_args(TINY, world_size=1).eval_iters == 0  # no evaluation asked for: no held-out batches


def test_damaged_checkpoint_files_are_named(saved, tmp_path):
    save, out = saved
    assert out.returncode == 0
    src = files.iteration_dir(save, 2)
    assert files.verify_files(src) is None
    # torch_dist writes thread_count files per rank (__0_0.distcp, ...): megatron-core 0.16.1's default
    # is 2, 0.19's is 1; damage the first and remove the last, whichever they are.
    data_files = sorted(f for f in os.listdir(src) if f.endswith(".distcp"))
    assert data_files and data_files[0] == "__0_0.distcp", data_files
    first, last = data_files[0], data_files[-1]
    cases = {}
    for name, damage in (("truncated", lambda d: os.truncate(os.path.join(d, first), 1000)),
                         ("missing", lambda d: os.remove(os.path.join(d, last))),
                         ("metadata", lambda d: os.truncate(os.path.join(d, ".metadata"), 100))):
        d = str(tmp_path / name)
        shutil.copytree(src, d)
        damage(d)
        cases[name] = files.verify_files(d)
    assert re.fullmatch(r".*/truncated/__0_0\.distcp is truncated \(1000 bytes; \.metadata says at least \d+\)",
                        cases["truncated"])
    assert cases["missing"].endswith(f"/missing/{last} is missing")
    assert cases["metadata"].startswith(str(tmp_path / "metadata" / ".metadata") + " is corrupt or truncated")


def test_truncated_checkpoint_resume_names_the_file(saved, tmp_path):
    """Before: a bare EOFError traceback from torch's reader."""
    save, out = saved
    assert out.returncode == 0
    copy = str(tmp_path / "ckpt")
    shutil.copytree(save, copy)
    distcp = os.path.join(files.iteration_dir(copy, 2), "__0_0.distcp")
    os.truncate(distcp, os.path.getsize(distcp) // 2)
    r = run_train(TINY + ["--train-iters", "3", "--load", copy])
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert line.startswith(f"error: cannot load checkpoint {files.iteration_dir(copy, 2)}: {distcp} is "
                           "truncated"), line
    assert "Traceback" not in r.stderr


def test_non_finite_loss_or_grad_stops_the_run(tmp_path):
    """Before: `--lr 1e6 --clip-grad 0` trained on, logged skipped false, saved NaN weights, exit 0."""
    save = str(tmp_path / "ckpt")
    r = run_train(TINY + ["--lr", "1e6", "--clip-grad", "0", "--train-iters", "8", "--save", save,
                          "--save-interval", "1"])
    assert r.returncode == 1, r.stderr[-3000:]
    (line,) = error_lines(r.stderr)
    m = re.fullmatch(r"error: iteration (\d+): the (loss|gradient norm) is (nan|inf|-inf); stopped .*"
                     r"\(--check-for-nan-in-loss-and-grad; the latest checkpoint is iteration (\d+) in (.*); "
                     r"try a lower --lr or --clip-grad > 0\)", line)
    assert m, line
    stopped, latest = int(m.group(1)), int(m.group(4))
    assert latest == stopped - 1 and m.group(5) == save and stopped < 8
    assert files.read_tracker(save) == latest
    assert files.saved_iterations(save) == list(range(1, stopped))
    assert "Traceback" not in r.stderr


def test_unchecked_divergence_never_saves_non_finite_weights(tmp_path):
    save = str(tmp_path / "ckpt")
    r = run_train(TINY + ["--lr", "1e6", "--clip-grad", "0", "--train-iters", "8", "--save", save,
                          "--save-interval", "1", "--no-check-for-nan-in-loss-and-grad"])
    assert r.returncode == 1, r.stderr[-3000:]
    (line,) = error_lines(r.stderr)
    m = re.fullmatch(r"error: iteration (\d+): the weights hold NaN or infinite values; not saving a checkpoint "
                     r"\(the last one saved stays the latest\)", line)
    assert m, line
    assert files.read_tracker(save) == int(m.group(1)) - 1


def test_old_null_tokenizer_checkpoint_is_refused_naming_vocab_size(saved, tmp_path, capsys):
    """A checkpoint saved under the other meaning of NullTokenizer's --vocab-size V (tests/test_null_tokenizer.py)
    does not resume as another vocabulary: one line names --vocab-size, the rule and the flag that
    rebuilds its tokenizer. On megatron-core 0.16.1 (V + 1 ids) the other meaning is the trainer's
    old one (V ids, EOD V - 1, mask V - 2); on 0.19 (V ids) it is a 0.16.1 run's (V + 1 ids, EOD V,
    mask V + 1), which then resumes with --vocab-size V + 1 as it was."""
    import json

    from megatron_csbp.data.megatron_data import null_tokenizer_counts_eod, null_tokenizer_rule, saved_tokenizer
    from megatron_csbp.model.builder import embedding_rows

    assert saved[1].returncode == 0
    save = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], save)
    meta_path = os.path.join(save, "iter_0000002", "bdlm_meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    m = meta["model_args"]
    this = (64, 63, 64) if null_tokenizer_counts_eod() else (65, 64, 65)  # --vocab-size 64: vocabulary, EOD, mask
    assert (m["vocab_size"], m["eod_token_id"], m["mask_token_id"], m["padded_vocab_size"]) == this + (128,)
    # What the other meaning saved for the same flags (the same 128 embedding rows, so same tensors).
    other = (65, 64, 65) if null_tokenizer_counts_eod() else (64, 63, 62)
    m.update(vocab_size=other[0], eod_token_id=other[1], mask_token_id=other[2])
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    where = f"--load {save}, iter_0000002/bdlm_meta.json"
    flag = 65 if null_tokenizer_counts_eod() else 63  # the --vocab-size whose tokenizer has other[0] ids

    # the same command: refused, naming the flag and the rule
    assert _one_line(TINY + ["--load", save], capsys) == (
        f"error: --vocab-size 64 gives {this[0]} token ids, the checkpoint's NullTokenizer has {other[0]} ({where}; "
        f"{null_tokenizer_rule()}): resume with --vocab-size {flag}")
    again = TINY[:1] + ["--vocab-size", str(flag)] + TINY[3:] + ["--load", save]
    if not null_tokenizer_counts_eod():
        # the same vocabulary, but the default mask id moved: refused too
        assert _one_line(again, capsys) == (f"error: --mask-token-id 64 differs from the checkpoint's 62 ({where}): the "
                                            "model was trained to fill that id; resume with --mask-token-id 62")
        again += ["--mask-token-id", "62"]
    # then: the checkpoint's tokenizer exactly, and its readers rebuild the same one
    a = facts = parse_args(again, world_size=1)
    assert (a.vocab_size, facts.eod_token_id, a.mask_token_id, embedding_rows(a, facts.model_shape)) == other + (128,)
    assert saved_tokenizer(m["tokenizer_type"], None, m["vocab_size"]).eod == other[1]
