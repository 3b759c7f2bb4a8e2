"""DiffusionGemma decoding with transformers' own sampler, on the project's Megatron model.

`DiffusionGemmaSampler.generate` is the loop of transformers 5.24's
`DiffusionGemmaForBlockDiffusion.generate`, its classes and config-only steps (stopping criteria,
logits processor, `_finalize_canvas`) unchanged, with the model forward replaced
by the Megatron `DiffusionGemmaModel` over the clean-prefix KV cache: after `torch.manual_seed(S)`
it gives transformers' tokens. The loop, settings and the test: docs/diffusiongemma.md#decoding.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from megatron_csbp.generation import kv_cache
from megatron_csbp.layout.masks import BlockGeometry, RowMeta

def _hf():
    try:
        from transformers.models.diffusion_gemma import generation_diffusion_gemma as g
    except ImportError as exc:  # pragma: no cover - transformers is in the CPU requirements
        raise ImportError("DiffusionGemma decoding uses transformers' sampler: pip install 'transformers>=5.24'") from exc
    return g


def generation_config(assets_dir: Optional[str] = None, **overrides):
    """transformers' resolution: the checkpoint's `generation_config.json` (in `assets_dir`), then
    the global defaults for what it leaves unset, then `overrides` (None = not given)."""
    g = _hf()
    saved = assets_dir and os.path.isfile(os.path.join(assets_dir, "generation_config.json"))
    cfg = g.DiffusionGemmaGenerationConfig.from_pretrained(assets_dir) if saved else g.DiffusionGemmaGenerationConfig()
    cfg.update(**cfg._get_default_generation_params(), defaults_only=True)
    given = {k: v for k, v in overrides.items() if v is not None}
    if "entropy_bound" in given:
        given["sampler_config"] = g.EntropyBoundSamplerConfig(entropy_bound=float(given.pop("entropy_bound")))
    unused = cfg.update(**given)
    if unused:
        raise ValueError(f"unknown DiffusionGemma generation settings {sorted(unused)}")
    cfg.validate()
    return cfg


class DiffusionGemmaSampler(kv_cache.CachedDecoder):
    """Decodes with a Megatron `DiffusionGemmaModel` (TP = CP = EP = 1, eval mode)."""

    def __init__(self, gpt, canvas_length: int):
        from megatron_csbp.layout.layout import SequenceLayout
        from megatron_csbp.model.bdlm import BlockDiffusionModel
        from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective

        self.gpt, self.C, self.V = gpt, int(canvas_length), int(gpt.vocab_size)
        if getattr(gpt.config, "final_logit_softcapping", None):
            gpt.softcap_dtype = torch.float32  # transformers: logits.to(float32), then the cap
        # Logits only: the objective's noise and loss are never used here.
        layout = SequenceLayout(BlockGeometry(self.C, self.C, "token_causal"))
        super().__init__(BlockDiffusionModel(gpt, DiffusionGemmaSFTObjective(self.C, self.V), layout))
        self._shift = 0

    # -- model calls ---------------------------------------------------------------------------
    def _rows(self, ids: torch.Tensor, positions: torch.Tensor, clean: bool, sc_logits=None) -> Optional[torch.Tensor]:
        """Clean rows into the cache (no logits: an empty selection skips the output layer's rows),
        or the noisy rows' logits over it."""
        empty = torch.zeros(0, dtype=torch.long)
        if clean:
            self._run(ids, RowMeta.of(empty, positions), "extend", self._shift, logit_rows=empty)
            return None
        return self._run(ids, RowMeta.of(positions, empty), "decode", self._shift, self_conditioning_logits=sc_logits)

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, config, max_new_tokens: Optional[int] = None) -> torch.Tensor:
        """[b, P] prompt ids -> [b, P + canvases x C] (transformers' `sequences`); draws from torch's
        global generator. `config`: a resolved `DiffusionGemmaGenerationConfig` (`generation_config`)."""
        g = _hf()
        input_ids = input_ids.long()
        b, P = input_ids.shape
        if P == 0:
            raise ValueError("--prompt-ids: the prompt must hold at least one token (DiffusionGemma decodes after a "
                             "clean prefix)")
        C, N = self.C, config.max_denoising_steps
        # transformers' _prepare_generated_length: max_new_tokens wins unless it is the default
        # and max_length is set
        new = max_new_tokens if max_new_tokens is not None else config.max_new_tokens
        if max_new_tokens is None and config.max_length and new == 256:
            new = config.max_length - P
        canvases = math.ceil(new / C)
        self._shift = (-P) % C  # canvases on block boundaries of the mask's positions
        self.state.reset(BlockGeometry(self._shift + P + canvases * C, C, "token_causal"))
        self.forward_calls = 0

        sampler = g.EntropyBoundSampler(config.sampler_config, C, self.V, N)
        # transformers' own preparation steps (they read the config only) and, below, its _finalize_canvas
        hf = g.DiffusionGemmaGenerationMixin()
        schedule = hf._prepare_logits_processor(config)  # the linear temperature schedule when t_min/t_max are set
        stopping = hf._prepare_ar_stopping_criteria(config)  # max_length, EOS
        adaptive = hf._prepare_diffusion_stopping_criteria(config)  # stable-and-confident, or None
        eos = torch.tensor(config.eos_token_id) if config.eos_token_id is not None else None
        emb_dtype = self.gpt.embedding.word_embeddings.weight.dtype

        finished = torch.zeros(b, dtype=torch.bool)
        self.denoising_steps = torch.zeros(b, dtype=torch.int)
        cached = 0
        for _ in range(canvases):
            if input_ids.shape[1] > cached:  # 1.a: the new clean tokens into the cache
                self._rows(input_ids[:, cached:], torch.arange(cached, input_ids.shape[1]), clean=True)
            cached = s = input_ids.shape[1]
            canvas = sampler.initialize_canvas(b, input_ids.device)  # 1.b
            argmax, sc = canvas, None
            done = torch.zeros(b, dtype=torch.bool)
            if adaptive is not None:
                adaptive.reset()
            for cur in reversed(range(1, N + 1)):  # 1.c
                self.denoising_steps += ~(done | finished)
                step = torch.tensor(cur, dtype=torch.int32)
                # fp32 logits [b, C, V] (Hugging Face casts the output layer's logits to fp32, then soft-caps)
                logits = self._rows(canvas, torch.arange(s, s + C), clean=False, sc_logits=sc).float()
                logits = schedule(input_ids, logits, cur_step=step)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                drawn = torch.multinomial(probs.view(-1, self.V), num_samples=1).view(b, C)
                new_argmax = torch.argmax(logits, dim=-1)
                accepted = sampler.accept_canvas(canvas, drawn, logits, step)
                new_canvas = sampler.renoise_canvas(accepted, step)
                if adaptive is not None:
                    if done.any():
                        new_argmax = torch.where(done[:, None], argmax, new_argmax)
                        new_canvas = torch.where(done[:, None], canvas, new_canvas)
                        logits = torch.where(done[:, None, None], sc, logits)
                    done |= adaptive(new_argmax, logits)
                canvas, argmax, sc = new_canvas, new_argmax, logits.to(emb_dtype)
                if bool(done.all()):
                    break
            input_ids = torch.cat([input_ids, argmax], dim=-1)  # 1.d
            input_ids, finished = hf._finalize_canvas(input_ids, finished, config, stopping, C, eos)  # 1.e
            if bool(finished.all()):
                break
        self.state.mode = "off"
        return input_ids


def assets_dir(info) -> Optional[str]:
    """The `hf_assets/` folder saved with a converted (or trained) checkpoint, if any (`info`: the
    checkpoint `checkpoint.files.read_checkpoint_model` already read)."""
    from megatron_csbp.checkpoint.files import ASSETS_DIR

    for d in (info.root, info.path):
        p = os.path.join(d, ASSETS_DIR)
        if os.path.isdir(p):
            return p
    return None


def canvas_length(shape) -> int:
    """The checkpoint's Hugging Face `canvas_length` (transformers' default when absent)."""
    value = shape.hf_config.get("canvas_length")
    if value is None:
        from transformers import DiffusionGemmaConfig

        value = DiffusionGemmaConfig().canvas_length
    return int(value)
