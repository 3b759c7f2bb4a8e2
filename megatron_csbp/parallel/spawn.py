"""Spawn N single-threaded CPU ranks on gloo and collect what each returns (benchmarks, tests)."""
from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: imported once by the fork server every rank is forked from: a spawned rank would import them again
#: (about 6 s of CPU per rank, most of a small test's time)
PRELOAD = ("torch", "megatron.core", "megatron_csbp.training.trainer")


def _start_method(setup) -> str:
    """"spawn" where `setup` must run before megatron is imported (tests/cuda_shaped.py), else a fork
    server that preloads PRELOAD (started on first use, from this process's environment)."""
    if setup is not None:
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def _entry(rank, world_size, port, out_dir, fn, args, setup, environ):
    os.environ.clear()  # the caller's environment now, as a spawned rank would have it
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        backend = setup(rank) if setup is not None else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # saved outside any torch-function mode a setup may have entered
        with torch._C.DisableTorchFunction():
            torch.save({"ok": True, "result": result}, path)
    except BaseException:
        with torch._C.DisableTorchFunction():
            torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        from megatron_csbp.parallel import state as bps

        if bps.is_initialized():
            bps.destroy_block_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, *args, attempts: int = 3, setup=None):
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return the list of results.

    `fn` must be importable (module level). `setup(rank)`, if given (importable too), runs in each
    rank before the process group and returns its backend (tests/cuda_shaped.py makes the rank
    CUDA-shaped and asks for "nccl"). An exception on any rank fails the call with that
    rank's traceback. The rendezvous port is picked free and then bound by rank 0, so another
    process can take it in between: that (and only that) is retried on a new port."""
    for attempt in range(attempts):
        try:
            return _spawn_once(fn, world_size, args, setup)
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == attempts - 1:
                raise


def _spawn_once(fn, world_size: int, args, setup):
    with tempfile.TemporaryDirectory() as out_dir:
        paths = [os.path.join(out_dir, f"rank{r}.pt") for r in range(world_size)]
        try:
            mp.start_processes(_entry, args=(world_size, free_port(), out_dir, fn, args, setup, dict(os.environ)),
                               nprocs=world_size, join=True, start_method=_start_method(setup))
        except Exception as exc:
            saved = {r: torch.load(p, weights_only=False) for r, p in enumerate(paths) if os.path.exists(p)}
            errors = [f"--- rank {r} ---\n{rec['error']}" for r, rec in saved.items() if not rec["ok"]]
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors or [str(exc)])) from None
        return [torch.load(p, weights_only=False)["result"] for p in paths]
