"""SFT records -> tokens and loss masks; prompts stay clean in the BD3-LM noisy stream."""
import json

import pytest
import torch

from megatron_csbp.data.megatron_data import build_tokenizer
from megatron_csbp.data.sft import SFTDataset, prompt_ids, render
from megatron_csbp.objectives import BD3LMObjective


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("SentencePieceTokenizer", None, None)


def test_prompt_response_mask(tok):
    ids, mask = render({"prompt": "What is a list?", "response": "A mutable sequence."}, tok)
    p = prompt_ids("What is a list?", tok)
    r = tok.tokenize("A mutable sequence.") + [tok.eod]
    assert ids == p + r
    assert mask == [0] * len(p) + [1] * len(r)


def test_conversation_masks_every_assistant_turn(tok):
    rec = {"conversations": [{"role": "system", "content": "Be brief."},
                             {"from": "human", "value": "Hi"}, {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}
    ids, mask = render(rec, tok)
    sup = [i for i, m in zip(ids, mask) if m]
    assert sup == tok.tokenize("Hello.") + [tok.eod] + tok.tokenize("Bye.") + [tok.eod]
    with pytest.raises(ValueError, match="no assistant turn"):
        render({"conversations": [{"role": "user", "content": "x"}]}, tok)


def test_dataset_padding_and_noise_keeps_prompt_clean(tmp_path, tok):
    path = tmp_path / "sft.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "Explain tuples.", "response": "Immutable sequences of items."}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "Name a loop."},
                                         {"role": "assistant", "content": "for"}]}) + "\n")
    ds = SFTDataset(str(path), tok, 64)
    s = ds[0]
    assert s["tokens"].shape == (64,)
    n_prompt = len(prompt_ids("Explain tuples.", tok))
    assert s["loss_mask"][:n_prompt].sum() == 0 and s["loss_mask"][n_prompt] == 1
    assert (s["tokens"][s["loss_mask"] == 0][-1] == tok.eod)  # padding is EOD, unsupervised
    obj = BD3LMObjective(16, tok.mask_token_id, seed=0, eps_min=0.99, eps_max=1.0)
    toks = torch.stack([ds[0]["tokens"], ds[1]["tokens"]])
    lm = torch.stack([ds[0]["loss_mask"], ds[1]["loss_mask"]])
    noised = obj.noise(toks, lm, torch.tensor([0, 1]))
    masked = noised.noisy_tokens == tok.mask_token_id
    assert masked.any()
    assert not (masked & (lm == 0)).any(), "a prompt/pad token was noised"
    assert torch.equal(noised.noisy_tokens[lm == 0], toks[lm == 0])
    assert obj.denominator(lm) == lm.sum()
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write('{"text": "no pair"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        SFTDataset(str(tmp_path / "bad.jsonl"), tok, 64)
