"""Issue 41: a run checks everything it needs before it deletes, trains or writes anything, and never
loses work. The default job keeps an earlier run; a `--load` that holds no checkpoint is refused
(unless it is the `--save` folder of a resumable job's first run); a `--save` tracker never moves
back; a save that fails leaves the previous checkpoint the latest, no `.tmp` folder, one line; a
corrupt checkpoint file (tensor bytes included: checksums) is one line naming it; data tokenized
with a larger vocabulary is refused; `convert` never writes into the folder it reads."""
import os
import resource
import shutil
import subprocess
import sys

import pytest

from megatron_csbp.checkpoint import files
from megatron_csbp.checkpoint.integrity import CHECKSUM_FILE
from megatron_csbp.training.arguments import parse_args
from tests.train_helpers import TINY, error_lines, run_train, train_command


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint folder the trainer wrote: iterations 2 (the tracker's) and 1."""
    save = str(tmp_path_factory.mktemp("safety") / "ckpt")
    out = run_train(TINY + ["--train-iters", "2", "--save-interval", "1", "--save", save])
    assert out.returncode == 0, out.stderr[-3000:]
    return save


def _copy(saved, tmp_path, name="ck"):
    dst = str(tmp_path / name)
    shutil.copytree(saved, dst)
    return dst


def _one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.strip()


def _tree(path):
    return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(path) for f in fs)


# ---- 1. the default job ---------------------------------------------------------------------------

def _earlier_run(run):
    os.makedirs(os.path.join(run, "checkpoints", "iter_0001382"))
    os.makedirs(os.path.join(run, "tensorboard"))
    for name, text in (("checkpoints/latest_checkpointed_iteration.txt", "1382"), ("log.jsonl", "{}\n"),
                       ("tensorboard/events.out", "x"), ("sample.txt", "earlier\n")):
        with open(os.path.join(run, name), "w") as f:
            f.write(text)


