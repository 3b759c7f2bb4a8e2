"""`python -m megatron_csbp.generate` on DiffusionGemma: a tiny DiffusionGemma trained here under CSBP
with expert parallelism, exported to Hugging Face and decoded by transformers'
`DiffusionGemmaForBlockDiffusion.generate` after `torch.manual_seed(S)`, gives the same tokens as
the project's sampler on the Megatron checkpoint with `--seed S` (ids in and out as .npy).

Why equality holds, and where it would not: both sides draw the same random numbers in the same
order (canvas, multinomial, re-noising), so tokens agree as long as every decision (the drawn token,
the entropy order, the argmax) sits farther from its boundary than the fp32 logit error (about 3e-7
here, measured). A model trained from transformers' initialisation stays there for all 48 steps.
A model with weights re-drawn at std 0.15 (`redraw_weights`) does not: its self-conditioning loop
amplifies any difference about 3x per step (measured: 2e-6 at step 0, 1.3 at step 13), so two
correct implementations part after ~14 steps; such a model is no test of a sampler.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import train_rank

pytest.importorskip("transformers")

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_csbp", "data", "assets")
SEED, NEW, STEPS = 11, 8, 48  # two canvases of 4, transformers' default number of denoising steps


def _generate(*args):
    return subprocess.run([sys.executable, "-m", "megatron_csbp.generate", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny DiffusionGemma (transformers' initialisation, vocabulary 96, window 3) converted."""
    from megatron_csbp.conversion import api
    from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("dg_conv")
    tiny_hf_model(seed=3, vocab_size=96, sliding_window=3, redraw=False).save_pretrained(str(root / "hf"))
    api.hf_to_megatron_checkpoint(str(root / "hf"), str(root / "meg"))
    return root


def test_converted_diffusiongemma_decodes_like_transformers(converted, tmp_path):
    """The converted checkpoint against its Hugging Face source; a prompt longer than the sliding
    window and off block boundaries, 8 denoising steps, three canvases."""
    from transformers import DiffusionGemmaForBlockDiffusion

    prompt = np.random.RandomState(1).randint(0, 96, (2, 7)).astype(np.int64)
    np.save(tmp_path / "prompt.npy", prompt)
    r = _generate("--load", str(converted / "meg"), "--prompt-ids", str(tmp_path / "prompt.npy"), "--max-new-tokens",
                  "12", "--seed", "5", "--max-denoising-steps", "8", "--output", str(tmp_path / "out.npy"))
    assert r.returncode == 0, r.stderr[-3000:]
    ours = np.load(tmp_path / "out.npy")
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(converted / "hf")).eval()
    torch.manual_seed(5)
    ref = hf.generate(torch.from_numpy(prompt), max_new_tokens=12, max_denoising_steps=8).sequences.numpy()
    print(f"ours {ours.tolist()}\ntransformers {ref.tolist()}")
    assert ours.shape == (2, 19) and (ours == ref).all()


