"""The CUDA-shaped test device: a CPU process that believes CUDA is present and NCCL is its backend.

What a GPU without TransformerEngine or apex runs, on CPU ranks (tests/test_cuda_shaped.py):

- `torch.cuda` says a device is there (`is_available`, `device_count`, `current_device`,
  `set_device`, `synchronize`, streams, `Event` with `elapsed_time` on a host clock, memory
  statistics 0) and its RNG calls act on the CPU generator (megatron-core's tracker and recompute
  read and write "CUDA" states, which are then the CPU generator's).
- Every real tensor is on the CPU; the *device a tensor would be on* is a taint on its storage.
  A TorchFunctionMode relocates CUDA factory calls (`device=` an int, "cuda..." or a CUDA
  `torch.device`; `.cuda()`, `.to("cuda")`, `.to(cuda_tensor)`; `torch.tensor(..., device=)`) to
  the CPU (the mapping of `compat.device`, the CPU layer's own relocation) and taints what they
  return; `.cpu()` / `.to("cpu")` of a tainted tensor returns an untainted copy. A tainted tensor
  reports `device` cuda:N, `is_cuda`, `get_device()` N, so code that allocates `device=x.device`
  follows it (and `type()` names `torch.cuda.*Tensor`). A TorchDispatchMode propagates the taint from the inputs of every other op to its
  fresh outputs (views share the storage, in-place ops keep their target's), so activations,
  gradients and optimizer states of a model moved to "cuda" are tainted, and what is built on the
  CPU stays untainted.
- torch.distributed: `init_process_group("nccl")` / `new_group()` with the default or the nccl
  backend create gloo groups underneath that report backend "nccl" (`get_backend`), and every
  collective on such a group (checked at the dispatcher's c10d ops, whatever Python path issued it)
  FAILS, as NCCL does, when one of its tensors is not on the group's device ("No backend type
  associated with device type cpu"). Groups created explicitly with gloo are real gloo groups.

What it does not prove: no CUDA kernel, NCCL communicator, stream ordering or memory limit is
exercised (docs/testing.md, "cuda_shaped tier").

Use: `run(fn, world_size, *args)` spawns ranks that install the device first (before megatron is
imported, which binds some torch.cuda functions at import) and initialise torch.distributed with
"nccl"; `fn(rank, world_size, *args)` must be importable. `install()` alone for one process.
"""
from __future__ import annotations

import contextlib
import time
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_csbp.compat.device import _NoOp, _to_cpu_device

_TAG = "_cuda_shaped_on_cuda"
DEVICE_COUNT = 8
_STATE = types.SimpleNamespace(index=0, installed=False, nccl_groups=set(), modes=[], strict=True)
#: what Event.record() reads; a test may replace it (seconds)
EVENT_CLOCK = [time.perf_counter]


# ---- the taint -------------------------------------------------------------------------------------
def on_cuda(t) -> bool:
    """Whether `t` is (would be) on the CUDA device."""
    with torch._C.DisableTorchFunction():
        try:
            return bool(getattr(t.untyped_storage(), _TAG, False))
        except (RuntimeError, NotImplementedError):
            return False


def _set(t, value: bool) -> None:
    with torch._C.DisableTorchFunction():
        try:
            setattr(t.untyped_storage(), _TAG, value)
        except (RuntimeError, NotImplementedError):
            pass


def _is_cuda(device) -> bool:
    if device is None or isinstance(device, bool):
        return False
    return _to_cpu_device(device) != device  # compat.device's mapping: what it relocates is CUDA


def _cuda_device():
    return torch.device("cuda", _STATE.index)


def _storages(obj):
    with torch._C.DisableTorchFunction():
        return {id(t.untyped_storage()) for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)}


