"""jsonl -> .bin/.idx with the real sentencepiece tokenizer, read back through Megatron's
IndexedDataset, and sampled through Megatron's BlendedMegatronDatasetBuilder/GPTDataset (blend + split)."""
import json
import os

import numpy as np
import pytest
import torch

from megatron_csbp.data.corpus import load_documents
from megatron_csbp.data.megatron_data import build_gpt_datasets, build_tokenizer, parse_data_path
from megatron_csbp.data.preprocess import main as preprocess_main


def _write_jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def test_preprocess_round_trip(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = load_documents()[:12]
    src = tmp_path / "docs.jsonl"
    _write_jsonl(src, docs)
    prefix = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--append-eod"])
    assert prefix.endswith("out_text_document")
    tok = build_tokenizer("SentencePieceTokenizer", None, None)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    for i, text in enumerate(docs):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        assert ids[:-1] == tok.tokenize(text)
        assert tok.detokenize(ids[:-1]).strip() == text.strip()
    assert ds[0].dtype == np.uint16  # 1024-piece vocabulary


def test_gpt_dataset_blend_and_split(tmp_path):
    # Megatron's dataset builder needs a process group: one gloo rank.
    from tests.distributed import run_distributed
    assert run_distributed(_blend_and_split, 1, str(tmp_path)) == [True]


def _blend_and_split(rank, world_size, tmp_path):
    import pathlib
    tmp_path = pathlib.Path(tmp_path)
    docs = load_documents()
    tok = build_tokenizer("SentencePieceTokenizer", None, None)
    prefixes = []
    for name, part in (("a", docs[:40]), ("b", docs[40:80])):
        _write_jsonl(tmp_path / f"{name}.jsonl", part)
        prefixes.append(preprocess_main(["--input", str(tmp_path / f"{name}.jsonl"),
                                         "--output-prefix", str(tmp_path / name), "--append-eod"]))
    blend = ["0.3", prefixes[0], "0.7", prefixes[1]]
    assert parse_data_path(blend) == ([prefixes[0], prefixes[1]], [0.3, 0.7])
    train, valid, test = build_gpt_datasets(blend, "90,8,2", 64, 5, tok, [50, 10, 1], str(tmp_path / "cache"))
    s = train[3]
    assert s["tokens"].shape == (64,) and s["loss_mask"].sum() == 64
    assert int(s["tokens"].max()) < tok.vocab_size
    # Packing: documents are concatenated with EOD between them.
    eods = sum(int((train[i]["tokens"] == tok.eod).sum()) for i in range(50))
    assert eods > 0
    # The blend and the split, measured on the tokens (not on Megatron's index arrays): "90,8,2" of
    # 40 documents per dataset gives Megatron's split bounds round(40 x [0, .9, .98, 1]) = documents
    # [0, 36) train, [36, 39) valid, [39, 40) test. Every 8 consecutive tokens of a sample (within one
    # document, i.e. between EODs) must come from one dataset's documents of that split; the blend's
    # greedy error-minimising order (Megatron's build_blending_indices) then gives dataset a
    # round(0.3 N) +- 1 of the first N samples.
    bounds = {"train": (0, 36), "valid": (36, 39), "test": (39, 40)}
    grams = {}
    for name, part in (("a", docs[:40]), ("b", docs[40:80])):
        for split_name, (lo, hi) in bounds.items():
            ids = [t for text in part[lo:hi] for t in tok.tokenize(text) + [tok.eod]]
            grams[name, split_name] = {tuple(ids[i:i + 8]) for i in range(len(ids) - 7)}

    def source(sample, split_name):
        ids = sample["tokens"].tolist()
        pieces, cur = [], []
        for t in ids:
            cur.append(t)
            if t == tok.eod:
                pieces.append(cur)
                cur = []
        pieces.append(cur)
        own = {tuple(p[i:i + 8]) for p in pieces for i in range(len(p) - 7)}
        assert own, "a 64-token sample has a run of >= 8 tokens in one document"
        found = [name for name in ("a", "b") if own <= grams[name, split_name]]
        assert found, f"a {split_name} sample is not made of its split's documents"
        return found

    for split_name, ds, n in (("train", train, 50), ("valid", valid, 10), ("test", test, 1)):
        srcs = [source(ds[i], split_name) for i in range(n)]
        assert all(len(f) == 1 for f in srcs), "each sample is one dataset's (8-grams told them apart)"
        from_a = sum(f == ["a"] for f in srcs)
        assert abs(from_a - 0.3 * n) <= 1, (split_name, from_a, n)
    # Deterministic from the seed.
    train2, _, _ = build_gpt_datasets(blend, "90,8,2", 64, 5, tok, [50, 10, 1], str(tmp_path / "cache"))
    assert all(torch.equal(train[i]["tokens"], train2[i]["tokens"]) for i in range(10))
    assert not torch.equal(train[0]["tokens"], valid[0]["tokens"])
    return True


def test_bad_data_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="--data-path.*does not exist"):
        parse_data_path([str(tmp_path / "missing")])