def test_default_job_on_a_bad_world_size_keeps_the_earlier_run(tmp_path):
    """Before: `torchrun --nproc-per-node 3 -m megatron_csbp.train` deleted runs/default's
    checkpoints, tensorboard/ and logs, then stopped on the --seq-length rule."""
    run = str(tmp_path / "runs" / "default")
    _earlier_run(run)
    before = _tree(str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGATRON_CSBP_DEMO_DIR", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        "-m", "megatron_csbp.train"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0
    assert "error: --seq-length 128 must be divisible by 2 x max(--context-parallel-size, --block-parallel-size) " \
           "= 6" in r.stderr, r.stderr[-3000:]
    assert _tree(str(tmp_path)) == before  # nothing deleted, nothing written (not even the data)


def test_default_job_again_picks_a_new_folder(tmp_path, monkeypatch):
    from megatron_csbp.training import demo

    base = str(tmp_path / "default")
    monkeypatch.setattr(demo, "RUN_DIR", base)
    monkeypatch.setattr(demo, "_run_dir", None)
    assert demo.run_dir() == base  # a fresh clone
    os.makedirs(os.path.join(base, "data"))  # what a run that stopped at its flags leaves: reused
    monkeypatch.setattr(demo, "_run_dir", None)
    assert demo.run_dir() == base
    _earlier_run(base)
    _earlier_run(base + "-2")
    monkeypatch.setattr(demo, "_run_dir", None)
    assert demo.run_dir() == base + "-3"
    assert "--save " + os.path.join(base + "-3", "checkpoints") in " ".join(demo.demo_argv(2, "p"))


@pytest.mark.slow
def test_default_job_twice_keeps_the_first(tmp_path):
    """The default job run twice (30 iterations): the second writes runs-2, the first is untouched."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_CSBP_DEMO_DIR": str(tmp_path / "runs"),
           "MEGATRON_CSBP_DEMO_ITERS": "12"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "megatron_csbp.train"]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = _tree(str(tmp_path / "runs"))
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f" > {tmp_path / 'runs'} holds an earlier run (kept): this run writes {tmp_path / 'runs'}-2" in second.stdout
    assert _tree(str(tmp_path / "runs")) == kept
    assert files.read_tracker(str(tmp_path / "runs-2" / "checkpoints")) == 12


# ---- 2. --load and --save folders ------------------------------------------------------------------

def test_mistyped_load_is_refused_and_the_tracker_never_moves_back(saved, tmp_path):
    """Before: ` no checkpoint in --load ckcopyy: starting from scratch`, exit 0, and ckcopy's tracker
    rewritten from 2 to 10 (the user's command, run as they ran it)."""
    ckcopy = _copy(saved, tmp_path, "ckcopy")
    before = _tree(ckcopy)
    for load, line in ((str(tmp_path / "ckcopyy"),
                        f"error: --load {tmp_path / 'ckcopyy'} holds no checkpoint (no latest_checkpointed_iteration.txt; "
                        "the folder does not exist): check the path; to start from scratch on purpose drop --load, or "
                        "pass --no-exit-on-missing-checkpoint"),
                       (os.path.join(ckcopy, files.TRACKER),
                        f"error: --load {ckcopy}/{files.TRACKER} is a file, not a checkpoint folder: give the folder that "
                        f"holds {files.TRACKER} (--load {ckcopy})")):
        r = run_train(TINY + ["--save", ckcopy, "--load", load, "--save-interval", "5", "--train-iters", "10"])
        assert r.returncode == 2 and error_lines(r.stderr) == [line], r.stderr[-3000:]
    assert _tree(ckcopy) == before and files.read_tracker(ckcopy) == 2


def test_load_and_save_folder_rules(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    it = files.iteration_dir(ck, 2)
    assert _one_line(TINY + ["--load", it], capsys) == \
        f"error: --load {it} is one iteration's folder: give the checkpoint folder that holds it (--load {ck} --ckpt-step 2)"
    # starting from scratch on purpose (Megatron-LM's default) still never moves a tracker back
    assert _one_line(TINY + ["--load", str(tmp_path / "nothing"), "--no-exit-on-missing-checkpoint", "--save", ck],
                     capsys) == \
        (f"error: --save {ck} holds checkpoints up to iteration 2 (latest_checkpointed_iteration.txt) and this run starts "
         f"at iteration 0: its saves would move the tracker back; resume with --load {ck}, or give another --save")
    assert _one_line(TINY + ["--save", ck], capsys).startswith(f"error: --save {ck} holds checkpoints up to iteration 2")
    # --finetune starts at iteration 0 too
    assert _one_line(TINY + ["--load", ck, "--finetune", "--save", ck], capsys).startswith(
        f"error: --save {ck} holds checkpoints up to iteration 2")
    # a resumable job (--save X --load X): its first run finds X absent or empty, later runs resume
    fresh = str(tmp_path / "job")
    parse_args(TINY + ["--save", fresh, "--load", fresh], world_size=1)
    os.makedirs(fresh)
    parse_args(TINY + ["--save", fresh, "--load", fresh], world_size=1)
    parse_args(TINY + ["--save", ck, "--load", ck], world_size=1)
    parse_args(TINY + ["--load", ck, "--save", str(tmp_path / "elsewhere")], world_size=1)
    assert not os.path.exists(fresh + "/x") and os.listdir(fresh) == []  # the write probe leaves nothing
    # another folder than --save that holds no checkpoint is a typo, empty or not
    assert _one_line(TINY + ["--save", ck, "--load", fresh], capsys).startswith(f"error: --load {fresh} holds no checkpoint")
    # --save through a file (the same refusal as a read-only file system: nothing can be created there)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert _one_line(TINY + ["--save", str(blocker / "ck")], capsys) == \
        f"error: --save {blocker}/ck: {blocker} is a file, not a folder"


def _unshare_mount():
    """Whether this process may mount a tmpfs in a mount namespace of its own (root, CAP_SYS_ADMIN)."""
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                          capture_output=True).returncode == 0


def _in_tmpfs(tmp_path, size, script):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    return subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt} && {script}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path), str(mnt)


@pytest.mark.skipif(not _unshare_mount(), reason="needs unshare -m and mount (root with CAP_SYS_ADMIN)")
def test_read_only_save_is_refused_before_training(tmp_path):
    """A real read-only file system (a tmpfs remounted ro). Before: trained, then a 23-line OSError
    traceback at the first save."""
    cmd = " ".join(train_command(TINY + ["--train-iters", "2", "--save", "MNT/ck"]))
    r, mnt = _in_tmpfs(tmp_path, "1m", f"mount -o remount,ro MNT && {cmd}".replace("MNT", str(tmp_path / "mnt")))
    assert r.returncode == 2, r.stderr[-3000:]
    assert error_lines(r.stderr) == [f"error: --save {mnt}/ck: cannot create a file in {mnt} (Read-only file system)"]
    assert "iteration" not in r.stdout  # nothing trained


