"""The traffic accounting (`attention.accounting`, recorded by `attention.transports`) against bytes
counted at the process-group layer.

For the duration of one forward + backward, torch.distributed's collectives are wrapped: every
call counts the bytes of the tensors actually handed to it that leave or reach this rank (an
all-gather sends its input to P - 1 peers and receives the P - 1 other shards of its output; a
reduce-scatter sends the P - 1 shards it does not keep and receives P - 1 copies of the one it
does; a batched isend/irecv the tensors of its ops; an all-to-all the rows whose peer is not
itself). On 2 gloo ranks, for the all-gather and ring transports (CP and CSBP) and DiffusionGemma's
windowed all-to-all (CSBP with sliding windows, K=V raw-k exchange), the counter's logical bytes
must equal those counts, sent and received, per rank.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def counted_collectives():
    """Wrap the torch.distributed collectives the transports can issue; yields the counts."""
    counts = {"sent": 0, "received": 0, "calls": []}
    originals = {}

    def wrap(name, count):
        original = getattr(dist, name)
        originals[name] = original

        def wrapper(*args, **kwargs):
            count(*args, **kwargs)
            counts["calls"].append(name)
            return original(*args, **kwargs)

        setattr(dist, name, wrapper)

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        P = dist.get_world_size(group)
        counts["sent"] += (P - 1) * _nbytes(input)
        counts["received"] += _nbytes(output) - _nbytes(input)

    def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
        counts["sent"] += _nbytes(input) - _nbytes(output)
        counts["received"] += _nbytes(input) - _nbytes(output)

    def batch_isend_irecv(ops):
        for op in ops:
            counts["sent" if op.op is dist.isend else "received"] += _nbytes(op.tensor)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        me, P = dist.get_rank(group), dist.get_world_size(group)
        row_in = _nbytes(input) // max(1, input.shape[0])
        row_out = _nbytes(output) // max(1, output.shape[0])
        send = input_split_sizes or [input.shape[0] // P] * P
        recv = output_split_sizes or [output.shape[0] // P] * P
        counts["sent"] += sum(n for peer, n in enumerate(send) if peer != me) * row_in
        counts["received"] += sum(n for peer, n in enumerate(recv) if peer != me) * row_out

    def unexpected(name):
        def count(*args, **kwargs):
            raise AssertionError(f"attention issued torch.distributed.{name}: not counted by this test")
        return count

    for name, fn in [("all_gather_into_tensor", all_gather_into_tensor), ("reduce_scatter_tensor", reduce_scatter_tensor),
                     ("batch_isend_irecv", batch_isend_irecv), ("all_to_all_single", all_to_all_single)]:
        wrap(name, fn)
    # (isend/irecv stay unwrapped: P2POp accepts only the originals; the ring batches them.)
    for name in ("all_reduce", "all_gather", "send", "recv", "all_to_all", "broadcast"):
        wrap(name, unexpected(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _gpt_model(cp, bp, transport):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from tests.test_model_parallel_exactness import B, L, build_gpt, objective

    layout = SequenceLayout(BlockGeometry(L, B, "block_causal"), cp, bp)
    return BlockDiffusionModel(build_gpt(), objective(), layout, bps.get_shard_rank(),
                               bps.get_clean_ring_group(), transport)


def _gpt_step(model):
    from tests.test_model_parallel_exactness import batch

    return model(*batch()).loss


def _dg_model(cp, bp, transport):
    from tests.test_kv_source_exchange import _config, _gpt, _model

    return _model(_gpt(_config(sliding_k_eq_v=True)), cp, bp, transport)


def _dg_step(model):
    from tests.test_kv_source_exchange import _batch

    return model(*_batch()).loss


MODELS = {"gpt": (_gpt_model, _gpt_step), "diffusiongemma": (_dg_model, _dg_step)}


def _rank(rank, world, cases):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.attention.accounting import traffic_counter
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    out = []
    for family, cp, bp, transport in cases:
        build, step = MODELS[family]
        bps.initialize_block_parallel(context_parallel_size=cp, block_parallel_size=bp)
        model = build(cp, bp, transport)
        counter = traffic_counter()
        counter.reset()
        with counted_collectives() as counts:
            step(model).backward()
        out.append(dict(case=(family, cp, bp, transport), logical_sent=counter.total_sent,
                        logical_received=counter.total_received, sent=counts["sent"], received=counts["received"],
                        calls=sorted(set(counts["calls"]))))
        counter.reset()
        bps.destroy_block_parallel()
    return out


CASES = [("gpt", 2, 1, "allgather"), ("gpt", 2, 1, "ring"), ("gpt", 2, 2, "allgather"), ("gpt", 2, 2, "ring"),
         ("diffusiongemma", 2, 2, "allgather")]


def test_logical_bytes_equal_bytes_at_the_collectives():
    results = run_distributed(_rank, 2, CASES)
    for rank, per_rank in enumerate(results):
        for res in per_rank:
            print(f"rank {rank} {res['case']}: logical sent/received {res['logical_sent']}/{res['logical_received']}, "
                  f"at the collectives {res['sent']}/{res['received']} ({', '.join(res['calls'])})")
    for per_rank in results:
        for res in per_rank:
            assert res["sent"] > 0, res  # every case moves K/V
            assert (res["logical_sent"], res["logical_received"]) == (res["sent"], res["received"]), res
    calls = {c for per_rank in results for res in per_rank for c in res["calls"]}
    # the cases reach every transport: all-gather + reduce-scatter, ring shifts, windowed all-to-all
    assert {"all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv", "all_to_all_single"} <= calls, calls
