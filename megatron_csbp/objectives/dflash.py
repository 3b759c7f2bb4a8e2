"""`--objective dflash`: training a DFlash speculative drafter on captured verifier features.

Anchors drawn per sequence (`uniform` or `locality`) from (seed, sample index), a draft block per
anchor, losses `ce` or `dpace` normalised over the shard group's anchors, the vocabulary loss
streamed through the frozen LM head (`streamed_cross_entropy`, no [tokens, vocab] logits).
Definitions: docs/dflash.md#the-objective-megatron_csbpobjectivesdflashpy.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from dataclasses import dataclass
from math import gcd
from typing import Optional, Tuple

import torch

from megatron_csbp.data.features import document_starts  # noqa: F401 (the objective's API too)
from megatron_csbp.objectives.base import Objective, ObjectiveInputs, sample_generator
from megatron_csbp.objectives.flags import AT_LEAST_1, IN_0_1, check_choice, option
from megatron_csbp.objectives.registry import register_objective, registered_objectives
from megatron_csbp.utils.option import POSITIVE

ANCHOR_SAMPLING = ("uniform", "locality")
DFLASH_LOSSES = ("ce", "dpace")


@dataclass
class DFlashSample:
    """The draft blocks of one sequence (A anchors, B slots)."""

    anchors: torch.Tensor  # [A] int64, sorted
    doc_starts: torch.Tensor  # [A] int64: document start of each anchor
    draft_tokens: torch.Tensor  # [A, B] slot 0 the anchor token, the rest the mask token
    targets: torch.Tensor  # [A, B] target id of each slot, -100 where not supervised
    position_weights: torch.Tensor  # [A, B] float32 exp(-(k-1)/gamma), 0 on slot 0

    @property
    def supervised(self) -> torch.Tensor:
        return self.targets >= 0

    def select(self, index: torch.Tensor) -> "DFlashSample":
        return DFlashSample(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


def valid_anchor_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[L] bool: supervised, next position supervised, both in the same document segment."""
    sup = loss_mask.bool()
    valid = torch.zeros_like(sup)
    starts = document_starts(doc_ids)
    valid[:-1] = sup[:-1] & sup[1:] & (starts[:-1] == starts[1:]) & (doc_ids[:-1] >= 0)
    return valid


