"""megatron-core's pipeline-parallel embedding tie on CPU.

`LanguageModule.setup_embeddings_and_output_layer` (GPTModel's constructor, PP > 1 with tied
embeddings) moves the last stage's copy of the word embeddings with `weight.data.cuda()` before
the all-reduce that copies the first stage's values into it; without CUDA `.cuda()` can only
raise. The patch runs that method with `torch.Tensor.cuda` the identity (the tensor stays on the
CPU, where gloo all-reduces it). Numerics unchanged: the same all-reduce of the same values.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch


@contextlib.contextmanager
def _cuda_is_identity():
    orig = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = orig


def patch_embedding_tie() -> None:
    module = importlib.import_module("megatron.core.models.common.language_module.language_module")
    cls = module.LanguageModule
    orig = cls.setup_embeddings_and_output_layer
    if getattr(orig, "__cpu_compat__", False):
        return

    @functools.wraps(orig)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        with _cuda_is_identity():
            return orig(self, *args, **kwargs)

    setup_embeddings_and_output_layer.__cpu_compat__ = True
    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer
