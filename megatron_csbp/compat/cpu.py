"""Run megatron-core 0.16.1 on CPU (gloo): one shim, active only when CUDA is absent.

`install_cpu_compat()` is a no-op when `torch.cuda.is_available()`. Without CUDA it patches the
call sites below, none of which change numerics: every patch either replaces a CUDA-only device,
stream or RNG call by its CPU equivalent, or lifts a CUDA-only type check. It is idempotent: a
second call only extends the device remap to megatron modules imported since the first call.

| component (megatron.core 0.16.1) | what breaks on CPU | what the shim does |
|---|---|---|
| `tensor_parallel.random` tracker (`add`, `fork`), `model_parallel_cuda_manual_seed`, checkpoint recompute (`_get/_set_cuda_rng_state`) | reads/writes `torch.cuda` RNG state (a lazy no-op or an error without CUDA: recompute would silently replay other random numbers) | `CpuRNGStatesTracker` (a `CudaRNGStatesTracker` subclass) keeps named states of the CPU generator; the module-level RNG get/set use `torch.get/set_rng_state`; `torch.cuda.manual_seed` there seeds the CPU generator |
| rotary embedding, router, global memory buffer, mappings, DDP buffers, schedules, optimizers, clip grads, `dist_checkpointing` (every module that names CUDA) | `device="cuda"` / `torch.cuda.current_device()` factories, `torch.cuda.Stream/stream/Event/synchronize/empty_cache` | the module's global `torch` becomes a proxy: factory calls with a CUDA `device` get `cpu`, `torch.cuda.current_device()` is `cpu`, streams/events are no-op objects, `synchronize`/`empty_cache` do nothing, memory statistics read 0 |
| `clip_grad_by_total_norm_fp32` | asserts `grad.type() == 'torch.cuda.FloatTensor'` | runs with CPU tensors reporting `torch.cuda.*` type names (fp32 clip by total norm, unchanged) |
| `Float16OptimizerWithFloat16Params`, `DistributedOptimizer` | dispatch on `param.type()` being `torch.cuda.*Tensor` | same type-name view during their construction |
| `DistributedOptimizer._set_main_param_and_optimizer_states` with torch Adam (no TE/Apex) | fully-reshardable load skips the per-param `step` (restored from param groups) then copies it: KeyError | copy the keys present |
| `DistributedOptimizer.state_dict` with torch Adam, before the first step | asserts one per-param `step` value; none exist yet (loading into a fresh run) | create torch Adam's first-step state (zeros, step 0) first |
| `DistributedOptimizer.load_state_dict` with torch Adam | one shared `step` tensor for all parameters, incremented in place once per parameter: resumed runs use wrong bias corrections (silent) | each state gets its own copy |
| `DistributedOptimizer.get_parameter_state_dp_zero` (checkpointing, `fully_reshardable`) | non-gloo branch calls `send_tensor.cuda()` | always the gloo branch (on CPU the data-parallel group is gloo anyway) |
| `transformer.moe.moe_utils` without TransformerEngine | `te_general_gemm` is never defined: NameError in the router GEMM | defined as `None` (the code's own non-TE path) |
| MoE all-to-all dispatcher | `torch.cuda.Stream()` side stream; split sizes passed as tensors/arrays, which gloo's `all_to_all_single` rejects | streams through the proxy (one no-op stream, so no side-stream bookkeeping); `_AllToAll` converts split sizes to lists |
| `WrappedTorchNorm` with `--sequence-parallel` | asserts "sequence parallel not supported by torch LayerNorm" | builds the norm without the assert and tags its parameters `sequence_parallel=True`, so `finalize_model_grads` all-reduces their gradients over TP exactly as for TE norms |

Proxied modules are those already imported when the shim runs (it imports the ones training,
checkpointing and MoE need first); call it again after importing more of megatron-core.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
import sys
import types

import torch

_INSTALLED = False
_PROXIED: set = set()

# Modules whose CUDA call sites training, checkpointing and MoE reach; imported before patching.
_EAGER_MODULES = (
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.ssm.gated_delta_net",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.core",
    "megatron.core.dist_checkpointing.mapping",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


# --------------------------------------------------------------------------------------------
# device remap
# --------------------------------------------------------------------------------------------
def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _NoOpStream:
    """Stands in for torch.cuda.Stream / current_stream / default_stream."""

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoOpEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_STREAM = _NoOpStream()


class _NoOpEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as seen by a proxied megatron module."""

    def __init__(self):
        super().__init__("torch.cuda(cpu-compat)")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(*a, **k):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def Stream(*a, **k):  # noqa: N802 - mirrors torch.cuda.Stream
        return _STREAM

    Event = _NoOpEvent

    @staticmethod
    def current_stream(*a, **k):
        return _STREAM

    @staticmethod
    def default_stream(*a, **k):
        return _STREAM

    @staticmethod
    def stream(*a, **k):
        return contextlib.nullcontext()

    @staticmethod
    def memory_allocated(*a, **k):
        return 0

    max_memory_allocated = memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(*a, **k):
        pass

    @staticmethod
    def get_rng_state(*a, **k):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *a, **k):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed):
        torch.manual_seed(seed)