def _place(out, inputs, cuda: bool):
    """Mark every tensor of `out` as on CUDA (or not); a tensor sharing an input's storage is
    copied first (a device change always copies)."""
    shared = _storages(inputs)

    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        with torch._C.DisableTorchFunction():
            if id(t.untyped_storage()) in shared:
                t = t.clone()
        _set(t, cuda)
        return t

    return pytree.tree_map(one, out)


_DEVICE_GET = torch.Tensor.device.__get__
_IS_CUDA_GET = torch.Tensor.is_cuda.__get__
_IS_CPU_GET = torch.Tensor.is_cpu.__get__
_REAL_DEVICE = lambda t: _DEVICE_GET(t)  # noqa: E731  (where the tensor really is: cpu, or meta)


# ---- CUDA's device rule -------------------------------------------------------------------------------
#: calls whose tensor arguments may lie on different devices on CUDA: copies and moves, arguments read
#: for their shape or dtype only, `p.data = t` (Module.to), autograd's graph-wide entry points
_ANY_DEVICE = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type_as,
               torch.Tensor.view_as, torch.Tensor.expand_as, torch.Tensor.reshape_as, torch.Tensor.new_tensor,
               torch.tensor, torch.as_tensor, torch.Tensor.data.__set__, torch.autograd.grad, torch.autograd.backward,
               torch.Tensor.__deepcopy__, torch.Tensor.__reduce_ex__, torch.Tensor.__setstate__,
               torch._has_compatible_shallow_copy_type}


def _devices_checked(func, args, kwargs):
    """Raise as CUDA does when a call mixes a CUDA tensor with a CPU one (0-dim CPU tensors, like
    Python numbers, are scalars CUDA accepts). Indexing takes its index tensors on the CPU too."""
    if func in _ANY_DEVICE:
        return
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        self_, index = args[0], args[1]
        indices = [t for t in pytree.tree_leaves(index) if isinstance(t, torch.Tensor)]
        if not on_cuda(self_) and any(on_cuda(t) for t in indices):
            raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        if func is torch.Tensor.__getitem__ or not indices:
            return  # a basic-index assignment is a copy_: the value may be on any device
        args = (self_, args[2])  # index_put_: the value on self's device
    cuda, cpu = None, None
    for t in pytree.tree_leaves((args, kwargs)):
        if not isinstance(t, torch.Tensor) or _REAL_DEVICE(t).type != "cpu":
            continue
        if on_cuda(t):
            cuda = t
        elif t.dim() > 0:
            cpu = t
    if cuda is None or cpu is None:
        return
    name = getattr(func, "__name__", str(func))
    if name in ("masked_fill", "masked_fill_") and len(args) > 1 and cpu is args[1]:
        raise RuntimeError(f"expected self and mask to be on the same device, but got mask on cpu and self on "
                           f"cuda:{_STATE.index} (cuda_shaped: {name})")
    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                       f"cuda:{_STATE.index} and cpu! (cuda_shaped: {name} got a CPU tensor {tuple(cpu.shape)} "
                       f"{cpu.dtype} beside CUDA tensors)")


