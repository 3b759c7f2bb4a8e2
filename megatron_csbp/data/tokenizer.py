"""The text tokenizers behind Megatron's `--tokenizer-type` names (`SentencePieceTokenizer`: a thin
sentencepiece wrapper; `HuggingFaceTokenizer`: transformers' `AutoTokenizer` from a local folder),
and the command that rebuilds the shipped data assets. `megatron_data.build_tokenizer` picks one.

The shipped model (`assets/pydoc_topics_unigram1024.model`) is a 1024-piece unigram model trained
on the shipped corpus (`megatron_csbp.data.corpus`). Its reserved ids:

    0 <pad>   1 <unk>   2 <s>   3 </s> (EOD, ends every packed document)
    4 <mask>  (the absorbing-noise mask token)   5-7 <reserved_0..2>   8 "\\n"

The control pieces are never produced from text (the string "<mask>" tokenizes as characters).
Normalisation is the identity and whitespace is kept, so `detokenize(tokenize(text)) == text` for
any text made of characters seen in training.

Rebuild both assets (byte-identical on the same Python minor version, whose `pydoc_data` they come
from; sentencepiece training runs on one thread to stay deterministic):

    python -m megatron_csbp.data.tokenizer build [--out-dir DIR] [--vocab-size 1024]

`hf_tokenizer_from_sentencepiece` writes a sentencepiece unigram model as a transformers tokenizer
(`tokenizer.json`, loadable by `AutoTokenizer`) that encodes every text to the ids
`SentencePieceProcessor.encode` gives and decodes them back: what `convert megatron-to-hf` ships
with a model trained on such a tokenizer. `tokenizer_record` is what a checkpoint records about
the tokenizer it was trained with (its file, by absolute path and sha256) so the export finds it.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_csbp.data import corpus as corpus_mod

MODEL_FILE = "pydoc_topics_unigram1024.model"
DEFAULT_MODEL = os.path.join(corpus_mod.ASSET_DIR, MODEL_FILE)
MANIFEST_FILE = "MANIFEST.json"

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
MASK = "<mask>"
RESERVED = [MASK] + [f"<reserved_{i}>" for i in range(3)]
NEWLINE = "\n"


class SentencePieceTokenizer:
    """ids / detokenize / eod / mask_token_id / vocab_size around a sentencepiece `.model` file."""

    def __init__(self, model_path: Optional[str] = None, mask_token: str = MASK):
        import sentencepiece as spm

        self.model_path = model_path or DEFAULT_MODEL
        if not os.path.exists(self.model_path):
            raise FileNotFoundError(f"tokenizer model {self.model_path} not found; rebuild the shipped assets with "
                                    "`python -m megatron_csbp.data.tokenizer build`")
        self.sp = spm.SentencePieceProcessor(model_file=self.model_path)
        # Other models' sentencepiece files (e.g. Gemma's `<eos>`, no `<mask>`) work too: EOD falls
        # back to the model's own EOS id; a missing default `<mask>` leaves mask_token_id None, which
        # only the absorbing-mask objectives refuse (by flag). A mask piece asked for by name must exist.
        self.mask_token_id = self._special_id(mask_token, "mask token", required=mask_token != MASK)
        self.eod = self._special_id(EOS, "end-of-document token", fallback=int(self.sp.eos_id()))
        self.vocab_size, self.pad = int(self.sp.get_piece_size()), int(self.sp.pad_id())

    def _special_id(self, piece: str, what: str, required: bool = True, fallback: int = -1) -> Optional[int]:
        i = self.sp.piece_to_id(piece)
        if i == self.sp.unk_id() and piece != self.sp.id_to_piece(self.sp.unk_id()):
            if fallback >= 0:
                return fallback
            if not required:
                return None
            raise ValueError(f"tokenizer {self.model_path} has no {what} piece {piece!r}")
        return int(i)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text` (no BOS/EOS added)."""
        return list(self.sp.encode(text))

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(x) for x in self.sp.encode(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(int(token_id))


class HuggingFaceTokenizer:
    """The same interface around transformers' `AutoTokenizer` loaded from a local folder (Megatron's
    `--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`), e.g. the `hf_assets/` folder that
    `convert hf-to-megatron` copies beside the checkpoint.

    Text is tokenized without the tokenizer's special tokens (no BOS): documents are packed with the
    EOD id between them, as with sentencepiece. EOD is the tokenizer's EOS token; the mask token is
    its `mask_token` if it has one (None otherwise: the absorbing-mask objectives then ask for
    --mask-token-id / --mask-token). `vocab_size` is `len(tokenizer)` (added tokens included), as in
    Megatron-LM; a converted model's embedding may be larger."""

    def __init__(self, path: str):
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not path or not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f)) for f in files):
            raise ValueError(f"--tokenizer-model {path}: HuggingFaceTokenizer needs a local folder holding "
                             "tokenizer.json / tokenizer_config.json (e.g. a converted checkpoint's hf_assets)")
        from transformers import AutoTokenizer

        self.model_path = path
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--tokenizer-model {path}: transformers cannot load a tokenizer from it ({first})") from None
        if self.tok.eos_token_id is None:
            raise ValueError(f"--tokenizer-model {path}: the tokenizer has no EOS token to end documents with (EOD)")
        self.vocab_size, self.eod = len(self.tok), int(self.tok.eos_token_id)
        self.mask_token_id = None if self.tok.mask_token_id is None else int(self.tok.mask_token_id)
        self.pad = self.eod if self.tok.pad_token_id is None else int(self.tok.pad_token_id)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text` (no special tokens added)."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def piece(self, token_id: int) -> str:
        return self.tok.convert_ids_to_tokens(int(token_id))


#: sentencepiece piece types (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def hf_tokenizer_from_sentencepiece(model_path: Optional[str] = None, eos_id: Optional[int] = None,
                                    mask_id: Optional[int] = None):
    """A transformers `PreTrainedTokenizerFast` (a `tokenizers` Unigram model) equivalent to the
    sentencepiece unigram model `model_path` (default: the shipped one): the same ids for every
    text (the model's normalizer spec: precompiled character map, extra-whitespace removal, dummy
    prefix, whitespace escaping; user-defined pieces always whole; control pieces never produced
    from text, as in sentencepiece: `split_special_tokens`), the same text back from `decode`
    (an unknown character decodes to the unk piece, where sentencepiece writes " \u2047 ").
    Its EOS token is the piece of `eos_id` and its mask token the piece of `mask_id` (default: the
    ids `SentencePieceTokenizer` gives the model, the trainer's EOD and mask ids), so the special
    token ids are the training ids. No BOS/EOS is added to encoded text (training adds none)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    sp = SentencePieceTokenizer(model_path)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(sp.model_path).read_bytes())
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        kind = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        raise ValueError(f"tokenizer {sp.model_path}: a {kind} sentencepiece model; the export writes unigram models "
                         "as Hugging Face tokenizers (pass a Hugging Face tokenizer folder as --tokenizer-model)")
    pieces = list(proto.pieces)
    # Control pieces (<s>, </s>, <mask>, ...) are ids only: a score no text segmentation can choose.
    vocab = [(p.piece, -1e9 if p.type in (_CONTROL, _UNUSED) else float(p.score)) for p in pieces]
    byte_fallback = bool(proto.trainer_spec.byte_fallback)
    tok = Tokenizer(models.Unigram(vocab, unk_id=int(proto.trainer_spec.unk_id), byte_fallback=byte_fallback))
    spec = proto.normalizer_spec
    norm = []
    if spec.precompiled_charsmap:
        norm.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:  # sentencepiece: spaces only, stripped at both ends, runs collapsed
        norm += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        norm.append(normalizers.Prepend(" "))
    if spec.escape_whitespaces:
        norm.append(normalizers.Replace(" ", "\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    user = sorted((p.piece for p in pieces if p.type == _USER_DEFINED), key=len, reverse=True)
    if user:
        import re

        tok.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(re.escape(u) for u in user)), behavior="isolated")
    dec = [decoders.Replace("\u2581", " ")] if spec.escape_whitespaces else []
    if byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)

    def piece(i: Optional[int]) -> Optional[str]:
        return None if i is None or not 0 <= int(i) < len(pieces) else pieces[int(i)].piece

    named = {"unk_token": piece(proto.trainer_spec.unk_id), "bos_token": piece(proto.trainer_spec.bos_id),
             "eos_token": piece(sp.eod if eos_id is None else eos_id), "pad_token": piece(proto.trainer_spec.pad_id),
             "mask_token": piece(sp.mask_token_id if mask_id is None else mask_id)}
    named = {k: v for k, v in named.items() if v is not None}
    extra = [p.piece for p in pieces if p.type == _CONTROL and p.piece not in named.values()]
    return PreTrainedTokenizerFast(tokenizer_object=tok, **named, extra_special_tokens=extra,
                                   split_special_tokens=True, clean_up_tokenization_spaces=False)


#: the files of a Hugging Face tokenizer folder that define it (hashed by `tokenizer_sha256`)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model")


def tokenizer_sha256(path: str) -> str:
    """sha256 of a tokenizer file, or of a Hugging Face tokenizer folder's defining files (name and
    bytes of each, in order)."""
    if os.path.isfile(path):
        return _sha256(path)
    h = hashlib.sha256()
    for name in HF_TOKENIZER_FILES:
        if Path(path, name).is_file():
            h.update(name.encode() + b"\0" + Path(path, name).read_bytes() + b"\0")
    return h.hexdigest()


def tokenizer_record(tokenizer_type: Optional[str], tokenizer_model: Optional[str]) -> Dict[str, str]:
    """What a checkpoint records about its tokenizer beside the flags (`--tokenizer-type`,
    `--tokenizer-model`, a relative path or none for the shipped model): the file's absolute path
    and sha256, so an export from another directory, or after the shipped model changed, finds
    the very tokenizer the model was trained with or says it cannot. {} for NullTokenizer.
    The file (sentencepiece) or folder (Hugging Face) is the one `megatron_data.build_tokenizer` reads."""
    if tokenizer_type in (None, "SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        path = tokenizer_model or DEFAULT_MODEL
    else:
        path = tokenizer_model if tokenizer_type == "HuggingFaceTokenizer" else None
    if path is None or not os.path.exists(path):
        return {}
    return {"tokenizer_path": os.path.abspath(path), "tokenizer_sha256": tokenizer_sha256(path)}


def train_sentencepiece(texts: Sequence[str], vocab_size: int = 1024) -> bytes:
    """Serialized unigram sentencepiece model trained on `texts` (one document per item)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)), model_writer=buf, model_type="unigram", vocab_size=vocab_size,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece=PAD, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS,
        control_symbols=RESERVED, user_defined_symbols=[NEWLINE], normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=1.0,
        split_digits=True, max_sentence_length=1 << 16, num_threads=1, minloglevel=2)
    return buf.getvalue()


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_assets(out_dir: Optional[str] = None, vocab_size: int = 1024) -> Dict[str, str]:
    """Extract the corpus from `pydoc_data.topics`, train the tokenizer, write both and a manifest."""
    out_dir = out_dir or corpus_mod.ASSET_DIR
    os.makedirs(out_dir, exist_ok=True)
    docs = corpus_mod.extract_pydoc_documents()
    corpus_path = os.path.join(out_dir, corpus_mod.CORPUS_FILE)
    corpus_mod.write_documents(docs, corpus_path)
    model_path = os.path.join(out_dir, MODEL_FILE if vocab_size == 1024 else f"pydoc_topics_unigram{vocab_size}.model")
    Path(model_path).write_bytes(train_sentencepiece([d["text"] for d in docs], vocab_size))
    import sentencepiece

    manifest = {"source": "pydoc_data.topics of CPython (PSF License)", "python": platform.python_version(),
                "sentencepiece": sentencepiece.__version__, "documents": len(docs),
                "characters": sum(len(d["text"]) for d in docs), "vocab_size": vocab_size,
                "files": {os.path.basename(p): _sha256(p) for p in (corpus_path, model_path)},
                "command": "python -m megatron_csbp.data.tokenizer build"}
    Path(out_dir, MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {"corpus": corpus_path, "model": model_path, "manifest": os.path.join(out_dir, MANIFEST_FILE)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    parser = argparse.ArgumentParser(prog="python -m megatron_csbp.data.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="rebuild the corpus and tokenizer assets")
    b.add_argument("--out-dir", default=corpus_mod.ASSET_DIR)
    b.add_argument("--vocab-size", type=int, default=1024)
    e = sub.add_parser("encode", help="print the ids and pieces of a text")
    e.add_argument("text")
    e.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    if args.cmd == "build":
        for k, p in build_assets(args.out_dir, args.vocab_size).items():
            print(f"{k}: {p}")
        return 0
    tok = SentencePieceTokenizer(args.model)
    ids = tok.tokenize(args.text)
    print(ids)
    print([tok.piece(i) for i in ids])
    return 0


if __name__ == "__main__":
    sys.exit(main())