def _save_fails(r, save, iteration, previous, cause):
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    (line,) = error_lines(r.stderr)
    assert line.startswith(f"error: cannot save the checkpoint of iteration {iteration} to --save {save}: {cause}"), line
    assert line.endswith(f"; the latest checkpoint there stays iteration {previous}"), line
    assert "Traceback" not in r.stderr and "encountered an error" not in r.stderr  # (the writer's own log lines)
    assert not [n for n in os.listdir(save) if ".tmp-" in n]
    assert files.read_tracker(save) == previous


@pytest.mark.skipif(not _unshare_mount(), reason="needs unshare -m and mount (root with CAP_SYS_ADMIN)")
def test_disk_full_during_a_save(tmp_path):
    """A real full disk: a 700 KiB tmpfs holds one checkpoint of this model (~0.45 MiB) but not a
    second beside it (ENOSPC inside torch_dist's writer). Before: a 38-line `RuntimeError: Worker
    failure` traceback and an `iter_N.tmp-*` folder left behind."""
    cmd = " ".join(train_command(TINY + ["--train-iters", "4", "--save-interval", "2", "--save", "MNT/ck"]))
    mnt = str(tmp_path / "mnt")
    r, _ = _in_tmpfs(tmp_path, "700k", cmd.replace("MNT", mnt) + "; rc=$?; ls -a MNT/ck; exit $rc".replace("MNT", mnt))
    assert " saved checkpoint at iteration 2 to" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.returncode == 1, r.stderr[-3000:]
    (line,) = error_lines(r.stderr)
    # the writer processes race: the first to fail reports ENOSPC, or a short write inside torch's zip writer
    assert line.startswith(tuple(f"error: cannot save the checkpoint of iteration 4 to --save {mnt}/ck: {cause}" for cause
                                 in ("No space left on device (", "a file write was cut short (a full disk"))), line
    assert line.endswith("; the latest checkpoint there stays iteration 2"), line
    assert "Traceback" not in r.stderr and "encountered an error" not in r.stderr
    assert ".tmp-" not in r.stdout  # (the listing of the folder after the run)


def test_save_write_failure_keeps_the_previous_checkpoint(saved, tmp_path):
    """A resumed run whose save fails inside torch_dist's writer: RLIMIT_FSIZE makes the kernel refuse
    a write past 100 kB (EFBIG; Python ignores SIGXFSZ), which torch's writer reports as a short
    write, the way a disk that fills up mid-write does; runs wherever the tests run."""
    ck = _copy(saved, tmp_path)
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # noqa: E731
    r = subprocess.run(train_command(TINY + ["--train-iters", "4", "--lr-decay-iters", "2", "--save-interval", "1",
                                             "--save", ck, "--load", ck]),
                       preexec_fn=limit, capture_output=True, text=True, timeout=600)
    _save_fails(r, ck, 3, 2, "a file write was cut short (a full disk, or a file-size limit): torch's zip writer: "
                             "unexpected pos ")
    assert files.saved_iterations(ck) == [1, 2]


# ---- 3. corrupt checkpoint files --------------------------------------------------------------------

def _garble(path, at, n=4096):
    import random

    with open(path, "r+b") as f:
        f.seek(at)
        f.write(random.Random(41).randbytes(n))