class _Relocate(TorchFunctionMode):
    """CUDA factories and moves land on the CPU, tainted; tainted tensors report CUDA; a call that
    mixes CUDA and CPU tensors fails as on CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _STATE.strict:
            _devices_checked(func, args, kwargs)
        if func == _DEVICE_GET:
            return _cuda_device() if on_cuda(args[0]) else func(*args, **kwargs)
        if func == _IS_CUDA_GET:
            return on_cuda(args[0]) or func(*args, **kwargs)
        if func == _IS_CPU_GET:
            return not on_cuda(args[0]) and func(*args, **kwargs)
        if func is torch.Tensor.get_device:
            return _STATE.index if on_cuda(args[0]) else func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the type name
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if on_cuda(args[0]) else name
        if func is torch.Tensor.cuda:
            self_ = args[0]
            if on_cuda(self_):
                return self_
            return _place(self_.clone(memory_format=kwargs.get("memory_format", torch.preserve_format)), self_, True)
        if func is torch.Tensor.cpu:
            return _place(args[0], args[0], False) if on_cuda(args[0]) else func(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if func in (torch.Tensor.new_tensor, torch.Tensor.type_as) and "device" not in kwargs:
            # on the device of self (new_tensor) or of the other tensor (type_as)
            cuda = on_cuda(args[0] if func is torch.Tensor.new_tensor else args[1])
            out = func(*args, **kwargs)
            return out if on_cuda(out) == cuda else _place(out, (args, kwargs), cuda)
        device = kwargs.get("device")
        if _is_cuda(device):
            kwargs["device"] = torch.device("cpu")
            return _place(func(*args, **kwargs), (args, kwargs), True)
        out = func(*args, **kwargs)
        if device is not None and any(on_cuda(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            return _place(out, (args, kwargs), False)  # an explicit CPU device for a CUDA input: a CPU copy
        return out

    @staticmethod
    def _to(func, args, kwargs):
        original = (args, dict(kwargs))
        self_, rest = args[0], list(args[1:])
        target = kwargs.pop("device", None)
        if rest and isinstance(rest[0], torch.Tensor):
            other = rest.pop(0)
            target = _cuda_device() if on_cuda(other) else torch.device("cpu")
            kwargs.setdefault("dtype", other.dtype)
        elif rest and (isinstance(rest[0], (str, torch.device)) or (isinstance(rest[0], int) and not isinstance(rest[0], bool))):
            target = rest.pop(0)
        if target is None or _is_cuda(target) == on_cuda(self_):
            if target is not None and _is_cuda(target):  # to CUDA, already there: CUDA names a CPU here
                return func(self_, torch.device("cpu"), *rest, **kwargs)
            return func(*original[0], **original[1])  # no device change: the dispatch mode keeps the taint
        out = func(self_, torch.device("cpu"), *rest, **kwargs)
        return _place(out, self_, _is_cuda(target))


class _Propagate(TorchDispatchMode):
    """Outputs of an op are on CUDA when an input is; collectives on NCCL groups check devices."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            if func.namespace == "c10d":
                _check_collective(func, args, kwargs)
            out = func(*args, **kwargs)
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not inputs or not any(on_cuda(t) for t in inputs):
                return out
            returns = func._schema.returns
            flat = out if isinstance(out, (tuple, list)) else (out,)
            for i, t in enumerate(flat):
                aliased = i < len(returns) and returns[i].alias_info is not None
                if not aliased:
                    for leaf in pytree.tree_leaves(t):
                        if isinstance(leaf, torch.Tensor):
                            _set(leaf, True)
            return out


# ---- torch.distributed: "nccl" groups over gloo ------------------------------------------------------
_UNCHECKED = {"barrier", "monitored_barrier_"}


def _group_name(obj):
    from torch._C._distributed_c10d import ProcessGroup

    try:
        return ProcessGroup.unbox(obj).group_name
    except Exception:  # a ReduceOp or another script object
        return None


def _check_collective(func, args, kwargs):
    op = func._schema.name.split("::")[-1]
    if op in _UNCHECKED:
        return
    names = [_group_name(a) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.ScriptObject)]
    group = next((n for n in names if n is not None), None)
    if group not in _STATE.nccl_groups:
        return
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and not on_cuda(t):
            raise RuntimeError(f"cuda_shaped: c10d::{op} on NCCL group {group!r} got a CPU tensor "
                               f"{tuple(t.shape)} {t.dtype}: No backend type associated with device type cpu "
                               "(NCCL takes CUDA tensors only)")


def _mark_nccl(pg) -> None:
    c10d = dist.distributed_c10d
    if pg is None or pg == c10d.GroupMember.NON_GROUP_MEMBER:
        return
    _, store = c10d._world.pg_map[pg]
    c10d._world.pg_map[pg] = ("nccl", store)
    _STATE.nccl_groups.add(pg.group_name)


