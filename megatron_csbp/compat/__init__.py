"""megatron-core (and Megatron-LM's training loop) without TE/apex, and on CPU gloo ranks: two layers.

Library fixes (`compat.libraries`) on every device, keyed on the missing library; device
relocation (`compat.cpu.install_cpu_compat()`) only without CUDA. Which patches change numerics,
and why: docs/compat.md.
"""
from __future__ import annotations

import contextlib
import functools


def replace_once(owner, name: str, make, static: bool = False) -> None:
    """`owner.name = make(original)` (wrapped to keep its name and doc; `static`: as a staticmethod),
    unless already done."""
    orig = getattr(owner, name)
    if getattr(orig, "__cpu_compat__", False):
        return
    patched = functools.wraps(orig)(make(orig))
    patched.__cpu_compat__ = True
    setattr(owner, name, staticmethod(patched) if static else patched)


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """While active, `owner.name` is `value` (then what it was again)."""
    orig = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, orig)


def under(context):
    """A `make` for `replace_once`: the original, called inside `context()`."""
    def make(orig):
        def patched(*args, **kwargs):
            with context():
                return orig(*args, **kwargs)
        return patched
    return make
