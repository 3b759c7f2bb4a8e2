"""The shipped corpus and tokenizer, and a short run of the demo that must learn from context."""
import hashlib
import json
import math
import os
import platform

import pytest
import torch

from megatron_csbp.data import DEFAULT_CORPUS, load_documents, pack_token_stream, split_documents, unigram_entropy
from megatron_csbp.data import corpus as corpus_mod
from megatron_csbp.data import tokenizer as tokenizer_mod
from megatron_csbp.data.tokenizer import DEFAULT_MODEL, SentencePieceTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return SentencePieceTokenizer()


@pytest.fixture(scope="module")
def docs():
    return load_documents()


def test_shipped_assets_match_manifest():
    with open(os.path.join(corpus_mod.ASSET_DIR, tokenizer_mod.MANIFEST_FILE)) as f:
        manifest = json.load(f)
    for path in (DEFAULT_CORPUS, DEFAULT_MODEL):
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == manifest["files"][os.path.basename(path)]
    assert os.path.getsize(DEFAULT_CORPUS) + os.path.getsize(DEFAULT_MODEL) < 2_000_000


def test_corpus_is_real_english(docs):
    # The shipped corpus (CPython 3.11.7's pydoc_data, MANIFEST.json) holds 164 documents, 351,223
    # characters joined, and the word counts the 3.11.7 build measured: the 3,600, is 1,440, of 1,077,
    # object 225, statement 127. The floors below are those counts less ~20% (the text of another
    # CPython's pydoc_data rebuilt with `tokenizer build` differs slightly); a corpus of random or
    # non-English text has none of these words at these rates.
    assert len(docs) >= 150
    text = " ".join(docs)
    assert len(text) > 300_000
    words = text.lower().split()
    for w, n in (("the", 3000), ("is", 1000), ("of", 800), ("object", 150), ("statement", 100)):
        assert words.count(w) > n, w
    assert any(d.startswith("The \"if\" statement") for d in docs)
    assert len(set(docs)) == len(docs)


def test_tokenizer_special_ids_and_round_trip(tokenizer, docs):
    assert tokenizer.vocab_size == 1024
    assert (tokenizer.pad, tokenizer.eod, tokenizer.mask_token_id) == (0, 3, 4)
    assert tokenizer.piece(tokenizer.eod) == "</s>" and tokenizer.piece(tokenizer.mask_token_id) == "<mask>"
    for d in docs[::20]:
        ids = tokenizer.tokenize(d)
        assert tokenizer.detokenize(ids) == d
        assert tokenizer.mask_token_id not in ids and tokenizer.eod not in ids
    # Control pieces are never produced from text, and the newline piece keeps layout.
    assert tokenizer.mask_token_id not in tokenizer.tokenize("<mask> </s>")
    assert tokenizer.detokenize(tokenizer.tokenize("a\n\n    b")) == "a\n\n    b"
    # Sub-word compression on real text: far fewer tokens than characters.
    sample = docs[0]
    assert len(tokenizer.tokenize(sample)) < len(sample) / 2.5


def test_tokenizer_loads_any_model_path(tmp_path):
    model = tmp_path / "copy.model"
    model.write_bytes(open(DEFAULT_MODEL, "rb").read())
    tok = SentencePieceTokenizer(str(model))
    assert tok.tokenize("The if statement") == SentencePieceTokenizer().tokenize("The if statement")
    with pytest.raises(FileNotFoundError, match="tokenizer build"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="mask token"):
        SentencePieceTokenizer(str(model), mask_token="<not-there>")


def test_split_pack_and_entropy(docs, tokenizer):
    train, held_out = split_documents(docs, 0.1, seed=3)
    assert len(train) + len(held_out) == len(docs) and not set(train) & set(held_out)
    assert abs(len(held_out) - 0.1 * len(docs)) <= 1
    assert split_documents(docs, 0.1, seed=3) == (train, held_out)
    assert split_documents(docs, 0.1, seed=4) != (train, held_out)

    rows = pack_token_stream([[5, 6, 7], [8, 9]], 3, eod=3)
    assert rows.tolist() == [[5, 6, 7], [3, 8, 9]]  # the trailing EOD is the dropped tail
    with pytest.raises(ValueError, match="--seq-length 64"):
        pack_token_stream([[5, 6]], 64, eod=3)

    assert math.isclose(unigram_entropy([[1, 2], [3, 4]], 8), math.log(4))
    assert unigram_entropy([[7, 7, 7]], 8) == 0.0
    h = unigram_entropy(tokenizer.tokenize_batch(train), tokenizer.vocab_size)
    assert 4.0 < h < math.log(tokenizer.vocab_size)


def _sentencepiece_minor():
    import sentencepiece

    return tuple(sentencepiece.__version__.split(".")[:2])


@pytest.mark.skipif(_sentencepiece_minor() != ("0", "2"),
                    reason="the tokenizer was trained with sentencepiece 0.2 (0.2.3); other releases may train differently")
def test_tokenizer_rebuilds_byte_identical_from_the_shipped_corpus(docs):
    """Any Python: training on the shipped corpus (one thread, fixed seed) gives the shipped model."""
    assert tokenizer_mod.train_sentencepiece(docs, 1024) == open(DEFAULT_MODEL, "rb").read()


@pytest.mark.skipif(platform.python_version_tuple()[:2] != ("3", "11"),
                    reason="the corpus is CPython 3.11's pydoc_data (built on 3.11.7); other minor versions "
                           "ship other reference text")
def test_assets_rebuild_byte_identical(tmp_path):
    paths = tokenizer_mod.build_assets(str(tmp_path))
    for built, shipped in ((paths["corpus"], DEFAULT_CORPUS), (paths["model"], DEFAULT_MODEL)):
        assert open(built, "rb").read() == open(shipped, "rb").read()


# slow set (suite budget): tests/test_train_default_run.py shows the same model learning in the default suite
@pytest.mark.slow
def test_short_demo_learns_from_context(megatron_single_rank, tmp_path):
    """About a minute on one core: the held-out BD3-LM NELBO (an upper bound on the NLL) must end
    well below the unigram entropy, which no context-free model can beat."""
    from megatron_csbp.training.demo import DemoConfig, run

    cfg = DemoConfig(steps=350, batch_size=16, seq_length=64, block_size=4, hidden_size=96, ffn_hidden_size=384,
                     num_layers=2, num_attention_heads=2, num_query_groups=2, warmup_steps=10,
                     eval_interval=0, eval_repeats=1, log_interval=50, threads=1, output_dir=str(tmp_path))
    lines = []
    result = run(cfg, log=lines.append)
    assert 4.5 < result.unigram_entropy < math.log(1024)
    assert all(math.isfinite(x) for x in result.train_losses) and len(result.train_losses) == 350
    first, last = result.train_losses[:20], result.train_losses[-50:]
    assert sum(last) / len(last) < sum(first) / len(first) - 1.0
    margin = 0.4
    assert result.final_eval_loss < result.unigram_entropy - margin, (result.final_eval_loss, result.unigram_entropy)
    assert result.final_train_loss < result.unigram_entropy - margin, (result.final_train_loss, result.unigram_entropy)
    assert any(line.startswith("unigram entropy") for line in lines)
    assert any(line.startswith("final eval loss") for line in lines)
    assert any(line.startswith("step  350/350") for line in lines)
    png = tmp_path / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["result"]["final_eval_loss"] == result.final_eval_loss