def _wants_nccl(backend) -> bool:
    if backend is None:
        return dist.is_initialized() and dist.get_backend() == "nccl"
    return "nccl" in str(backend).lower()


def _patch_distributed() -> None:
    c10d = dist.distributed_c10d
    init, new_group, coll_device = c10d.init_process_group, c10d.new_group, c10d._get_object_coll_device

    def init_process_group(backend=None, *args, **kwargs):
        nccl = backend is None or "nccl" in str(backend).lower()
        kwargs.pop("pg_options", None) if nccl else None
        init("gloo" if nccl else backend, *args, **kwargs)
        if nccl:
            _mark_nccl(c10d._get_default_group())

    def new_group_(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
        nccl = _wants_nccl(backend)
        pg = new_group(ranks, timeout, "gloo" if nccl else backend, None if nccl else pg_options, *args, **kwargs)
        if nccl:
            _mark_nccl(pg)
        return pg

    def _get_object_coll_device(group=None):
        pg = group or c10d._get_default_group()
        return "cuda" if pg.group_name in _STATE.nccl_groups else coll_device(group)

    for mod in (dist, c10d):
        mod.init_process_group = init_process_group
        mod.new_group = new_group_
    c10d._get_object_coll_device = _get_object_coll_device


# ---- torch.cuda ------------------------------------------------------------------------------------
class Event:
    """torch.cuda.Event on the host: record() reads EVENT_CLOCK, elapsed_time() in ms."""

    instances = 0

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self.t = None
        Event.instances += 1

    def record(self, stream=None):
        self.t = EVENT_CLOCK[0]()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        Event.elapsed_reads = getattr(Event, "elapsed_reads", 0) + 1
        return (end.t - self.t) * 1e3


class _Stream(_NoOp):
    def __init__(self, *a, **k):
        self.device = _cuda_device()

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record()
        return event

    def is_capturing(self):  # no CUDA graph is ever captured here
        return False


_DEFAULT_STREAM = _Stream()


class _DeviceCtx:
    def __init__(self, device=None):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _properties(device=None):
    return types.SimpleNamespace(name="cuda-shaped (CPU)", total_memory=80 * 2 ** 30, major=9, minor=0,
                                 multi_processor_count=132, uuid="cuda-shaped",
                                 shared_memory_per_block_optin=227 * 1024)  # an H100 / H200


def _set_device(device):
    if isinstance(device, torch.device):
        device = device.index or 0
    elif isinstance(device, str):
        device = torch.device(device).index or 0
    _STATE.index = int(device)


class _GeneratorMeta(type(torch.Generator)):
    """torch.Generator(device="cuda") is the CPU generator's kind; every generator is an instance."""

    real = torch.Generator

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.real)

    def __call__(cls, device="cpu"):
        return cls.real(device=torch.device("cpu") if _is_cuda(device) else device)


