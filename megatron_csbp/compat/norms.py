"""megatron-core's torch norms (no TE) with TP sequence parallelism.

The patch lifts `WrappedTorchNorm`'s sequence-parallel assert and tags its parameters
`sequence_parallel=True`, so their gradients are all-reduced over TP as for TE norms
(docs/compat.md).
"""
from __future__ import annotations

import copy
import importlib

from megatron_csbp.compat import replace_once


def patch_torch_norm() -> None:
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")

    def make(orig_new):
        def __new__(klass, config, hidden_size, eps=1e-5, *args, **kwargs):
            if not getattr(config, "sequence_parallel", False):
                return orig_new(klass, config, hidden_size, eps, *args, **kwargs)
            plain = copy.copy(config)
            plain.sequence_parallel = False
            norm = orig_new(klass, plain, hidden_size, eps, *args, **kwargs)
            for p in norm.parameters():
                # Replicated over TP but fed sequence shards: finalize_model_grads all-reduces these.
                setattr(p, "sequence_parallel", True)
            return norm
        return __new__

    replace_once(torch_norm.WrappedTorchNorm, "__new__", make, static=True)
