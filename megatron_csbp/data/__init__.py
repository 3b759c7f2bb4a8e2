"""Real text for the demo and tests: the shipped corpus (its sentencepiece tokenizer:
`megatron_csbp.data.tokenizer`, not imported here: `python -m megatron_csbp.data.tokenizer` would
otherwise find the module already imported by its package and warn, runpy's RuntimeWarning)."""
from megatron_csbp.data.corpus import (DEFAULT_CORPUS, load_documents, pack_token_stream, split_documents,
                                       unigram_entropy)

__all__ = ["DEFAULT_CORPUS", "load_documents", "pack_token_stream", "split_documents", "unigram_entropy"]
