"""Self-conditioning under pipeline parallelism (`--self-conditioning-prob > 0` with
`--pipeline-model-parallel-size > 1`), exactly as on one stage.

On one stage a micro-batch that draws self-conditioning runs a no-grad first pass over its noisy
rows, and the training pass's embedding adds GeGLU(norm(soft)) with soft = softmax_fp32(logits) @
E * sqrt(h) (E: the tied word embeddings; the logits are detached, E is not: E gets a gradient
through soft; DiffusionGemmaModel.embed). Under PP the first pass has to run through every stage
before the first stage can start that micro-batch's training forward, so it cannot live inside one
micro-batch of a 1F1B schedule. Instead, per iteration (`SelfConditioningRelay.run`):

1. every stage picks the same micro-batches: those where a sample draws self-conditioning (the
   draw is per sample from `sample_generator(seed, sample index)`, so every stage rebuilds it;
   expert-parallel peers agree, `BlockDiffusionModel.draws_self_conditioning`). Micro-batches that
   draw none run no first pass and send nothing;
2. megatron-core's own schedule, `forward_only`, runs the first pass over the picked micro-batches
   (`BlockDiffusionModel.first_pass`, run by `forward(first_pass=True)`): stages hand on hidden states as in training;
   the last stage keeps what its output layer would read for the noisy rows (the final-normed
   hidden states, [noisy rows, b, h], its 1/TP share under sequence parallelism) and runs its
   output layer on no rows: the logits ([noisy rows, b, vocab]: 262K for Gemma) are never made
   there nor sent;
3. the last stage sends those hidden states to the first stage over the pipeline group (a
   4-integer header: shape and dtype, then the tensor; one send per picked micro-batch); the first
   stage's training forward computes the logits from them with its own copy of the tied
   embeddings (the output layer's computation: `DiffusionGemmaModel.self_conditioning_logits_of`)
   and goes on exactly as one stage does, so E's gradient through the soft embeddings lands on
   the first stage's E, as on one stage. megatron-core keeps the last stage's copy of E equal to
   the first's (synced at build, gradients all-reduced by `finalize_model_grads`), so the logits,
   the loss and every gradient are those of PP 1.

Why hidden states rather than the soft embeddings (also [rows, b, h]): soft = probs @ E carries a
gradient to E that needs the probabilities (vocabulary-sized) in the backward; computed on the
last stage under the first pass it would be lost (measured: ~10% of the gradient norm on the tiny
model), and shipping its backward would need the probabilities again on the last stage.

Costs at 256K tokens on a 16-rank shard group (every block a canvas: 256K / 16 = 16K noisy rows a
rank), hidden 8192, bf16, micro-batch 1: 16K x 8192 x 2 B = 256 MiB sent last -> first stage per
picked micro-batch (32 MiB with TP 8 + sequence parallelism), held on the first stage from the first
pass until that micro-batch's training forward: (picked micro-batches per iteration) x 256 MiB at
most, M x p x 256 MiB expected at self-conditioning probability p with M micro-batches per
iteration. That grows with M (a run with many micro-batches per iteration should count it; it is
a fraction of one layer's saved activations of the same micro-batch). The extra compute is the
first pass itself (the forward one stage runs too, without its output GEMM on the last stage) and
one pipeline fill and drain for it; the output GEMM over the noisy rows and the fp32 logits move to
the first stage's training forward, where the backward keeps the probabilities as one stage does
([noisy rows, b, vocab / TP] in the weights' dtype per in-flight micro-batch: DiffusionGemma's own
cost of self-conditioning, not the pipeline's).

Interleaved 1F1B (virtual stages) needs the first pass's micro-batch count to be a multiple of the
pipeline size: the picked micro-batches are padded with the next unpicked ones (their first pass
is run and dropped).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


class SelfConditioningRelay:
    """The first pass of self-conditioning for one rank's model chunks (see the module docstring).

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
            b = next(data_iterator)
            return model(b["tokens"], b["loss_mask"], b["sample_index"], None, b.get("document_ids"),
                         first_pass=True), None  # the last stage: the schedule collects the output

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

    if mpu.get_pipeline_model_parallel_world_size() == 1 or not getattr(chunks[0].bdlm.objective,
                                                                         "self_conditioning_prob", 0.0):
        return None
    return SelfConditioningRelay(chunks, ddps)
