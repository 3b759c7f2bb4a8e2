"""Real text for the demo and tests: the shipped corpus and its sentencepiece tokenizer."""
from megatron_csbp.data.corpus import (DEFAULT_CORPUS, load_documents, pack_token_stream, split_documents,
                                       unigram_entropy)

_FROM_TOKENIZER = ("DEFAULT_MODEL", "SentencePieceTokenizer", "build_assets")


def __getattr__(name):
    # imported on first use: `python -m megatron_csbp.data.tokenizer` would otherwise find the module
    # already imported by its package and warn (runpy's RuntimeWarning)
    if name in _FROM_TOKENIZER:
        from megatron_csbp.data import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = sorted(["DEFAULT_CORPUS", "load_documents", "pack_token_stream", "split_documents", "unigram_entropy",
                  *_FROM_TOKENIZER])
