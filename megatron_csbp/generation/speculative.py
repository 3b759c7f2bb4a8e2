"""A DFlash drafter's acceptance: the training-time estimate on held-out captured sequences
(`training_estimate`), transformers' DFlash decoding against the verifier alone (`evaluate`,
`evaluate_cli`: `python -m megatron_csbp.dflash evaluate`), and the training-time estimator at
serving's anchors with the bound docs/dflash.md derives (`serving_estimate`)."""
from __future__ import annotations

import itertools
import json
from typing import Dict, Sequence

import numpy as np
import torch

from megatron_csbp.attention.dflash import DFlashLayout
from megatron_csbp.checkpoint.drafter import drafter_from_hf
from megatron_csbp.checkpoint.model import single_process_megatron
from megatron_csbp.data.features import FeatureDataset, FeatureSplit, capture_sequence, load_verifier
from megatron_csbp.model.dflash import DFlashTrainingModel, TrainableDrafter
from megatron_csbp.objectives.dflash import DFlashObjective, acceptance_counts, acceptance_from_counts, serving_replay


@torch.no_grad()
def evaluate(verifier, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Dict:
    """Greedy decoding of each prompt by the verifier alone and with the drafter through
    transformers' DFlash candidate generator. Returns identical (all outputs equal), the mean
    tokens per verifier step (new tokens / verifier forwards, prefill included), the drafting steps
    (drafter forwards) and the measured acceptance length: tokens per drafting step,
    (new tokens - verifier steps + drafting steps) / drafting steps (the prefill and the final
    verifier-only step, when one token is left, each yield one token and draft nothing), and
    `outputs`, the greedy outputs (prompt + new tokens, one list per prompt)."""
    from transformers import GenerationConfig

    calls = {"n": 0, "draft": 0}
    hook = verifier.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    draft_hook = drafter.register_forward_pre_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))
    identical, tokens, steps, plain_steps, drafts, outputs = True, 0, 0, 0, 0, []
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=None, eos_token_id=None)
    spec, plain = GenerationConfig(speculation_type="dflash", **greedy), GenerationConfig(**greedy)
    try:
        for prompt in prompts:
            ids = torch.as_tensor(prompt, dtype=torch.long)[None]
            calls["n"] = 0
            ref = verifier.generate(ids, generation_config=plain)
            plain_steps += calls["n"]
            calls["n"], calls["draft"] = 0, 0
            out = verifier.generate(ids, generation_config=spec, assistant_model=drafter)
            steps += calls["n"]
            drafts += calls["draft"]
            identical &= bool(torch.equal(out, ref))
            tokens += out.shape[1] - ids.shape[1]
            outputs.append(ref[0].tolist())
    finally:
        hook.remove()
        draft_hook.remove()
    return {"identical": identical, "prompts": len(prompts), "new_tokens": tokens, "verifier_steps": steps,
            "verifier_steps_alone": plain_steps, "tokens_per_step": tokens / max(steps, 1), "drafting_steps": drafts,
            "measured_acceptance_length": (tokens - steps + drafts) / max(drafts, 1), "outputs": outputs}


def evaluate_cli(a) -> Dict:
    from transformers import MuseGlimmerAssistantModel

    verifier = load_verifier(a.verifier)
    drafter = MuseGlimmerAssistantModel.from_pretrained(a.drafter, dtype=torch.float32).eval()
    if a.prompts_data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        docs = IndexedDataset(a.prompts_data_path)
        last_first = (np.asarray(docs[i], dtype=np.int64) for i in reversed(range(len(docs))))
        full = (ids for ids in last_first if len(ids) > a.prompt_length)  # the last documents with a full prompt
        prompts = [ids[: a.prompt_length].tolist() for ids in itertools.islice(full, a.eval_sequences)]
    else:
        data = FeatureDataset(a.features_path)
        prompts = [data[i]["tokens"][: a.prompt_length].astype(np.int64).tolist()
                   for i in range(len(data) - a.eval_sequences, len(data))]
    result = evaluate(verifier, drafter, prompts, a.max_new_tokens)
    # the training-time estimator on the same documents: the verifier's greedy outputs, serving's anchors
    result.update(serving_estimate(verifier, drafter, prompts, result.pop("outputs"), a.logit_tolerance))
    if a.features_path:  # the estimate as training logs it, on the held-out captured sequences
        result.update(training_estimate(a, verifier, drafter))
    print(json.dumps(result, indent=1))
    return result


@torch.no_grad()
def training_estimate(a, verifier, hf_drafter) -> Dict:
    """The training-time per-offset accuracy and expected acceptance length of the Hugging Face
    drafter on the held-out captured sequences (the last --eval-sequences): imported into the
    Megatron drafter and evaluated as the trainer evaluates (`TrainableDrafter`, one rank), the
    objective's anchors, the data's tokens as targets (docs/dflash.md: why it differs from the
    measured length)."""
    data, n = FeatureDataset(a.features_path), a.eval_sequences
    with single_process_megatron():
        drafter, shape = drafter_from_hf(hf_drafter)
        held_out = DFlashObjective(shape.block_size, shape.mask_token_id).for_evaluation()
        model = TrainableDrafter(drafter.config, DFlashTrainingModel(
            drafter, verifier.get_input_embeddings().weight.detach().float(),
            verifier.get_output_embeddings().weight.detach().float(), held_out,
            DFlashLayout(data.meta["seq_length"], shape.block_size)), (None, FeatureSplit(data, len(data) - n, n)))
        metrics = {}
        for i in range(n):
            item = model.splits[1][i]
            _, metrics = model.evaluation_loss(item["tokens"][None], item["loss_mask"][None], [i], 1.0,
                                               item["document_ids"][None], objective=held_out, metrics=metrics)
        metrics = model.eval_record(metrics, log=None)
    return {"training_acceptance_per_offset": metrics["eval_acceptance_per_offset"],
            "training_expected_acceptance_length": metrics["eval_expected_acceptance_length"]}


