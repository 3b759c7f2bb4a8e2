"""Megatron LoRA adapters <-> a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`).

peft writes and reads the folder (`get_peft_model` on the Hugging Face model built on the meta
device, `save_pretrained`, `load_peft_weights` / `set_peft_model_state_dict`); this module only
places the tensors, given each adapted module's `Target` (which conversion/lora.py makes from the
converter's weight mapping). Rules and refusals: docs/lora.md#export-to-peft-and-import.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megatron_csbp.lora import LoRAConfig

A, B = ".lora_A", ".lora_B"
Adapters = Dict[str, torch.Tensor]  # {megatron module name + ".lora_A" / ".lora_B": full tensor}


class Target(NamedTuple):
    """Megatron module `megatron` (adapters `megatron.lora_A` / `.lora_B`) whose base weight is the
    Hugging Face parameters `hf` joined by `join` (rows); `split` is its inverse. Each entry of `hf`
    lists the live parameter names that hold that part (a tied copy too); `expert` is the index into
    a 3D expert parameter [experts, out, in], None for a Linear's weight."""
    megatron: str
    hf: Tuple[Tuple[str, ...], ...]
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]]
    join: Callable[..., torch.Tensor]
    expert: Optional[int] = None


def adapted_modules(adapters: Adapters) -> List[str]:
    """The Megatron module names that carry an adapter (each must have both matrices)."""
    mods = sorted({k[: -len(A)] for k in adapters if k.endswith(A)} | {k[: -len(B)] for k in adapters if k.endswith(B)})
    bad = [k for k in adapters if not k.endswith((A, B))]
    bad += [m for m in mods if m + A not in adapters or m + B not in adapters]
    if bad:
        raise ValueError(f"LoRA adapters must come as <module>.lora_A / <module>.lora_B pairs: {bad[:4]}")
    return mods


def merged_state(state: Dict[str, torch.Tensor], config: LoRAConfig, adapters: Adapters) -> Dict[str, torch.Tensor]:
    """The base state with every adapter folded in: W + (alpha / rank) * B @ A (in float64, cast back)."""
    out = dict(state)
    for m in adapted_modules(adapters):
        w = state[m + ".weight"]
        delta = adapters[m + B].double() @ adapters[m + A].double() * config.scaling
        out[m + ".weight"] = (w.double() + delta).to(w.dtype)
    return out