def sample_anchors(valid: torch.Tensor, max_anchors: int, sampling: str, stride: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Sorted anchor positions among `valid` (at most max_anchors)."""
    candidates = valid.nonzero().flatten()
    n = candidates.numel()
    count = min(max_anchors, n)
    if count == 0:
        return candidates
    if sampling == "uniform":
        chosen = torch.randperm(n, generator=generator)[:count]
    elif sampling == "locality":
        # the first step from the stride on that is coprime to n: `count` distinct candidates
        step = next(k for k in itertools.count(max(1, stride)) if gcd(k, n) == 1)
        start = int(torch.randint(n, (1,), generator=generator))
        chosen = (start + torch.arange(count) * step) % n
    else:
        check_choice(ANCHOR_SAMPLING_FLAG, sampling)
    return candidates[chosen].sort().values


DFLASH_LOSS = option("--dflash-loss", None, "ce", "ce: exp(-(k-1)/gamma)-weighted CE; dpace: DFlash2's D-PACE weights "
                     "and lambda mixing", choices=DFLASH_LOSSES)
MAX_ANCHORS = option("--dflash-max-anchors", int, 512, "draft blocks per sequence (at most)", rule=AT_LEAST_1)
ANCHOR_SAMPLING_FLAG = option("--dflash-anchor-sampling", None, "uniform", "anchors drawn at random (uniform) or on a "
                              "stride from a random start (locality)", choices=ANCHOR_SAMPLING)
GAMMA = option("--dflash-gamma", float, 7.0, "slot weight exp(-(k-1)/gamma)", rule=POSITIVE)
DPACE_ALPHA = option("--dflash-dpace-alpha", float, 0.5, "dpace: s_k = (1-alpha) p_k + alpha", rule=IN_0_1)
KL_SCALE = option("--dflash-kl-scale", float, 1.0, "dpace: c = kl_scale exp(-kl_decay acceptance) mixes CE and 1 - p")
KL_DECAY = option("--dflash-kl-decay", float, 1.0, "dpace: see --dflash-kl-scale")
VOCAB_CHUNK = option("--dflash-vocab-chunk", int, 8192, "LM-head rows per streamed chunk", rule=AT_LEAST_1)


FEATURES_PATH = option("--features-path", None, None, "dflash: captured verifier features")
VERIFIER = option("--verifier", None, None, "dflash: Hugging Face verifier (embeddings and LM head, frozen)")
TARGET_LAYER_IDS = option("--target-layer-ids", int, None, "dflash: the verifier layers captured (default: the "
                          "features')", nargs="+")
LAYER_TYPE = option("--layer-type", None, "full_attention", "dflash: the drafter's attention",
                    choices=("full_attention", "sliding_attention"))
SLIDING_WINDOW = option("--sliding-window", int, 2048, "dflash: with --layer-type sliding_attention")
EVAL_SEQUENCES = option("--eval-sequences", int, 0, "dflash: the last N captured sequences are held out")

@register_objective("dflash")
class DFlashObjective(Objective):
    summary = ("a DFlash speculative drafter on captured verifier features (--features-path, --verifier; "
               "docs/dflash.md)")
    uses_noisy_stream = True
    fixed_rows = False  # the rows vary with the anchors drawn: pipeline P2P exchanges shapes first
    flags = (DFLASH_LOSS, MAX_ANCHORS, ANCHOR_SAMPLING_FLAG, GAMMA, DPACE_ALPHA, KL_SCALE, KL_DECAY, VOCAB_CHUNK,
             FEATURES_PATH, VERIFIER, TARGET_LAYER_IDS, LAYER_TYPE, SLIDING_WINDOW, EVAL_SEQUENCES)
    mask_token_needed = "--mask-token-id (the verifier's mask token for draft slots)"
    loads_drafter = True
    megatron_lm_refusal = ("trains in python -m megatron_csbp.train (a drafter trained on captured verifier "
                           "features, not a GPT built from Megatron-LM flags)")
    #: the held-out split (`for_evaluation`): the model reads features from the last --eval-sequences
    held_out = False

    #: constructor keyword (and attribute) -> its flag, in the order their rules are checked
    options = dict(max_anchors=MAX_ANCHORS, sampling=ANCHOR_SAMPLING_FLAG, loss=DFLASH_LOSS, gamma=GAMMA,
                   dpace_alpha=DPACE_ALPHA, kl_scale=KL_SCALE, kl_decay=KL_DECAY, vocab_chunk=VOCAB_CHUNK)

    def __init__(self, block_size: int, mask_token_id: int, seed: int = 1234, **options):
        self.check_block_size(block_size)
        super().__init__(block_size, mask_token_id, seed, **options)

    @staticmethod
    def check_block_size(block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"--block-size must be >= 2 for DFlash (slot 0 is the anchor), got {block_size}")

    @classmethod
    def validate(cls, args, facts=None) -> None:
        cls.check_block_size(args.block_size)
        cls.option_values(args)

    @classmethod
    def build_datasets(cls, args):
        """(train, valid): the captured verifier features (`python -m megatron_csbp.dflash
        prepare-features`), the last --eval-sequences held out; training wraps around its share."""
        from megatron_csbp.data.features import FeatureDataset, FeatureSplit

        data = FeatureDataset(FEATURES_PATH.value(args))
        n_eval = EVAL_SEQUENCES.value(args)
        return FeatureSplit(data, 0, len(data) - n_eval), FeatureSplit(data, len(data) - n_eval, n_eval)

    def denominator(self, loss_mask: torch.Tensor, tokens=None, document_ids=None) -> torch.Tensor:
        """Sequences: the loss is the mean over the global batch's sequences of each sequence's
        weighted mean (every sequence is normalised by its own weight sum)."""
        return torch.tensor(float(loss_mask.shape[0]))

    def for_evaluation(self) -> "DFlashObjective":
        held = copy.copy(self)
        held.held_out = True
        return held

    @classmethod
    def prepare_args(cls, args, defaults, check_only: bool, notes: list, drafter=None) -> ObjectiveInputs:
        """What the inputs fix: the captured features --seq-length and the hidden size, the verifier
        the vocabulary (a NullTokenizer of its size), a --load drafter (`drafter`) the architecture
        flags (a flag given with another value than its default and the drafter's is refused by name).
        Facts: `dflash_drafter_load` (that --load drafter, or None) and `dflash_drafter_save` (--save:
        where the drafter's shape and verifier record are written)."""
        from megatron_csbp.data.features import FeatureDataset

        path, verifier = FEATURES_PATH.value(args), VERIFIER.value(args)
        if not path or not verifier:
            raise ValueError("--objective dflash needs --features-path (captured features) and --verifier")
        if check_only and not (os.path.isdir(path) and os.path.isdir(verifier)):
            notes.append(f"--features-path {path} / --verifier {verifier} are not here: their sizes are checked "
                         "at launch")
            return ObjectiveInputs(dict(tokenizer_type="NullTokenizer", vocab_size=args.vocab_size or 1 << 20))
        cls.validate(args)  # the objective's own rules first (they read no file)
        if getattr(args, "tensor_model_parallel_size", 1) != 1:
            raise ValueError("--objective dflash: --tensor-model-parallel-size must be 1 (every drafter layer holds all "
                             "its attention heads, and the verifier's LM head is not vocabulary-parallel)")
        for dest in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
            if getattr(args, dest, None) is not None:
                raise ValueError(f"--objective dflash: --{dest.replace('_', '-')} is refused (the drafter's pipeline "
                                 "stages are not interleaved)")
        defaults = dict(defaults, **{f.dest: f.default for c in registered_objectives().values() for f in c.flags})
        try:
            meta = FeatureDataset(path).meta
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        L, layers = meta["seq_length"], meta["target_layer_ids"]
        if args.seq_length not in (defaults["seq_length"], L):
            raise ValueError(f"--seq-length {args.seq_length} differs from the captured features' {L}")
        if args.target_layer_ids not in (None, layers):
            raise ValueError(f"--target-layer-ids {args.target_layer_ids} differ from the captured features' {layers}")
        fixed = dict(seq_length=L, target_layer_ids=layers, hidden_size=meta["hidden_size"])
        value = lambda dest: fixed.get(dest, getattr(args, dest))  # noqa: E731  (a flag as these inputs fix it)
        for dest in (f.name for f in dataclasses.fields(drafter) if f.metadata.get("flag")) if drafter is not None else ():
            given, loaded = value(dest), getattr(drafter, dest)
            if given is not None and given != defaults[dest] and given != loaded:
                raise ValueError(f"--{dest.replace('_', '-')} {given} differs from the loaded drafter's {dest} {loaded}")
            fixed[dest] = loaded
        if value("ffn_hidden_size") is None:
            fixed["ffn_hidden_size"] = 2 * fixed["hidden_size"]  # the drafter's default (not the GPT's)
        if value("mask_token_id") is None:
            raise ValueError("--mask-token-id is required (or --load a drafter, whose mask_token_id is used)")
        n_eval = EVAL_SEQUENCES.value(args)
        if not 0 <= n_eval < meta["num_sequences"]:
            raise ValueError(f"--eval-sequences {n_eval} must be in [0, {meta['num_sequences']}) (the captured sequences)")
        if n_eval and args.eval_interval is None and args.train_iters:  # evaluate after the last step
            fixed["eval_interval"] = args.train_iters
        if n_eval and args.eval_iters is None:  # batches that cover the held-out sequences
            fixed["eval_iters"] = -(-n_eval // (args.global_batch_size or args.micro_batch_size))
        from transformers import AutoConfig

        fixed.update(vocab_size=int(AutoConfig.from_pretrained(verifier).vocab_size), tokenizer_type="NullTokenizer",
                     tokenizer_model=None)
        return ObjectiveInputs(fixed, dict(dflash_drafter_load=args.load if drafter is not None else None,
                                           dflash_drafter_save=getattr(args, "save", None)))

    def sample(self, tokens: torch.Tensor, loss_mask: torch.Tensor, doc_ids: Optional[torch.Tensor],
               sample_index: int) -> DFlashSample:
        """Draft blocks of one sequence ([L] tensors), the same on every rank."""
        L, B = tokens.numel(), self.block_size
        doc_ids = torch.zeros(L, dtype=torch.long) if doc_ids is None else doc_ids.cpu().long()
        tokens, loss_mask = tokens.cpu().long(), loss_mask.cpu()
        gen = sample_generator(self.seed, int(sample_index))
        anchors = sample_anchors(valid_anchor_mask(loss_mask, doc_ids), self.max_anchors, self.sampling, B, gen)
        starts = document_starts(doc_ids)
        block_pos = anchors[:, None] + torch.arange(B)
        safe = block_pos.clamp_max(L - 1)
        supervised = (block_pos < L) & loss_mask.bool()[safe] & (starts[safe] == starts[anchors][:, None])
        supervised[:, 0] = False
        draft = torch.full((len(anchors), B), self.mask_token_id, dtype=torch.long)
        draft[:, 0] = tokens[anchors]
        targets = torch.where(supervised, tokens[safe], torch.full_like(safe, -100))
        # slot k's weight exp(-(k-1)/gamma); slot 0 (the anchor) is never supervised
        weights = torch.exp(-(torch.arange(B, dtype=torch.float32) - 1).clamp_min(0) / self.gamma) * supervised
        return DFlashSample(anchors, starts[anchors], draft, targets, weights.float())

    def token_loss(self, ce: torch.Tensor, weights: torch.Tensor, supervised: torch.Tensor, reduce=None
                   ) -> Tuple[torch.Tensor, torch.Tensor, dict]:
        """(numerator, denominator, metrics) of the loss over this rank's slots.

        `ce` [A, B] (differentiable, 0 where not supervised), `weights` the position weights,
        `supervised` [A, B]; `reduce(t)` sums a detached tensor over the shard group (None: one
        rank holds every anchor). Slots are whole blocks, so D-PACE's per-block products are local."""
        reduce = reduce or (lambda t: t)
        sup = supervised.float()
        p = torch.exp(-ce.detach()) * sup
        if self.loss == "ce":
            w = weights * sup
            stats = reduce(torch.stack([w.sum(), p.sum(), sup.sum()]).double())
            num = (ce * w).sum()
        else:
            a = self.dpace_alpha
            s = torch.where(supervised, (1 - a) * p + a, torch.ones_like(p))
            prefix = torch.cumprod(s.double(), dim=-1)
            suffix = torch.flip(torch.cumsum(torch.flip(prefix * sup, dims=(-1,)), dim=-1), dims=(-1,))
            w = (suffix * sup).float()
            stats = reduce(torch.stack([w.double().sum(), p.double().sum(), sup.double().sum()]))
            acceptance = stats[1] / stats[2].clamp_min(1.0)
            c = float(self.kl_scale * torch.exp(-self.kl_decay * acceptance))
            tv = 1.0 - torch.exp(-ce)
            num = (c * ce * w).sum() + ((1.0 - c) * tv * w).sum()
        metrics = {"weight_sum": float(stats[0]), "acceptance": float(stats[1] / stats[2].clamp_min(1.0)),
                   "supervised": float(stats[2])}
        return num, stats[0].to(torch.float32), metrics


class _StreamedCE(torch.autograd.Function):
    """CE of hidden @ head.T against targets, the vocabulary in chunks; head frozen."""

    @staticmethod
    def forward(ctx, hidden, head, targets, chunk):
        n, V = hidden.shape[0], head.shape[0]
        h = hidden.float() if hidden.dtype != torch.float64 else hidden
        lse = torch.full((n,), float("-inf"), dtype=h.dtype, device=h.device)
        target_logit = torch.zeros(n, dtype=h.dtype, device=h.device)
        for start in range(0, V, chunk):
            w = head[start : start + chunk].to(h.dtype)
            logits = h @ w.T
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
            idx = ((targets >= start) & (targets < start + w.shape[0])).nonzero().flatten()  # targets in the chunk
            target_logit[idx] = logits[idx, targets[idx] - start]
        ctx.save_for_backward(hidden, head, targets, lse)
        ctx.chunk = chunk
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_ce):
        hidden, head, targets, lse = ctx.saved_tensors
        h = hidden.float() if hidden.dtype != torch.float64 else hidden
        g = grad_ce.to(h.dtype)
        grad = torch.zeros_like(h)
        for start in range(0, head.shape[0], ctx.chunk):
            w = head[start : start + ctx.chunk].to(h.dtype)
            probs = torch.exp(h @ w.T - lse[:, None])
            idx = ((targets >= start) & (targets < start + w.shape[0])).nonzero().flatten()
            probs[idx, targets[idx] - start] -= 1.0
            grad += (probs * g[:, None]) @ w
        return grad.to(hidden.dtype), None, None, None


def streamed_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
                           chunk: int = VOCAB_CHUNK.default) -> torch.Tensor:
    """[n] cross entropy of the logits hidden [n, h] @ head[V, h].T at `targets` [n] (valid ids),
    computed chunk by chunk over the vocabulary (peak extra memory n x chunk). `head` is the frozen
    LM head: it gets no gradient."""
    if head.requires_grad:
        raise ValueError("streamed_cross_entropy takes the frozen LM head (head.requires_grad must be False)")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= head.shape[0]):
        raise ValueError(f"targets outside the vocabulary [0, {head.shape[0]})")
    return _StreamedCE.apply(hidden, head, targets.long(), int(chunk))


# ---- training-time acceptance ----------------------------------------------------------------------

def acceptance_counts(correct: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """float64 [2, B - 1] of draft blocks (rows of `correct` / `supervised`, bool [A, B]; slot 0
    is the anchor): row 0, for offset k = 1..B-1, the blocks whose slots 1..k are all supervised
    and right; row 1, the blocks whose slots 1..k-1 are right and whose slot k is supervised.
    Sums over blocks, ranks and sequences, so they are reduced by addition."""
    ok = (correct & supervised)[:, 1:].long()
    prefix = ok.cumprod(dim=1)  # slots 1..k all right
    before = torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], dim=1)  # slots 1..k-1 right
    return torch.stack([prefix.sum(0), (before * supervised[:, 1:].long()).sum(0)]).double()