@pytest.mark.quick
@pytest.mark.parametrize("argv, line", [
    (["--input", "{txt}", "--output-prefix", "{out}"],
     'error: --input {txt}: line 1 is not JSON (Expecting value: line 1 column 1 (char 0)); --input is jsonl, one '
     '{{"text": "..."}} object per document'),
    (["--input", "{txt}"], "error: the following arguments are required: --output-prefix (see python -m "
                           "megatron_csbp.data.preprocess --help)"),
    (["--input", "{out}.jsonl", "--output-prefix", "{out}"], "error: --input {out}.jsonl does not exist"),
])
def test_preprocess_errors_are_one_line_without_usage(tmp_path, capsys, argv, line):
    """A plain .txt as --input (and any other bad input): the one error line, no usage dump first."""
    txt = tmp_path / "notes.txt"
    txt.write_text("Plain text, not jsonl.\nA second line.\n")
    fill = {"txt": str(txt), "out": str(tmp_path / "out")}
    with pytest.raises(SystemExit) as exc:
        preprocess_main([a.format(**fill) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [line.format(**fill)], err


def test_tokenizer_command_runs_without_runpy_warning():
    """`python -m megatron_csbp.data.tokenizer` (docs/install.md's rebuild command's module) used to
    print runpy's RuntimeWarning first: the package imported the module before runpy ran it."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "megatron_csbp.data.tokenizer", "encode", "The for statement"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[0] == "[61, 43, 99]"


@pytest.mark.quick
def test_a_failed_preprocess_leaves_neither_file(tmp_path, capsys):
    """A bad line after good ones: before, the .bin of the documents read so far stayed without its .idx."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "one document"}\n{"text": "another"}\nnot json\n')
    with pytest.raises(SystemExit):
        preprocess_main(["--input", str(docs), "--output-prefix", str(tmp_path / "out" / "corpus")])
    assert "line 3 is not JSON" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.quick
def test_a_binary_input_is_named(tmp_path, capsys):
    """Before: `'utf-8' codec can't decode byte 0xf9 in position 0: invalid start byte`, no file named."""
    data = tmp_path / "corpus.bin"
    data.write_bytes(bytes([0xF9, 0x00, 0x10, 0x80]) * 64)
    with pytest.raises(SystemExit) as exc:
        preprocess_main(["--input", str(data), "--output-prefix", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f'error: --input {data} is not UTF-8 text (byte 0xf9); --input is jsonl(.gz), one {{"text": "..."}} object '
        "per document"]
    assert os.listdir(tmp_path) == ["corpus.bin"]


@pytest.mark.quick
def test_a_blend_with_a_weight_left_over_is_named(capsys):
    """`--data-path 0.7 P 0.3` (the second prefix forgotten): before, `--data-path: 0.7.bin does not exist`."""
    from megatron_csbp.training.arguments import parse_args
    from tests.train_helpers import TINY

    argv = [a for a in TINY if a != "--mock-data"] + ["--data-path", "0.7", "P", "0.3"]
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=1)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --data-path 0.7 P 0.3: a blend is weight-prefix pairs, W1 PREFIX1 W2 PREFIX2 ... (got 3 values, an "
        "odd count)"]
