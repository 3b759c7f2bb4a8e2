"""megatron-core's pipeline parallelism on CPU: the embedding tie and the sent outputs' storage.

Why each patch is needed and why numerics are unchanged: docs/compat.md#every-patched-call-site.
"""
from __future__ import annotations

import functools
import importlib

import torch

from megatron_csbp.compat import replace_once, swapped, under

def itself(self, *args, **kwargs):
    """`Tensor.cuda` / `Module.cuda` on CPU: the tensor or module itself."""
    return self


#: while active, `Tensor.cuda()` returns the tensor itself
cuda_is_identity = functools.partial(swapped, torch.Tensor, "cuda", itself)


def patch_embedding_tie() -> None:
    module = importlib.import_module("megatron.core.models.common.language_module.language_module")
    replace_once(module.LanguageModule, "setup_embeddings_and_output_layer", under(cuda_is_identity))


def patch_output_deallocation() -> None:
    """Keep a stage's sent output alive while gloo may still be reading it.

    `deallocate_output_tensor` still swaps `.data` on CPU tensors but keeps the old storage referenced
    from the output until its backward; CUDA tensors are deallocated as before. Why (the interleaved
    schedule's asynchronous gloo send read freed storage): docs/compat.md#every-patched-call-site.
    """
    module = importlib.import_module("megatron.core.pipeline_parallel.schedules")

    def make(orig):
        def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
            # megatron-core >= 0.19 also passes a list or dict of outputs: the original recurses into
            # it through the module's name, i.e. back into this wrapper, one tensor at a time
            sent = out.data if (isinstance(out, torch.Tensor) and deallocate_pipeline_outputs
                                and out.device.type == "cpu") else None
            orig(out, deallocate_pipeline_outputs)
            if sent is not None:
                out._sent_storage = sent  # freed with the output tensor, after its backward
        return deallocate_output_tensor

    replace_once(module, "deallocate_output_tensor", make)