def acceptance_from_counts(counts: torch.Tensor) -> Tuple[list, float]:
    """(per-offset accuracy a_k = P(slot k right | slots 1..k-1 right), the expected acceptance
    length tau = 1 + sum_k prod_{j <= k} a_j) from summed `acceptance_counts`.

    tau is what one verifier step yields under greedy verification if every step drafted from an
    anchor drawn like the evaluated ones and the verifier's token equalled the data's: the accepted
    prefix length (slot k is accepted when slots 1..k are right) plus the verifier's own token.
    An offset no block reaches has a_k = 0."""
    num, den = counts[0], counts[1]
    acc = torch.where(den > 0, num / den.clamp_min(1), torch.zeros_like(num))
    return acc.tolist(), float(1.0 + torch.cumprod(acc, 0).sum())


def streamed_top2(hidden: torch.Tensor, head: torch.Tensor, chunk: int = VOCAB_CHUNK.default):
    """(argmax [n], margin [n], scale [n]) of the logits hidden [n, h] @ head[V, h].T, chunk by chunk:
    the margin is the top logit minus the runner-up (how far a numeric perturbation of the logits
    must go to flip the argmax: more than margin / 2 on some logit), the scale max_v |logit_v|.
    Peak extra memory n x chunk."""
    n = hidden.shape[0]
    top = torch.full((n, 2), float("-inf"), dtype=torch.float32, device=hidden.device)
    ids = torch.zeros((n, 2), dtype=torch.long, device=hidden.device)
    scale = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for lo in range(0, head.shape[0], chunk):
        logits = (hidden @ head[lo:lo + chunk].T).float()
        scale = torch.maximum(scale, logits.abs().max(dim=1).values)
        v, i = logits.topk(min(2, logits.shape[1]), dim=1)
        v, i = torch.cat([top, v], dim=1), torch.cat([ids, i + lo], dim=1)
        # stable sort by value (descending): among equal logits the earlier (lower) id stays first, as argmax
        order = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :2]
        top, ids = v.gather(1, order), i.gather(1, order)
    return ids[:, 0], top[:, 0] - top[:, 1], scale


