"""Real text for the demo and tests: the shipped corpus and its sentencepiece tokenizer."""
from megatron_csbp.data.corpus import (
    DEFAULT_CORPUS,
    load_documents,
    pack_token_stream,
    split_documents,
    unigram_entropy,
)
from megatron_csbp.data.tokenizer import DEFAULT_MODEL, SentencePieceTokenizer, build_assets

__all__ = [
    "DEFAULT_CORPUS",
    "DEFAULT_MODEL",
    "SentencePieceTokenizer",
    "build_assets",
    "load_documents",
    "pack_token_stream",
    "split_documents",
    "unigram_entropy",
]
