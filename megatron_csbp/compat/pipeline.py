"""megatron-core's pipeline parallelism on CPU: the embedding tie and the sent outputs' storage.

`LanguageModule.setup_embeddings_and_output_layer` (GPTModel's constructor, PP > 1 with tied
embeddings) moves the last stage's copy of the word embeddings with `weight.data.cuda()` before
the all-reduce that copies the first stage's values into it; without CUDA `.cuda()` can only
raise. The patch runs that method with `torch.Tensor.cuda` the identity (the tensor stays on the
CPU, where gloo all-reduces it). Numerics unchanged: the same all-reduce of the same values.

`patch_output_deallocation`: the schedules' pseudo-deallocation of a stage's output must not free
storage that an asynchronous gloo send still reads (below).
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


def patch_output_deallocation() -> None:
    """Keep a stage's sent output alive while gloo may still be reading it.

    megatron-core's schedules "pseudo-deallocate" a stage's output right after posting its send
    (`deallocate_output_tensor`: `out.data = torch.empty(1)`, with `deallocate_pipeline_outputs`,
    which Megatron-LM turns on; the backward then calls autograd's engine directly). The
    interleaved schedule with `overlap_p2p_comm` posts the send asynchronously and waits on it
    later, but gloo's `isend` took the storage's raw pointer when it was posted: swapping `.data`
    frees that storage while the send may still read it, and the next stage receives whatever the
    allocator put there next (a race: Megatron-LM's interleaved losses changed from run to run).
    On CPU the patch still swaps `.data` (the schedule's backward expects it) but keeps the old
    storage referenced from the output tensor, which the schedule holds until this micro-batch's
    backward, long after the next stage received it. Memory: the in-flight micro-batches' outputs
    stay allocated, as with the flag off. CUDA tensors are deallocated as before."""
    module = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    orig = module.deallocate_output_tensor
    if getattr(orig, "__cpu_compat__", False):
        return

    @functools.wraps(orig)
    def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
        # megatron-core >= 0.19 also passes a list or dict of outputs: the original recurses into
        # it through the module's name, i.e. back into this wrapper, one tensor at a time
        sent = out.data if (isinstance(out, torch.Tensor) and deallocate_pipeline_outputs
                            and out.device.type == "cpu") else None
        orig(out, deallocate_pipeline_outputs)
        if sent is not None:
            out._sent_storage = sent  # freed with the output tensor, after its backward

    deallocate_output_tensor.__cpu_compat__ = True
    module.deallocate_output_tensor = deallocate_output_tensor
