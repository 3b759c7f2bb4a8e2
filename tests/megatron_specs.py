"""Reading megatron-core layer specs by what they build, not by how one release spells the entry.

A spec entry (e.g. a layer's `submodules.mlp`) is a `ModuleSpec`, a class, or a `functools.partial`:
megatron-core 0.16.1 gives `ModuleSpec(module=MLP, submodules=...)`; 0.19 gives
`partial(MLP.as_mlp_submodule, submodules=...)` for a dense MLP and `partial(MoELayer, submodules=...)`
for MoE."""
import functools
import inspect

from megatron.core.transformer.spec_utils import ModuleSpec


def built_class(entry):
    """The module class the spec entry builds."""
    if isinstance(entry, ModuleSpec):
        return built_class(entry.module)
    if isinstance(entry, functools.partial):
        return built_class(entry.func)
    if inspect.ismethod(entry) and inspect.isclass(entry.__self__):  # a classmethod constructor
        return entry.__self__
    if inspect.isclass(entry):
        return entry
    raise TypeError(f"not a layer-spec entry megatron-core builds a module from: {entry!r}")


def spec_submodules(entry):
    """The `submodules` the spec entry builds its module with (None when it has none)."""
    if isinstance(entry, ModuleSpec):
        return entry.submodules
    if isinstance(entry, functools.partial):
        return entry.keywords.get("submodules")
    return None