def test_corrupt_tensor_bytes_are_refused_naming_the_file(saved, tmp_path):
    """4 KiB of random bytes a third of the way into a `.distcp`: before, `train --load` resumed on
    the corrupted weights with exit 0."""
    ck = _copy(saved, tmp_path)
    distcp = os.path.join(files.iteration_dir(ck, 2), "__0_0.distcp")
    _garble(distcp, os.path.getsize(distcp) // 3)
    r = run_train(TINY + ["--train-iters", "3", "--lr-decay-iters", "2", "--load", ck])
    assert r.returncode == 1
    assert error_lines(r.stderr) == [f"error: cannot load checkpoint {files.iteration_dir(ck, 2)}: {distcp} is corrupt: "
                                     f"its sha256 differs from the one its save wrote ({CHECKSUM_FILE})"]
    assert "Traceback" not in r.stderr


def test_corrupt_pickled_part_never_advises_weights_only_false(saved, tmp_path):
    """Garbage in a pickled part (common.pt; megatron-core 0.19 writes none: .metadata), with the
    checksums and without them (a checkpoint saved before they were written): one line naming the
    file or folder, never torch's advice to load with weights_only=False. Before: a 61-65-line
    traceback ending in that advice."""
    ck = _copy(saved, tmp_path)
    it = files.iteration_dir(ck, 2)
    common = os.path.join(it, "common.pt" if os.path.isfile(os.path.join(it, "common.pt")) else ".metadata")
    _garble(common, 64, 512)
    r = run_train(TINY + ["--train-iters", "3", "--lr-decay-iters", "2", "--load", ck])
    assert r.returncode == 1, r.stderr[-3000:]
    (line,) = error_lines(r.stderr)  # (.metadata: its own unpickling check comes before the checksums)
    assert line.startswith(f"error: cannot load checkpoint {it}: {common} is corrupt"), line
    assert "weights_only" not in r.stderr and "Traceback" not in r.stderr
    os.remove(os.path.join(it, CHECKSUM_FILE))
    r = run_train(TINY + ["--train-iters", "3", "--lr-decay-iters", "2", "--load", ck])
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert line.startswith(f"error: cannot load checkpoint {it}: "), line
    assert "weights_only" not in r.stderr and "Traceback" not in r.stderr


def test_every_saved_file_has_a_checksum(saved):
    import json

    for step in (1, 2):
        it = files.iteration_dir(saved, step)
        listed = json.load(open(os.path.join(it, CHECKSUM_FILE)))["files"]
        assert sorted(listed) == sorted(n for n in os.listdir(it) if n != CHECKSUM_FILE)


# ---- 4. data against the tokenizer --------------------------------------------------------------------

def test_data_of_another_vocabulary_is_refused(tmp_path, capsys):
    """The shipped corpus (1024-piece sentencepiece) trained with `--tokenizer-type NullTokenizer
    --vocab-size 64`. Before: a 102-line `IndexError: index out of range in self` in the embedding."""
    from megatron_csbp.data.megatron_data import build_tokenizer, largest_token_id
    from megatron_csbp.data.preprocess import main as preprocess

    preprocess(["--input", "shipped", "--output-prefix", str(tmp_path / "pydoc"), "--append-eod"])
    prefix = str(tmp_path / "pydoc_text_document")
    assert largest_token_id([prefix]) == (1023, prefix + ".bin")
    data = ["--data-path", prefix, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--block-size", "8", "--micro-batch-size", "2"]
    assert _one_line(data + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"], capsys) == \
        (f"error: --data-path {prefix}.bin holds token id 1023, outside the vocabulary of "
         f"{build_tokenizer('NullTokenizer', None, 64).vocab_size} ids (--tokenizer-type NullTokenizer --vocab-size "
         "64): give the tokenizer the data was preprocessed with")  # 65 ids (EOD included), 64 on megatron-core 0.19
    parse_args(data, world_size=1)  # the shipped tokenizer it was made with


# ---- 5. convert ---------------------------------------------------------------------------------------

def test_convert_output_into_its_input_is_refused(saved, capsys):
    """Before: `megatron-to-hf --output` = the checkpoint folder mixed Hugging Face files into it."""
    from megatron_csbp.conversion.cli import main

    before = _tree(saved)
    for out, what in ((saved, "the"), (os.path.join(saved, "hf"), "inside the")):
        assert main(["megatron-to-hf", "--load", saved, "--output", out]) == 2
        assert capsys.readouterr().err.strip() == \
            (f"error: --output {out} is {what} --load folder {saved}: the written files would mix with the ones "
             "read; give a folder outside it")
    assert _tree(saved) == before


@pytest.mark.slow  # suite budget (17 s): the trainer's checksums are checked by default (test_every_saved_file_has_a_checksum, test_corrupt_tensor_bytes_are_refused_naming_the_file); this one adds the converter's
def test_converted_checkpoints_carry_checksums(tmp_path):
    pytest.importorskip("transformers")
    from megatron_csbp.conversion.tiny import save_tiny_model

    hf, meg = str(tmp_path / "hf"), str(tmp_path / "meg")
    save_tiny_model("llama", hf, seed=1)
    cmd = [sys.executable, "-m", "megatron_csbp.convert"]
    r = subprocess.run(cmd + ["hf-to-megatron", "--hf-path", hf, "--output", meg], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    release = os.path.join(meg, "release")
    assert os.path.isfile(os.path.join(release, CHECKSUM_FILE))
    distcp = sorted(n for n in os.listdir(release) if n.endswith(".distcp"))[0]
    _garble(os.path.join(release, distcp), os.path.getsize(os.path.join(release, distcp)) // 3, 256)
    r = subprocess.run(cmd + ["megatron-to-hf", "--load", meg, "--output", str(tmp_path / "back")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2
    assert error_lines(r.stderr) == [f"error: cannot load checkpoint {release}: {release}/{distcp} is corrupt: its "
                                     f"sha256 differs from the one its save wrote ({CHECKSUM_FILE})"]
