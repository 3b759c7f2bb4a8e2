"""`--tokenizer-type HuggingFaceTokenizer` (transformers' AutoTokenizer from a local folder) in
`data.preprocess`, the trainer and the tokenizer `generate` builds (one factory,
`megatron_data.build_tokenizer`): the shipped corpus preprocessed with a converted tiny Qwen3's
tokenizer (the `hf_assets/` folder `convert hf-to-megatron` copies beside the checkpoint) and
trained on, the mask token being the tokenizer's own."""
import pytest

from megatron_csbp.data.corpus import load_documents
from tests.distributed import run_distributed
from tests.train_helpers import train_rank

pytest.importorskip("transformers")

RUN = ["--seq-length", "32", "--block-size", "8", "--micro-batch-size", "2", "--global-batch-size", "2",
       "--no-progress-bar", "--log-interval", "1", "--seed", "1234", "--lr", "1e-3", "--min-lr", "1e-4"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random-weight Qwen3 with a byte-level BPE tokenizer trained on the shipped corpus
    (384 pieces + <|mask|>), converted to a Megatron checkpoint, and the corpus preprocessed with
    the tokenizer that came with the checkpoint."""
    import os

    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.tiny import save_tiny_model, save_tiny_tokenizer
    from megatron_csbp.data.preprocess import main as preprocess_main

    root = tmp_path_factory.mktemp("hf_tokenizer")
    tok = save_tiny_tokenizer(str(root / "hf"))
    save_tiny_model("qwen3", str(root / "hf"), seed=5, vocab_size=512)  # embedding larger than the tokenizer
    meg = str(root / "megatron")
    api.hf_to_megatron_checkpoint(str(root / "hf"), meg)
    assets = os.path.join(meg, "hf_assets")
    prefix = preprocess_main(["--input", "shipped", "--output-prefix", str(root / "qwen"), "--append-eod",
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", assets])
    return {"tok": tok, "meg": meg, "assets": assets, "prefix": prefix, "root": root}


def test_preprocess_with_the_converted_tokenizer(qwen3):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok, docs = qwen3["tok"], load_documents()
    ds = IndexedDataset(qwen3["prefix"])
    assert len(ds) == len(docs) == 164
    for i in (0, 81, 163):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eos_token_id  # EOD = the tokenizer's EOS (<|endoftext|>)
        assert ids[:-1] == tok(docs[i], add_special_tokens=False)["input_ids"]
        assert tok.decode(ids[:-1]) == docs[i]  # byte-level BPE: exact round trip
    assert max(int(ds[i].max()) for i in range(len(ds))) < len(tok)


def test_the_shared_factory_reads_the_tokenizer_folder(qwen3):
    from megatron_csbp.data.megatron_data import build_tokenizer

    tok = build_tokenizer("HuggingFaceTokenizer", qwen3["assets"], None)
    hf = qwen3["tok"]
    assert (tok.vocab_size, tok.eod, tok.mask_token_id) == (len(hf), hf.eos_token_id, hf.mask_token_id)
    text = load_documents()[3]
    assert tok.detokenize(tok.tokenize(text)) == text
    with pytest.raises(ValueError, match="HuggingFaceTokenizer needs --tokenizer-model DIR"):
        build_tokenizer("HuggingFaceTokenizer", None, None)
    with pytest.raises(ValueError, match="needs a local folder"):
        build_tokenizer("HuggingFaceTokenizer", str(qwen3["root"] / "missing"), None)


def test_trainer_args_take_the_checkpoint_tokenizer(qwen3):
    import os

    from megatron_csbp.training.arguments import parse_args

    args = facts = parse_args(RUN + ["--load", qwen3["meg"], "--data-path", qwen3["prefix"],
                                    "--tokenizer-type", "HuggingFaceTokenizer"], world_size=1)
    hf = qwen3["tok"]
    assert args.tokenizer_model == os.path.join(qwen3["meg"], "hf_assets")  # default: the checkpoint's
    assert args.mask_token_id == hf.mask_token_id == hf.convert_tokens_to_ids("<|mask|>")
    assert facts.eod_token_id == hf.eos_token_id
    assert args.vocab_size == 512  # the model's embedding, larger than the tokenizer's 385


def test_train_on_the_preprocessed_corpus_and_generate(qwen3):
    """BD3-LM from the converted Qwen3 on its own tokens (default --split 969,30,1, with evaluation),
    then `generate` on the trained checkpoint: its tokenizer is the checkpoint's HuggingFaceTokenizer."""
    import os
    import subprocess
    import sys

    save = str(qwen3["root"] / "bdlm")
    argv = RUN + ["--load", qwen3["meg"], "--data-path", qwen3["prefix"], "--tokenizer-type", "HuggingFaceTokenizer",
                  "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--save", save]
    r = run_distributed(train_rank, 1, argv)[0]
    print(f"losses {r['losses']}, eval {r['history'][-1]['eval_loss']}")
    assert r["iteration"] == 3 and len(r["losses"]) == 3
    assert all(0 < loss < 50 for loss in r["losses"] + [r["history"][-1]["eval_loss"]])
    prompt = "The for statement"
    g = subprocess.run([sys.executable, "-m", "megatron_csbp.generate", "--load", save, "--prompt", prompt,
                        "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert g.returncode == 0, g.stderr[-3000:]
    print(g.stdout)
    assert g.stdout.strip().splitlines()[-1].startswith(prompt)  # decoded by the Qwen3 tokenizer