def _peft_layers(peft_model) -> Dict[str, object]:
    """{live Hugging Face parameter name: peft LoRA layer} of a peft model."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    out = {}
    for name, mod in peft_model.base_model.model.named_modules():
        if isinstance(mod, LoraLayer):
            param = mod.parameter_name if isinstance(mod, ParamWrapper) else "weight"
            out[f"{name.replace('.base_layer', '')}.{param}"] = mod
    return out


def _lora_config(config: LoRAConfig, targets: List[Target], base: Optional[str]):
    import peft

    linear = sorted({n[: -len(".weight")] for t in targets if t.expert is None for part in t.hf for n in part})
    params = sorted({n for t in targets if t.expert is not None for part in t.hf for n in part})
    if params and config.dropout:
        raise ValueError(f"--lora-dropout {config.dropout}: peft's expert adapters (target_parameters on the fused 3D "
                         "expert weights) take no dropout, so this run's expert adapters have no PEFT form; export with "
                         "--merge-lora, or train with --lora-dropout 0")
    return peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, bias="none",
                           target_modules=linear or None, target_parameters=params or None,
                           base_model_name_or_path=base)


def _assign(layer, a: torch.Tensor, b: torch.Tensor) -> None:
    for lin, w in ((layer.lora_A["default"], a), (layer.lora_B["default"], b)):
        if tuple(lin.weight.shape) != tuple(w.shape):
            raise ValueError(f"adapter shape {tuple(w.shape)} does not fit peft's {tuple(lin.weight.shape)}")
        lin.weight = torch.nn.Parameter(w.detach().clone().contiguous(), requires_grad=False)


def to_peft_model(hf_model, targets: List[Target], config: LoRAConfig, adapters: Adapters, base: Optional[str] = None):
    """A peft model over `hf_model` (on the meta device) holding `adapters` as PEFT's per-projection
    adapters: A shared, B split like the base weight's rows; an expert stack's A and B laid out as
    peft's `ParamWrapper` reads them (A [experts * r, in], B [out, r * experts], column k * experts + e)."""
    import peft

    by_module = {t.megatron: t for t in targets}
    mods = adapted_modules(adapters)
    unknown = [m for m in mods if m not in by_module]
    if unknown:
        raise ValueError(f"adapters on modules a PEFT adapter of this model has no place for: {unknown[:4]}")
    chosen = [by_module[m] for m in mods]
    model = peft.get_peft_model(hf_model, _lora_config(config, chosen, base))
    layers = _peft_layers(model)
    experts: Dict[str, Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = {}
    for t in chosen:
        a, b = adapters[t.megatron + A], adapters[t.megatron + B]
        for part, b_part in zip(t.hf, t.split(b)):
            for name in part:
                if t.expert is None:
                    _assign(layers[name], a, b_part)
                else:
                    experts.setdefault(name, {})[t.expert] = (a, b_part)
    for name, per_expert in experts.items():
        n = layers[name].num_experts
        if sorted(per_expert) != list(range(n)):
            raise ValueError(f"{name}: adapters on experts {sorted(per_expert)} of {n}; PEFT's adapter of an expert "
                             "stack holds every expert")
        b = torch.stack([per_expert[e][1] for e in range(n)], dim=-1)
        _assign(layers[name], torch.cat([per_expert[e][0] for e in range(n)]), b.reshape(b.shape[0], -1))
    return model


def save_peft_adapter(hf_model, targets: List[Target], config: LoRAConfig, adapters: Adapters, output: str,
                      base: Optional[str] = None) -> None:
    """Write `adapters` as a PEFT adapter folder (peft's `save_pretrained`)."""
    to_peft_model(hf_model, targets, config, adapters, base).save_pretrained(output)


def _read(layer, expert: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    if expert is None:
        return a, b
    n = layer.num_experts
    return a.reshape(n, -1, a.shape[-1])[expert], b.reshape(b.shape[0], -1, n)[:, :, expert]


def _refuse_unmappable(cfg, directory: str, flag: str) -> None:
    import peft

    for bad, what in ((cfg.peft_type != peft.PeftType.LORA, f"a {cfg.peft_type} adapter"),
                      (getattr(cfg, "use_dora", False), "DoRA (use_dora)"),
                      (getattr(cfg, "lora_bias", False) or getattr(cfg, "bias", "none") != "none", "adapter biases"),
                      (bool(getattr(cfg, "modules_to_save", None)), "modules_to_save (full weights beside the adapters)"),
                      (bool(getattr(cfg, "rank_pattern", None)) or bool(getattr(cfg, "alpha_pattern", None)),
                       "per-module ranks or alphas (rank_pattern / alpha_pattern)")):
        if bad:
            raise ValueError(f"{flag} {directory}: {what} has no Megatron LoRA counterpart (one rank and alpha, no "
                             "bias, adapters on linear_qkv / linear_proj / linear_fc1 / linear_fc2 only)")


def target_modules(adapted: Sequence[str], targets: List[Target], flag: str) -> Tuple[str, ...]:
    """--lora-target-modules that adapt exactly the modules `adapted`: a module name where every module
    of that name is adapted, `experts.<name>` where exactly the experts' are."""
    names = []
    for leaf in sorted({m.rsplit(".", 1)[1] for m in adapted}):
        have = {m for m in adapted if m.endswith("." + leaf)}
        every = {t.megatron for t in targets if t.megatron.endswith("." + leaf)}
        if have == every:
            names.append(leaf)
        elif have == {t.megatron for t in targets if t.megatron.endswith("." + leaf) and t.expert is not None}:
            names.append("experts." + leaf)
        else:
            raise ValueError(f"{flag}: the adapter covers {len(have)} of the {len(every)} {leaf} modules "
                             f"(missing e.g. {sorted(every - have)[:2]}); --lora-target-modules adapts all of a kind")
    return tuple(names)


def load_peft_adapter(hf_model, targets: List[Target], directory: str, flag: str = "--peft-adapter"
                      ) -> Tuple[LoRAConfig, Adapters]:
    """A PEFT adapter folder over `hf_model` (meta device) -> (LoRAConfig, {megatron adapter name:
    tensor}); refused in one line naming `flag` where Megatron's adapters cannot hold it exactly."""
    import peft
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    cfg = peft.PeftConfig.from_pretrained(directory)
    _refuse_unmappable(cfg, directory, flag)
    model = peft.get_peft_model(hf_model, cfg)
    weights = load_peft_weights(directory, device="cpu")
    layers = _peft_layers(model)
    for layer in layers.values():  # the adapters leave the meta device, in the file's dtype
        for d in (layer.lora_A, layer.lora_B):
            d.to_empty(device="cpu").to(next(iter(weights.values())).dtype)
    set_peft_model_state_dict(model, weights)
    out: Adapters = {}
    seen = set()
    for t in targets:
        found = [[n for n in part if n in layers] for part in t.hf]
        if not any(found):
            continue
        names = [part[0] for part in t.hf]
        if not all(found):
            raise ValueError(f"{flag} {directory}: Megatron's {t.megatron} is one fused module; the adapter covers "
                             f"only {[n for n, f in zip(names, found) if f]} of {names}")
        parts = []
        for part in t.hf:
            copies = [_read(layers[n], t.expert) for n in part]
            seen.update(part)
            if any(not (torch.equal(a, copies[0][0]) and torch.equal(b, copies[0][1])) for a, b in copies[1:]):
                raise ValueError(f"{flag} {directory}: {part[0]} and its tied copy {part[1]} carry different "
                                 "adapters; Megatron's one module holds one")
            parts.append(copies[0])
        if any(not torch.equal(a, parts[0][0]) for a, _ in parts[1:]):
            raise ValueError(f"{flag} {directory}: {names} have different lora_A, but Megatron's fused {t.megatron} "
                             "adapter shares one A (as every adapter exported from Megatron does); merge this adapter "
                             "into the Hugging Face model and convert that instead")
        out[t.megatron + A], out[t.megatron + B] = parts[0][0], t.join(*(b for _, b in parts))
    left = sorted(set(layers) - seen)
    if left:
        raise ValueError(f"{flag} {directory}: adapters on Hugging Face modules with no Megatron LoRA target: {left[:4]}")
    # use_rslora scales by alpha / sqrt(r), which is (alpha * sqrt(r)) / r
    alpha = float(cfg.lora_alpha) * (cfg.r ** 0.5 if getattr(cfg, "use_rslora", False) else 1.0)
    lora = LoRAConfig(cfg.r, alpha, float(cfg.lora_dropout), target_modules(adapted_modules(out), targets, flag))
    return lora, out