_CPU_CUDA = _CpuCuda()


def _remap_device_kwarg(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _TorchProxy(types.ModuleType):
    """`torch` as seen by a proxied megatron module: CUDA devices become CPU."""

    def __init__(self):
        super().__init__("torch(cpu-compat)")
        self.__dict__["_wrapped"] = {}

    def __getattr__(self, name):
        if name == "cuda":
            return _CPU_CUDA
        value = getattr(torch, name)
        if isinstance(value, (types.BuiltinFunctionType, types.FunctionType)):
            cache = self.__dict__["_wrapped"]
            if name not in cache:
                cache[name] = _remap_device_kwarg(value)
            return cache[name]
        return value


_TORCH_PROXY = _TorchProxy()


def torch_view_for_module():
    """What a megatron module should see as `torch` here: the CPU view when CUDA is absent (device
    factories and `torch.cuda.current_device()` give CPU), plain torch otherwise. For modules built
    outside the shim's list, e.g. megatron's GatedDeltaNet while constructing it."""
    return _TORCH_PROXY if cuda_absent() else torch


def _mentions_cuda(module) -> bool:
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return "cuda" in f.read()
    except OSError:
        return False


def _proxy_loaded_modules() -> None:
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or name in _PROXIED or module is None:
            continue
        if getattr(module, "torch", None) is torch and _mentions_cuda(module):
            module.torch = _TORCH_PROXY
        _PROXIED.add(name)


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------
def _make_cpu_tracker_class(random_mod):
    base = random_mod.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker on the CPU generator: named states, `add` and `fork` behave as
        on GPU (fork swaps the generator state in, runs, saves the advanced state, restores)."""

        def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
            if use_cudagraphable_rng:
                raise ValueError("CUDA-graph-safe RNG needs CUDA")
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception("seed {} already exists".format(seed))
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception("cuda rng state {} already exists".format(name))
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception("cuda rng state {} is not added".format(name))
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(f"current state name {self._current_state_name} is not the same as "
                                    f"the desired state name {name}.")
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    CpuRNGStatesTracker.__cpu_compat__ = True
    return CpuRNGStatesTracker


def _patch_rng() -> None:
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    if getattr(random_mod.CudaRNGStatesTracker, "__cpu_compat__", False):
        return

    def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    random_mod._get_cuda_rng_state = _get_cpu_rng_state
    random_mod._set_cuda_rng_state = _set_cpu_rng_state
    random_mod.CudaRNGStatesTracker = _make_cpu_tracker_class(random_mod)
    tracker = random_mod._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not getattr(type(tracker), "__cpu_compat__", False):
        random_mod.initialize_rng_tracker(force_reset=True)


# --------------------------------------------------------------------------------------------
# tensor type names
# --------------------------------------------------------------------------------------------
_ORIG_TENSOR_TYPE = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _ORIG_TENSOR_TYPE(self)
        return name.replace("torch.", "torch.cuda.", 1)
    return _ORIG_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def cuda_type_names():
    """While active, CPU tensors report `torch.cuda.<T>Tensor` from `.type()`."""
    if torch.Tensor.type is _cuda_named_type:  # nested
        yield
        return
    torch.Tensor.type = _cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = _ORIG_TENSOR_TYPE


def _with_cuda_type_names(fn):
    if getattr(fn, "__cpu_compat__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)

    wrapper.__cpu_compat__ = True
    return wrapper


def _patch_type_dispatch() -> None:
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    wrapped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            if getattr(module, "clip_grad_by_total_norm_fp32", None) is not None and \
                    not getattr(module.clip_grad_by_total_norm_fp32, "__cpu_compat__", False):
                module.clip_grad_by_total_norm_fp32 = wrapped
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    # The non-gloo branch of the DP-zero state gather moves shards with `.cuda()`; on CPU the
    # "NCCL" data-parallel group is gloo anyway, so take the gloo branch (same collectives).
    orig_gather = distrib.DistributedOptimizer.get_parameter_state_dp_zero
    if not getattr(orig_gather, "__cpu_compat__", False):
        @functools.wraps(orig_gather)
        def get_parameter_state_dp_zero(self, use_gloo_comm=True, *args, **kwargs):
            if self.data_parallel_group_gloo is None:
                self.data_parallel_group_gloo = self.data_parallel_group
            return orig_gather(self, True, *args, **kwargs)

        get_parameter_state_dp_zero.__cpu_compat__ = True
        distrib.DistributedOptimizer.get_parameter_state_dp_zero = get_parameter_state_dp_zero
    # Without TE/Apex the inner optimizer is torch Adam, whose per-parameter state has a "step"
    # tensor. The fully-reshardable load skips "step" on purpose (it is restored from the param
    # groups) but then copies every destination key: KeyError 'step'. Copy the keys it has.
    orig_set = distrib.DistributedOptimizer._set_main_param_and_optimizer_states
    if not getattr(orig_set, "__cpu_compat__", False):
        @functools.wraps(orig_set)
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return orig_set(self, model_param, tensors)
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main_param, **self.optimizer.state[main_param]}
            for key, value in tensors.items():
                dst[key].copy_(value)

        _set_main_param_and_optimizer_states.__cpu_compat__ = True
        distrib.DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    # Same fallback: `state_dict()` reads the per-parameter torch Adam "step", which does not exist
    # before the first step (loading a checkpoint into a fresh run): AssertionError. Give empty
    # states the values torch Adam would create on its first step (zeros, step 0): numerically the
    # same optimizer, and the load then overwrites them.
    orig_state_dict = distrib.DistributedOptimizer.state_dict
    if not getattr(orig_state_dict, "__cpu_compat__", False):
        @functools.wraps(orig_state_dict)
        def state_dict(self, *args, **kwargs):
            if not getattr(distrib, "HAVE_APEX_OR_TE", True):
                _init_empty_torch_adam_states(self.optimizer)
            return orig_state_dict(self, *args, **kwargs)

        state_dict.__cpu_compat__ = True
        distrib.DistributedOptimizer.state_dict = state_dict
    # Same fallback, on load: one `step` tensor object is put into every parameter's state, and
    # torch Adam increments it in place once per parameter: after a resume the bias correction
    # uses step + number of parameters (silently different updates). Give each state its own copy.
    orig_load = distrib.DistributedOptimizer.load_state_dict
    if not getattr(orig_load, "__cpu_compat__", False):
        @functools.wraps(orig_load)
        def load_state_dict(self, *args, **kwargs):
            out = orig_load(self, *args, **kwargs)
            for st in self.optimizer.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].detach().clone()
            return out

        load_state_dict.__cpu_compat__ = True
        distrib.DistributedOptimizer.load_state_dict = load_state_dict


def _init_empty_torch_adam_states(opt) -> None:
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
                opt.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# --------------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------------
def _as_split_list(sizes):
    if sizes is None or isinstance(sizes, list):
        return sizes
    if isinstance(sizes, torch.Tensor):
        return [int(x) for x in sizes.tolist()]
    return [int(x) for x in sizes]


def _patch_moe() -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    a2a = mappings._AllToAll
    if getattr(a2a.forward, "__cpu_compat__", False):
        return
    orig_forward = a2a.forward

    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        return orig_forward(ctx, group, input, _as_split_list(output_split_sizes), _as_split_list(input_split_sizes))

    forward.__cpu_compat__ = True
    a2a.forward = staticmethod(forward)


# --------------------------------------------------------------------------------------------
# torch norms with sequence parallelism
# --------------------------------------------------------------------------------------------
def _patch_torch_norm() -> None:
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    cls = torch_norm.WrappedTorchNorm
    if getattr(cls.__new__, "__cpu_compat__", False):
        return
    orig_new = cls.__new__

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

    __new__.__cpu_compat__ = True
    cls.__new__ = staticmethod(__new__)


# --------------------------------------------------------------------------------------------
def install_cpu_compat(force: bool = False) -> bool:
    """Install the CPU shim when CUDA is absent (or `force`). Returns whether it is active."""
    global _INSTALLED
    if not force and not cuda_absent():
        return False
    # Silence megatron's one-per-module "TE/Apex not installed" warnings on CPU.
    logging.getLogger("megatron.core").setLevel(max(logging.getLogger("megatron.core").level, logging.ERROR))
    for name in _EAGER_MODULES:
        importlib.import_module(name)
    _proxy_loaded_modules()
    if not _INSTALLED:
        _patch_rng()
        _patch_type_dispatch()
        _patch_moe()
        _patch_torch_norm()
        _INSTALLED = True
    return True


def is_installed() -> bool:
    return _INSTALLED