def serving_replay(runs, prompt_length: int, new_tokens: int, block_size: int) -> dict:
    """Greedy DFlash decoding as transformers 5.24 runs it (`_assisted_decoding` with
    `DFlashTokenCandidateGenerator`), replayed from the drafter's right runs on the final output.

    The output y (prompt P tokens + N new) is the verifier's greedy continuation (verification is
    exact); `runs[i]` is the number of leading draft slots (1, 2, ...) of the block anchored at
    position P + i that equal y (i = 0 .. N - 2; slots past y are not compared). Serving: the
    prefill step yields y[P]; then, with `length` tokens so far and r = P + N - length left: if
    r == 1 the verifier steps alone (the generator drafts nothing when max_length - length - 1 <= 0),
    else the drafter drafts the block anchored at length - 1, the verifier accepts the right run
    and adds its own token, cut to r: min(run + 1, r) tokens. A block is cut (censored) when
    run >= r (then run == r, r <= B - 1: its later slots lie past y and were never compared).

    Returns the visited anchors (indices i), the verifier steps, drafting steps, the cut blocks'
    r, and per visited block its tokens and the tokens left before it (r). O(N) ints per prompt."""
    end = prompt_length + new_tokens
    length, steps, visited, cut, tokens, left = prompt_length + 1, 1, [], [], [], []
    while length < end:
        steps += 1
        r = end - length
        if r == 1:
            length += 1
            continue
        i = length - 1 - prompt_length
        run = int(runs[i])
        if run > min(block_size - 1, r):
            raise ValueError(f"run {run} at anchor {i} exceeds the block's compared slots")
        visited.append(i)
        left.append(r)
        if run >= r:
            cut.append(r)
        tokens.append(min(run + 1, r))
        length += tokens[-1]
    return {"visited": visited, "verifier_steps": steps, "drafting_steps": len(visited), "cut": cut,
            "tokens": tokens, "left": left}