def test_diffusiongemma_generate_refuses_bad_input(converted, tmp_path):
    load = str(converted / "meg")
    np.save(tmp_path / "big.npy", np.array([[1, 2, 500]]))
    r = _generate("--load", load, "--prompt-ids", str(tmp_path / "big.npy"))
    assert r.returncode == 2 and "--prompt-ids: token ids must lie in [0, 96), got [1, 500]" in r.stderr
    np.save(tmp_path / "p.npy", np.array([[1, 2]]))
    r = _generate("--load", load, "--prompt-ids", str(tmp_path / "p.npy"), "--t-min", "0.9", "--t-max", "0.5")
    assert r.returncode == 2 and "`t_max` must be >= t_min`" in r.stderr
    r = _generate("--load", load, "--prompt", "hello")
    assert r.returncode == 2 and "--prompt needs a tokenizer" in r.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DiffusionGemma (transformers' initialisation) converted, trained 2 SFT iterations under
    CSBP 2+2 with EP 2 on 2 ranks, saved, and exported to Hugging Face."""
    from megatron_csbp.conversion import api
    from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("dg_gen")
    tiny_hf_model(seed=2, vocab_size=1024, sliding_window=16, redraw=False).save_pretrained(str(root / "hf"))
    api.hf_to_megatron_checkpoint(str(root / "hf"), str(root / "meg"))
    save = str(root / "save")
    run_distributed(train_rank, 2, [
        "--load", str(root / "meg"), "--objective", "diffusiongemma-sft",
        "--sft-data-path", os.path.join(ASSETS, "pydoc_sft.jsonl"),
        "--tokenizer-model", os.path.join(ASSETS, "pydoc_topics_unigram1024.model"),
        "--seq-length", "128", "--block-size", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-3", "--no-progress-bar", "--context-parallel-size", "2",
        "--block-parallel-size", "2", "--expert-model-parallel-size", "2", "--save", save])
    api.megatron_to_hf_checkpoint(save, str(root / "export"))
    return root, save


# slow: 2-rank training (~60 s) and 48-step decoding on both sides; the converted case above is the default
@pytest.mark.slow
def test_trained_diffusiongemma_decodes_like_transformers_token_for_token(trained, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    root, save = trained
    # batch 2, a prompt of 5 tokens: canvases start off block boundaries (5 is not a multiple of 4)
    prompt = np.random.RandomState(0).randint(0, 1024, (2, 5)).astype(np.int64)
    np.save(tmp_path / "prompt.npy", prompt)
    r = _generate("--load", save, "--prompt-ids", str(tmp_path / "prompt.npy"), "--max-new-tokens", str(NEW),
                  "--seed", str(SEED), "--output", str(tmp_path / "out.npy"))
    assert r.returncode == 0, r.stderr[-3000:]
    ours = np.load(tmp_path / "out.npy")
    assert ours.shape == (2, 5 + NEW) and ours.dtype == np.int64 and (ours[:, :5] == prompt).all()

    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(root / "export")).eval()
    torch.manual_seed(SEED)
    ref = hf.generate(torch.from_numpy(prompt), max_new_tokens=NEW).sequences.numpy()
    print(f"ours {ours.tolist()}\ntransformers {ref.tolist()}\n{r.stdout.strip()}")
    assert (ours == ref).all()
    assert f"denoising steps per row [{2 * STEPS}, {2 * STEPS}]" in r.stdout  # every step ran: no early stop

    # Another seed gives other tokens (the seed is used); a flag changes the sampler (it is read).
    r2 = _generate("--load", save, "--prompt-ids", str(tmp_path / "prompt.npy"), "--max-new-tokens", "4",
                   "--seed", str(SEED + 1), "--max-denoising-steps", "3", "--output", str(tmp_path / "o2.npy"))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "denoising steps per row [3, 3]" in r2.stdout
    assert not (np.load(tmp_path / "o2.npy")[:, 5:] == ours[:, 5:9]).all()



GEMMA_STYLE = ("{{- bos_token }}{%- for m in messages %}{{- '<start_of_turn>' + ('model' if m.role == 'assistant' "
               "else m.role) + '\\n' + m.content + '<end_of_turn>\\n' }}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")


def test_chat_prompt_is_the_converted_tokenizers_chat_template(tmp_path):
    """`generate --chat`: the prompt is one user turn through the chat template converted with the
    model (a word-level tokenizer of 40 ids written here, Gemma-style template), with the
    generation prompt; the decoded rows start with exactly those ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_csbp.conversion import api
    from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    words = ["user", "model", "hello", "how", "are", "you", "fine"] + [f"w{i}" for i in range(27)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(special + words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=special[4:])
    tok.chat_template = GEMMA_STYLE
    tiny_hf_model(seed=3, vocab_size=96, sliding_window=3, redraw=False).save_pretrained(str(tmp_path / "hf"))
    tok.save_pretrained(str(tmp_path / "hf"))
    api.hf_to_megatron_checkpoint(str(tmp_path / "hf"), str(tmp_path / "meg"))
    want = tok.apply_chat_template([{"role": "user", "content": "hello how are you"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    r = _generate("--load", str(tmp_path / "meg"), "--prompt", "hello how are you", "--chat", "--max-new-tokens", "4",
                  "--max-denoising-steps", "2", "--output", str(tmp_path / "out.npy"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = np.load(tmp_path / "out.npy")
    assert out[0, :len(want)].tolist() == list(want) and out.shape == (1, len(want) + 4)
    r = _generate("--load", str(tmp_path / "meg"), "--prompt-ids", str(tmp_path / "out.npy"), "--chat")
    assert r.returncode == 2 and "--chat renders --prompt text with the checkpoint's tokenizer" in r.stderr
