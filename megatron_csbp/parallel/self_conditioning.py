"""Self-conditioning under pipeline parallelism (`--self-conditioning-prob > 0` with
`--pipeline-model-parallel-size > 1`), exactly as on one stage.

Per iteration (`SelfConditioningRelay.run`) the picked micro-batches' first pass runs through
megatron-core's forward-only schedule and the last stage sends their noisy rows' final hidden
states to the first stage. Why hidden states, and the costs at 256K tokens:
docs/pipeline.md#self-conditioning-diffusiongemma-sft.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


class SelfConditioningRelay:
    """The first pass of self-conditioning for one rank's model chunks (docs/pipeline.md).

    `chunks`: this rank's `TrainableBDLM` chunks (virtual stage order); `ddps`: their DDP wrappers
    (what megatron-core's schedules run)."""

    def __init__(self, chunks: list, ddps: list):
        from megatron.core import parallel_state as mpu

        self.chunks, self.ddps = chunks, ddps
        self.pp_size = mpu.get_pipeline_model_parallel_world_size()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.first_rank = mpu.get_pipeline_model_parallel_first_rank()
        self.last_rank = mpu.get_pipeline_model_parallel_last_rank()
        self.is_first = mpu.is_pipeline_first_stage(ignore_virtual=True)
        self.is_last = mpu.is_pipeline_last_stage(ignore_virtual=True)
        self.interleaved = len(chunks) > 1
        #: bytes this rank sent / received in the last `run` (shape headers included)
        self.sent_bytes = self.received_bytes = 0

    def picked(self, batches: List[dict]) -> List[int]:
        """The micro-batches (indices into `batches`) whose first pass runs, in order."""
        bdlm = self.chunks[0].bdlm
        picked = [j for j, b in enumerate(batches)
                  if bdlm.draws_self_conditioning(b["tokens"], b["loss_mask"], b["sample_index"],
                                                  b.get("document_ids"))]
        if self.interleaved and picked:
            rest = [j for j in range(len(batches)) if j not in picked]
            pad = -len(picked) % self.pp_size
            picked = sorted(picked + rest[:pad])
        return picked

    def run(self, fb, batches: List[dict], seq_length: int, micro_batch_size: int) -> None:
        """Runs the first pass over the picked `batches` with megatron-core's schedule `fb` and
        sets `batch["self_conditioning"]` on the first stage (the last stage's output-layer input
        of the noisy rows, [noisy rows (/TP under SP), b, h]) for each of them."""
        for b in batches:
            b.pop("self_conditioning", None)
        self.sent_bytes = self.received_bytes = 0
        picked = self.picked(batches)
        if not picked:
            return
        sub = [batches[j] for j in picked]

        def forward_step(data_iterator, model):
            b = next(data_iterator)  # (model: the chunk's DDP; the last stage: the schedule collects the output)
            return model.module.first_pass(b["tokens"], b["loss_mask"], b["sample_index"], None,
                                           b.get("document_ids")), None

        data = iter(sub) if len(self.ddps) == 1 else [iter(sub) for _ in self.ddps]
        with torch.no_grad():
            hidden = fb(forward_step_func=forward_step, data_iterator=data, model=self.ddps,
                      num_microbatches=len(sub), seq_length=seq_length, micro_batch_size=micro_batch_size,
                      forward_only=True)
        if self.is_last:
            for s in hidden:
                self._send(s.contiguous())
        elif self.is_first:
            for b in sub:
                b["self_conditioning"] = self._recv()

    def _send(self, t: torch.Tensor) -> None:
        header = torch.tensor(list(t.shape) + [_DTYPES.index(t.dtype)], dtype=torch.long, device=t.device)
        dist.send(header, self.first_rank, group=self.pp_group)
        dist.send(t, self.first_rank, group=self.pp_group)
        self.sent_bytes += header.numel() * 8 + t.numel() * t.element_size()

    def _recv(self) -> torch.Tensor:
        device = self.chunks[0].bdlm.gpt.shared_embedding_or_output_weight().device
        header = torch.empty(4, dtype=torch.long, device=device)
        dist.recv(header, self.last_rank, group=self.pp_group)
        *shape, dtype = (int(x) for x in header)
        t = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        dist.recv(t, self.last_rank, group=self.pp_group)
        self.received_bytes += header.numel() * 8 + t.numel() * t.element_size()
        return t


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # the header's dtype codes


def relay_for(chunks: list, ddps: list) -> Optional[SelfConditioningRelay]:
    """The relay of a pipelined run whose objective draws self-conditioning, else None."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() == 1 or not getattr(chunks[0].objective,
                                                                         "self_conditioning_prob", 0.0):
        return None
    return SelfConditioningRelay(chunks, ddps)
