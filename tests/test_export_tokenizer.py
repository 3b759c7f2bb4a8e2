"""Every Hugging Face export carries the tokenizer the model was trained with (issue 34, item 5):

- the shipped sentencepiece model written as a transformers tokenizer gives, through
  `AutoTokenizer`, the ids `SentencePieceProcessor` gives for every document of the shipped corpus
  and decodes them back to the same text; EOS = EOD 3, mask = 4; the control pieces are never
  produced from text ("<mask>" typed is characters, as in training); a sentencepiece model with
  the library's default normalizer (NFKC, extra whitespace removed) converts as faithfully;
- where the export finds the tokenizer: the checkpoint's record (flag path, absolute path, sha256),
  `--tokenizer-model` overriding; a moved or changed tokenizer refused in one line; a Hugging Face
  tokenizer folder saved as it is; NullTokenizer: nothing to write, said so;
- a DFlash drafter's export carries its verifier's tokenizer.

The trained-checkpoint round trip (`convert megatron-to-hf` of the default run's model, then
`AutoTokenizer` on the export) is in tests/test_export_trained.py, beside the logits check.
"""
import json
import os
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

TRICKY = [" leading space", "  two", "trailing  ", "a\nb", "\n\nx", "x\n y", "<mask> <s></s> <pad>", "digits 12345",
          "tabs\tand\u00a0nbsp", "", "\n", "def f(x):\n    return x ** 2  # comment\n"]


def _sp(path=None):
    import sentencepiece as spm

    from megatron_csbp.data.tokenizer import DEFAULT_MODEL

    return spm.SentencePieceProcessor(model_file=path or DEFAULT_MODEL)


def _same_everywhere(hf_dir, sp, texts, lossless=True):
    """The same ids as sentencepiece for every text, decoded to the same text (to the text itself
    when the model's normalizer is the identity: `lossless`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == list(sp.encode(text)), repr(text[:80])
        if sp.unk_id() not in ids:  # (sentencepiece decodes <unk> as " \u2047 ")
            assert tok.decode(ids) == sp.decode(ids), repr(text[:80])
            assert tok.decode(ids) == text or not lossless, repr(text[:80])
    return tok


def test_shipped_sentencepiece_as_autotokenizer_matches_on_the_corpus(tmp_path):
    from megatron_csbp.data.corpus import load_documents
    from megatron_csbp.data.tokenizer import hf_tokenizer_from_sentencepiece

    hf_tokenizer_from_sentencepiece().save_pretrained(tmp_path)
    tok = _same_everywhere(str(tmp_path), _sp(), load_documents() + TRICKY)
    assert (tok.eos_token, tok.eos_token_id, tok.mask_token, tok.mask_token_id) == ("</s>", 3, "<mask>", 4)
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, len(tok)) == (0, 1, 2, 1024)
    assert tok.decode([4, 16, 3], skip_special_tokens=True) == "a"


def test_default_normalizer_sentencepiece_model_converts_too(tmp_path):
    """sentencepiece's defaults (nmt_nfkc character map, extra whitespace removed, no user pieces)."""
    import sentencepiece as spm

    from megatron_csbp.data.corpus import load_documents
    from megatron_csbp.data.tokenizer import hf_tokenizer_from_sentencepiece

    docs = load_documents()[:40]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(tmp_path / "m"), vocab_size=400,
                                   model_type="unigram", num_threads=1, minloglevel=2, user_defined_symbols=["<mask>"])
    sp = _sp(str(tmp_path / "m.model"))
    hf_tokenizer_from_sentencepiece(str(tmp_path / "m.model")).save_pretrained(tmp_path / "hf")
    _same_everywhere(str(tmp_path / "hf"), sp, docs + ["  extra   spaces  ", "\uff21\uff22 full width", "x"],
                     lossless=False)  # (NFKC and whitespace removal change the text)


def test_bpe_sentencepiece_model_is_refused_in_one_line(tmp_path):
    import sentencepiece as spm

    from megatron_csbp.data.corpus import load_documents
    from megatron_csbp.data.tokenizer import hf_tokenizer_from_sentencepiece

    spm.SentencePieceTrainer.train(sentence_iterator=iter(load_documents()[:20]), model_prefix=str(tmp_path / "b"),
                                   vocab_size=300, model_type="bpe", num_threads=1, minloglevel=2)
    with pytest.raises(ValueError, match="a BPE sentencepiece model; the export writes unigram models"):
        hf_tokenizer_from_sentencepiece(str(tmp_path / "b.model"))


def _meta(**kw):
    from megatron_csbp.data.tokenizer import tokenizer_record

    meta = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": None, "eod_token_id": 3,
            "mask_token_id": 4, "vocab_size": 1024, **kw}
    meta.update(tokenizer_record(meta["tokenizer_type"], meta["tokenizer_model"]))
    return meta


