"""`--data-path` / `--split` checked before megatron-core builds a dataset: megatron-core's
`GPTDataset._get_num_epochs` loops forever on a split that has samples requested but no documents
(the default --split 969,30,1 gives the test split none of the shipped corpus' 164 documents).
Now a split the run reads that gets no document is one error line naming --split, the document
count and a split that works; splits the run never reads (test; validation without evaluation)
are not built; a missing --data-path file is one line. The README's multi-rank command runs."""
import os
import subprocess
import sys

import pytest

from megatron_csbp.data.corpus import load_documents

TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--block-size", "8", "--micro-batch-size", "2", "--no-progress-bar", "--log-interval", "1"]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped corpus through `python -m megatron_csbp.data.preprocess` (shipped sentencepiece)."""
    from megatron_csbp.data.preprocess import main as preprocess_main

    root = tmp_path_factory.mktemp("shipped")
    return preprocess_main(["--input", "shipped", "--output-prefix", str(root / "pydoc"), "--append-eod"])


def _error(argv, capsys):
    from megatron_csbp.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv, world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_a_split_without_documents_names_split_count_and_a_working_split(shipped, capsys):
    from megatron_csbp.training.arguments import parse_args

    n = len(load_documents())
    assert n == 164
    base = ["--data-path", shipped] + TINY_MODEL
    # 998,1,1 of 164 documents: validation [round(.998 n), round(.999 n)) = [164, 164) is empty
    line = _error(base + ["--split", "998,1,1", "--eval-iters", "1", "--eval-interval", "1"], capsys)
    print(line)
    assert "--split 998,1,1 gives the validation split none of the 164 documents" in line
    assert f"--data-path {shipped}" in line and "e.g. --split 98,2,0" in line
    parse_args(base + ["--split", "98,2,0", "--eval-iters", "1", "--eval-interval", "1"], world_size=1)
    # ... but without evaluation the validation split is never read: accepted
    parse_args(base + ["--split", "998,1,1"], world_size=1)
    line = _error(base + ["--split", "0,100,0"], capsys)
    assert "--split 0,100,0 gives the training split none of the 164 documents" in line
    line = _error(base + ["--split", "9x,1"], capsys)
    assert "--split '9x,1' must be up to three non-negative weights" in line


def test_no_split_that_works_says_so(tmp_path, capsys):
    import json

    from megatron_csbp.data.preprocess import main as preprocess_main

    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"text": load_documents()[0]}) + "\n")
    prefix = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "one"), "--append-eod"])
    line = _error(["--data-path", prefix, "--eval-iters", "1"] + TINY_MODEL, capsys)
    print(line)
    assert "1 document(s) cannot make a validation split: add documents or set --eval-iters 0" in line


def test_missing_data_path_is_one_line(tmp_path, shipped, capsys):
    line = _error(["--data-path", str(tmp_path / "nope")] + TINY_MODEL, capsys)
    assert line.endswith(f"--data-path: {tmp_path / 'nope'}.bin does not exist (expected a prefix written by "
                         "python -m megatron_csbp.data.preprocess)")
    line = _error(["--data-path", "0.5", shipped, "0.5", str(tmp_path / "gone")] + TINY_MODEL, capsys)
    assert f"--data-path: {tmp_path / 'gone'}.bin does not exist" in line


def test_data_path_with_the_file_extension_says_drop_it(shipped, capsys):
    """Megatron's --data-path is the prefix; `X.bin` (or `X.idx`) used to say `X.bin.bin does not exist`."""
    for ext in (".bin", ".idx"):
        line = _error(["--data-path", shipped + ext] + TINY_MODEL, capsys)
        assert line == f"error: --data-path takes the prefix without .bin/.idx: did you mean {shipped}?", line


def test_unread_splits_are_not_built(shipped):
    from megatron_csbp.data.megatron_data import checked_split_matrix

    # Megatron's own boundaries for the splits that are read; the others None (not built)
    assert checked_split_matrix([shipped], "969,30,1", (True, False, False)) == [(0, 0.969), None, None]
    assert checked_split_matrix([shipped], "969,30,1", (True, True, False)) == [(0, 0.969), (0.969, 0.999), None]


def _torchrun(nproc, argv, cwd, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "-m", "megatron_csbp.train"] + argv
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s (megatron-core's dataset build hangs on an "
                    f"empty split):\n{exc.stdout}\n{exc.stderr}")


def test_default_split_on_the_shipped_corpus_finishes(shipped, tmp_path):
    """The hang itself: the default --split 969,30,1 (test split: 0 of 164 documents) with evaluation."""
    r = _torchrun(1, ["--data-path", shipped, "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1"]
                  + TINY_MODEL, tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss at iteration 2" in r.stdout


def readme_data_path_command():
    """The flags of README.md's multi-rank `torchrun ... --data-path <prefix> ...` line, as written."""
    import re
    import shlex

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("torchrun") and "--data-path <prefix>" in ln)
    words = shlex.split(line.split("#")[0])
    nproc = int(words[words.index("--nproc-per-node") + 1])
    return nproc, words[words.index("megatron_csbp.train") + 1:]


@pytest.mark.slow
def test_readme_multi_rank_data_path_command(shipped, tmp_path):
    """README.md's multi-rank `--data-path` command on the shipped corpus (default --split), with
    --train-iters 2 added to keep the test short (as written, its 100 iterations take about 4
    minutes on 2 shared cores)."""
    nproc, argv = readme_data_path_command()
    assert "--split" not in argv  # the default split, the one that hung
    argv = [shipped if a == "<prefix>" else a for a in argv] + ["--train-iters", "2"]
    r = _torchrun(nproc, argv, tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iteration        2/       2" in r.stdout
    save = argv[argv.index("--save") + 1]
    assert os.path.isdir(tmp_path / save / "iter_0000002")