@torch.no_grad()
def serving_estimate(verifier, hf_drafter, prompts, outputs, logit_tolerance: float = 1e-3) -> Dict:
    """The training-time estimator (`objectives.dflash.acceptance_counts` / `acceptance_from_counts`,
    the training forward of the Hugging Face drafter imported into the Megatron drafter, one rank)
    on the documents serving decodes: each prompt's verifier greedy output y as the sequence (its
    features captured as `prepare-features` does), targets y (the verifier's own tokens), a block
    at every position of the continuation, and the estimate summed over the blocks serving visits
    (`objectives.dflash.serving_replay` of the drafter's right runs). docs/dflash.md derives the
    bound it returns on the measured acceptance length (tokens per drafting step):
    [tau - (C + sum_c (B - 1 - r_c)) / D, tau - C / D] (D drafting blocks, C of them cut at r_c
    tokens by --max-new-tokens), valid when no deciding slot has a top-2 logit margin within
    2 eps, eps = logit_tolerance x max(1, max |logit|) (the numeric gap between this forward and
    serving's); otherwise a relaxation over the tokens left after each prompt's first uncertain
    block (docs/dflash.md)."""
    embedding = verifier.get_input_embeddings().weight.detach().float()
    head = verifier.get_output_embeddings().weight.detach().float()
    counts, steps, drafting, cut, uncertain, min_margin = None, 0, 0, [], 0, float("inf")
    sure_tokens, sure_steps, left = 0, 0, []
    with single_process_megatron():
        drafter, shape = drafter_from_hf(hf_drafter)
        B = shape.block_size
        for prompt, y in zip(prompts, outputs):
            P, L = len(prompt), len(y)
            N = L - P
            if N < 2:  # the prefill step alone: nothing drafted
                steps += N
                continue
            feats = capture_sequence(verifier, np.asarray(y), np.zeros(L, dtype=np.int64), shape.target_layer_ids)
            # every position of the continuation is an anchor (max_anchors >= L: all valid ones drawn)
            objective = DFlashObjective(B, shape.mask_token_id, max_anchors=L)
            model = DFlashTrainingModel(drafter, embedding, head, objective, DFlashLayout(L, B))
            loss_mask = (torch.arange(L) >= P).long()
            blocks = model(torch.from_numpy(feats), torch.as_tensor(y, dtype=torch.long), loss_mask,
                           with_acceptance=True).metrics["acceptance_blocks"]
            if blocks["anchors"].tolist() != list(range(P, L - 1)):
                raise RuntimeError(f"expected a block at every anchor {P}..{L - 2}, got {blocks['anchors'].tolist()}")
            runs = blocks["right"][:, 1:].long().cumprod(dim=1).sum(dim=1)  # each block's right run
            replay = serving_replay(runs.tolist(), P, N, B)
            v = torch.tensor(replay["visited"], dtype=torch.long)
            if len(v):
                c = acceptance_counts(blocks["right"][v], blocks["supervised"][v])
                counts = c if counts is None else counts + c
                # deciding slots: the right run and the first wrong supervised slot after it
                deciding = (torch.arange(1, B)[None, :] <= runs[v, None] + 1) & blocks["supervised"][v][:, 1:]
                eps = logit_tolerance * blocks["scale"][v][:, 1:].clamp_min(1.0)
                margin = blocks["margin"][v][:, 1:]
                close = deciding & (margin <= 2 * eps)
                risky = close.any(dim=1)
                uncertain += int(close.sum())
                if deciding.any():
                    min_margin = min(min_margin, float((margin / eps)[deciding].min()))
                # the blocks up to the first one with an uncertain slot are serving's for sure; from it on,
                # R = the tokens left go in d drafting steps (T_u in {R - 1, R} tokens, ceil((R - 1) / B) <= d <= R)
                j = int(risky.nonzero()[0]) if risky.any() else len(v)
                sure_tokens += sum(replay["tokens"][:j])
                sure_steps += j
                if j < len(v):
                    left.append(replay["left"][j])
            steps += replay["verifier_steps"]
            drafting += replay["drafting_steps"]
            cut += replay["cut"]
    if counts is None:
        return {"serving_estimate_drafting_blocks": 0}
    acc, tau = acceptance_from_counts(counts)
    D, C = drafting, len(cut)
    censored = [tau - (C + sum(B - 1 - r for r in cut)) / D, tau - C / D]  # no argmax flips
    if uncertain:  # a relaxation over the tokens left after each prompt's first uncertain block
        bound = [max(1.0, (sure_tokens + sum(r - 1 for r in left)) / (sure_steps + sum(left))),
                 min(float(B), (sure_tokens + sum(left)) / (sure_steps + sum(-(-(r - 1) // B) for r in left)))]
    else:
        bound = censored
    return {"serving_acceptance_per_offset": acc, "serving_expected_acceptance_length": tau,
            "serving_estimate_drafting_blocks": D, "serving_estimate_cut_blocks": C,
            "serving_estimate_verifier_steps": steps, "measured_acceptance_length_bound": bound,
            "measured_acceptance_length_bound_without_flips": censored,
            "uncertain_slots": uncertain, "min_margin_over_eps": min_margin, "logit_tolerance": logit_tolerance}