def _patch_cuda() -> None:
    class Generator(torch.Generator, metaclass=_GeneratorMeta):
        pass

    torch.Generator = Generator
    c = torch.cuda
    cpu = torch.default_generator
    zero = lambda *a, **k: 0  # noqa: E731
    none = lambda *a, **k: None  # noqa: E731
    values = dict(
        is_available=lambda: True, device_count=lambda: DEVICE_COUNT, current_device=lambda: _STATE.index,
        set_device=_set_device, device=_DeviceCtx, _lazy_init=none, is_initialized=lambda: True,
        _lazy_call=lambda fn, **kw: fn(), synchronize=none, empty_cache=none, ipc_collect=none,
        Event=Event, Stream=_Stream, current_stream=lambda *a, **k: _DEFAULT_STREAM,
        default_stream=lambda *a, **k: _DEFAULT_STREAM, stream=lambda *a, **k: contextlib.nullcontext(),
        # the CPU generator itself (torch.manual_seed calls torch.cuda.manual_seed_all: no recursion)
        get_rng_state=lambda *a, **k: cpu.get_state(), set_rng_state=lambda s, *a, **k: cpu.set_state(s),
        manual_seed=lambda seed: cpu.manual_seed(seed), manual_seed_all=lambda seed: cpu.manual_seed(seed),
        seed=lambda: cpu.seed(), seed_all=lambda: cpu.seed(), initial_seed=lambda: cpu.initial_seed(),
        get_rng_state_all=lambda: [cpu.get_state()] * DEVICE_COUNT,
        set_rng_state_all=lambda states: cpu.set_state(states[0]),
        default_generators=(torch.default_generator,) * DEVICE_COUNT,
        get_device_properties=_properties, get_device_capability=lambda *a, **k: (9, 0),
        get_device_name=lambda *a, **k: "cuda-shaped (CPU)", is_bf16_supported=lambda *a, **k: True,
        is_current_stream_capturing=lambda: False,
        memory_allocated=zero, max_memory_allocated=zero, memory_reserved=zero, max_memory_reserved=zero,
        reset_peak_memory_stats=none, reset_max_memory_allocated=none, memory_stats=lambda *a, **k: {},
        mem_get_info=lambda *a, **k: (80 * 2 ** 30, 80 * 2 ** 30),
    )
    for name, value in values.items():
        setattr(c, name, value)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "get_rng_state_all",
                 "set_rng_state_all", "seed", "seed_all", "initial_seed"):
        setattr(c.random, name, values[name])
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                 "reset_peak_memory_stats", "memory_stats", "mem_get_info"):
        setattr(c.memory, name, values[name])
    c.nccl.version = lambda: (2, 27, 0)  # torch.distributed's error logging asks NCCL's version
    for name in ("range_push", "range_pop", "mark"):
        setattr(c.nvtx, name, none)
    c.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    # torch.accelerator (torch >= 2.6; torch.optim's Adam asks it for the current stream before each
    # step): on a CUDA build of torch it asks the real driver, so it is the same mocked device.
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        for name, value in dict(
            is_available=lambda *a, **k: True, device_count=lambda: DEVICE_COUNT,
            current_accelerator=lambda *a, **k: torch.device("cuda"),
            current_device_index=lambda: _STATE.index, current_device_idx=lambda: _STATE.index,
            set_device_index=_set_device, set_device_idx=_set_device,
            current_stream=lambda *a, **k: _DEFAULT_STREAM, synchronize=none,
        ).items():
            if hasattr(acc, name):
                setattr(acc, name, value)


def _relocate_in_backward(relocate) -> None:
    """The autograd engine carries dispatch modes into backward but not function modes: custom
    Functions' backward (the transports', megatron-core's) runs with the relocation re-entered."""
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    orig = BackwardCFunction.apply

    def apply(self, *args):
        if any(m is relocate for m in _get_current_function_mode_stack()):
            return orig(self, *args)
        with relocate:
            return orig(self, *args)

    BackwardCFunction.apply = apply


def install() -> None:
    """Make this process the CUDA-shaped device (idempotent). Call before importing megatron."""
    if _STATE.installed:
        return
    _patch_cuda()
    _patch_distributed()
    relocate, propagate = _Relocate(), _Propagate()
    relocate.__enter__()
    propagate.__enter__()
    _relocate_in_backward(relocate)
    _STATE.modes = [relocate, propagate]
    _STATE.installed = True


# ---- spawning ranks --------------------------------------------------------------------------------------
def _setup(rank: int) -> str:
    """A spawned rank becomes the CUDA-shaped device 'rank'; its process group is "nccl" (gloo underneath)."""
    install()
    torch.cuda.set_device(rank)
    return "nccl"


def run(fn, world_size: int, *args):
    """fn(rank, world_size, *args) on `world_size` CUDA-shaped ranks ("nccl" over gloo); the results.
    An exception on any rank fails the call with that rank's traceback (`utils.spawn`)."""
    from megatron_csbp.parallel.spawn import spawn

    return spawn(fn, world_size, *args, setup=_setup)