def test_export_finds_the_recorded_tokenizer_or_says_how(tmp_path):
    from megatron_csbp.conversion.tokenizer import export_tokenizer
    from megatron_csbp.data.tokenizer import DEFAULT_MODEL

    out = str(tmp_path / "out")
    os.makedirs(out)
    line = export_tokenizer(_meta(), out)  # the shipped model (no --tokenizer-model)
    assert line.startswith(f"tokenizer: the sentencepiece tokenizer {DEFAULT_MODEL}, loadable by AutoTokenizer")
    assert "EOS '</s>' = 3, mask '<mask>' = 4" in line and os.path.isfile(os.path.join(out, "tokenizer.model"))
    # a --tokenizer-model given as a relative path, exported from another directory: the absolute record
    own = tmp_path / "tok" / "my.model"
    own.parent.mkdir()
    shutil.copyfile(DEFAULT_MODEL, own)
    cwd = os.getcwd()
    os.chdir(own.parent)
    try:
        meta = _meta(tokenizer_model="my.model")
    finally:
        os.chdir(cwd)
    assert meta["tokenizer_path"] == str(own)
    assert "sentencepiece tokenizer" in export_tokenizer(meta, out)
    # moved away: refused naming the flag that fixes it; the flag then exports it
    moved = tmp_path / "elsewhere.model"
    os.rename(own, moved)
    with pytest.raises(FileNotFoundError, match=f"trained with the sentencepiece model my.model = {own}, which is "
                                                "not there: give it to the export as --tokenizer-model PATH"):
        export_tokenizer(meta, out)
    assert f"tokenizer {moved}, loadable" in export_tokenizer(meta, out, tokenizer_model=str(moved))
    # changed in place: refused (not exported as if it were the training tokenizer)
    shutil.copyfile(moved, own)
    with open(own, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="is not the one the model was trained with"):
        export_tokenizer(meta, out)
    # NullTokenizer: nothing to write, and the export says so; on a converted model (data pre-tokenized
    # by the source's tokenizer) the source tokenizer its hf_assets brought along
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert export_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": 50}, empty).startswith(
        "no tokenizer written: the model was trained with NullTokenizer")
    assert export_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": 50}, out).startswith(
        "tokenizer: the source model's tokenizer (hf_assets), loadable by AutoTokenizer")


def test_export_saves_a_hugging_face_tokenizer_folder(tmp_path):
    from transformers import AutoTokenizer

    from megatron_csbp.conversion.tiny import save_tiny_tokenizer
    from megatron_csbp.conversion.tokenizer import export_tokenizer

    src = str(tmp_path / "hf_tok")
    save_tiny_tokenizer(src, vocab_size=300)
    meta = _meta(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=src, eod_token_id=None, mask_token_id=None)
    out = str(tmp_path / "out")
    os.makedirs(out)
    line = export_tokenizer(meta, out)
    assert line.startswith(f"tokenizer: the Hugging Face tokenizer {src}, loadable by AutoTokenizer")
    a, b = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(out)
    text = "The for statement is used to iterate over the elements of a sequence.\n  x = 1"
    assert a(text)["input_ids"] == b(text)["input_ids"] and b.decode(b(text)["input_ids"]) == text
    assert (b.eos_token_id, b.mask_token_id) == (a.eos_token_id, a.mask_token_id)


def test_dflash_drafter_export_carries_its_verifiers_tokenizer(tmp_path, capsys):
    from transformers import AutoTokenizer, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    from megatron_csbp.conversion.drafter import hf_to_megatron_drafter, record_verifier
    from megatron_csbp.conversion.tiny import save_tiny_tokenizer
    from megatron_csbp.dflash import main

    verifier = str(tmp_path / "verifier")
    save_tiny_tokenizer(verifier, vocab_size=300)
    cfg = MuseGlimmerAssistantConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=8, block_size=4, mask_token_id=4,
                                     target_layer_ids=[0], max_position_embeddings=64)
    MuseGlimmerAssistantModel(cfg).save_pretrained(tmp_path / "hf_drafter")
    meg = str(tmp_path / "meg")
    hf_to_megatron_drafter(str(tmp_path / "hf_drafter"), meg)
    main(["export", "--load", meg, "--output", str(tmp_path / "e0")])
    assert "no tokenizer written: the drafter records no verifier" in capsys.readouterr().out
    record_verifier(meg, verifier)  # what `dflash train --save` writes
    main(["export", "--load", meg, "--output", str(tmp_path / "e1")])
    assert f"tokenizer: the Hugging Face tokenizer {os.path.abspath(verifier)}, loadable" in capsys.readouterr().out
    a, b = AutoTokenizer.from_pretrained(verifier), AutoTokenizer.from_pretrained(tmp_path / "e1")
    assert a("a = b[1:]")["input_ids"] == b("a = b[1:]")["input_ids"]
    # re-imported, the export's tokenizer stays with the drafter (hf_assets) and comes back out
    hf_to_megatron_drafter(str(tmp_path / "e1"), str(tmp_path / "meg2"))
    main(["export", "--load", str(tmp_path / "meg2"), "--output", str(tmp_path / "e2")])
    assert "loadable by AutoTokenizer" in capsys.readouterr().out
    assert AutoTokenizer.from_pretrained(tmp_path / "e2")("x")["input_ids"] == a("x")["input_ids"]
    assert json.load(open(tmp_path / "e2" / "config.json"))["model_type"] == "muse_glimmer_assistant"
