"""Megatron LoRA adapters <-> a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`).

peft writes and reads the folder (`get_peft_model` on the Hugging Face model built on the meta
device, `save_pretrained`, `load_peft_weights` / `set_peft_model_state_dict`); this module only
places the tensors, given each adapted module's `Target` (which conversion/lora.py makes from the
converter's weight mapping). Rules and refusals: docs/lora.md#export-to-peft-and-import.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megatron_csbp.lora import PART_TARGETS, LoRAConfig, adapter_key, is_adapter

A, B = ".lora_A", ".lora_B"
Adapters = Dict[str, torch.Tensor]  # {megatron module name + ".lora_A" / ".lora_B" (a part's "_q" etc.): full tensor}
Unit = Tuple[str, Optional[str]]  # (megatron module, part or None): one adapter
_TARGET_OF = {v: k for k, v in PART_TARGETS.items()}  # (fused module, part) -> canonical target


class Target(NamedTuple):
    """Megatron module `megatron` (adapters `megatron.lora_A` / `.lora_B`) whose base weight is the
    Hugging Face parameters `hf` joined by `join` (rows); `split` is its inverse. Each entry of `hf`
    lists the live parameter names that hold that part (a tied copy too); `expert` is the index into
    a 3D expert parameter [experts, out, in], None for a Linear's weight; `parts`: the canonical
    parts (lora/__init__.py FUSED_PARTS) the entries of `hf` are, where the module has that form."""
    megatron: str
    hf: Tuple[Tuple[str, ...], ...]
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]]
    join: Callable[..., torch.Tensor]
    expert: Optional[int] = None
    parts: Tuple[str, ...] = ()


def adapter_units(adapters: Adapters) -> Dict[Unit, Tuple[torch.Tensor, torch.Tensor]]:
    """{(module, part or None): (A, B)}; each adapter must have both matrices."""
    found: Dict[Unit, Dict[str, torch.Tensor]] = {}
    bad = []
    for k, v in adapters.items():
        if not is_adapter(k):
            bad.append(k)
            continue
        module, which, part = adapter_key(k)
        found.setdefault((module, part), {})[which] = v
    bad += [m for (m, _), ab in found.items() if len(ab) != 2]
    if bad:
        raise ValueError(f"LoRA adapters must come as <module>.lora_A / <module>.lora_B pairs: {bad[:4]}")
    return {u: (ab["A"], ab["B"]) for u, ab in sorted(found.items(), key=lambda x: (x[0][0], x[0][1] or ""))}


def _part_delta(deltas: Dict[str, torch.Tensor], rows: int, query_groups: Optional[int], module: str) -> torch.Tensor:
    """A fused weight's delta from its parts' (rows in the fused layout; an unadapted part's zero)."""
    from megatron_csbp.lora.layers import fuse_parts

    d = next(iter(deltas.values()))
    if "gate" in deltas or "up" in deltas:
        sizes, groups = {"gate": rows // 2, "up": rows // 2}, None
    else:
        if query_groups is None:
            raise ValueError(f"{module}: folding q/k/v part adapters needs the model's query groups")
        kv = deltas["k"].shape[0] if "k" in deltas else deltas["v"].shape[0] if "v" in deltas \
            else (rows - deltas["q"].shape[0]) // 2
        sizes, groups = {"q": rows - 2 * kv, "k": kv, "v": kv}, query_groups
    return fuse_parts([deltas[p] if p in deltas else d.new_zeros(n, d.shape[1]) for p, n in sizes.items()], groups, 0)


def merged_state(state: Dict[str, torch.Tensor], config: LoRAConfig, adapters: Adapters,
                 query_groups: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """The base state with every adapter folded in: W + (alpha / rank) * B @ A (in float64, cast back);
    part adapters each into their part's rows (`query_groups`: the model's, for q/k/v parts)."""
    out = dict(state)
    per_module: Dict[str, Dict[Optional[str], torch.Tensor]] = {}
    for (m, part), (a, b) in adapter_units(adapters).items():
        per_module.setdefault(m, {})[part] = b.double() @ a.double() * config.scaling
    for m, deltas in per_module.items():
        w = state[m + ".weight"]
        delta = deltas[None] if None in deltas else _part_delta(deltas, w.shape[0], query_groups, m)
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
    units = adapter_units(adapters)
    unknown = [m for m, part in units if m not in by_module or part is not None and part not in by_module[m].parts]
    if unknown:
        raise ValueError(f"adapters on modules a PEFT adapter of this model has no place for: {unknown[:4]} (part "
                         "adapters of experts' linear_fc1: transformers' fused gate_up_proj takes one; use --merge-lora)")
    placed = []  # (live Hugging Face names, A, B, expert)
    for (m, part), (a, b) in units.items():
        t = by_module[m]
        if part is not None:
            placed.append((t.hf[t.parts.index(part)], a, b, None))
        else:
            placed += [(names, a, b_part, t.expert) for names, b_part in zip(t.hf, t.split(b))]
    linear = sorted({n[: -len(".weight")] for names, _, _, expert in placed if expert is None for n in names})
    params = sorted({n for names, _, _, expert in placed if expert is not None for n in names})
    if params and config.dropout:
        raise ValueError(f"--lora-dropout {config.dropout}: peft's expert adapters (target_parameters on the fused 3D "
                         "expert weights) take no dropout, so this run's expert adapters have no PEFT form; export "
                         "with --merge-lora, or train with --lora-dropout 0")
    model = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, bias="none", target_modules=linear or None,
        target_parameters=params or None, base_model_name_or_path=base))
    layers = _peft_layers(model)
    experts: Dict[str, Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = {}
    for names, a, b_part, expert in placed:
        for name in names:
            if expert is None:
                _assign(layers[name], a, b_part)
            else:
                experts.setdefault(name, {})[expert] = (a, b_part)
    for name, per_expert in experts.items():
        n = layers[name].num_experts
        if sorted(per_expert) != list(range(n)):
            raise ValueError(f"{name}: adapters on experts {sorted(per_expert)} of {n}; PEFT's adapter of an expert "
                             "stack holds every expert")
        b = torch.stack([per_expert[e][1] for e in range(n)], dim=-1)
        _assign(layers[name], torch.cat([per_expert[e][0] for e in range(n)]), b.reshape(b.shape[0], -1))
    return model


def _read(layer, expert: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    if expert is None:
        return a, b
    n = layer.num_experts
    return a.reshape(n, -1, a.shape[-1])[expert], b.reshape(b.shape[0], -1, n)[:, :, expert]


def _unit_name(unit: Unit) -> str:
    """An adapter's name as --lora-target-modules matches it: the module's, a part's canonical target
    in place of its module's leaf (`....self_attention.linear_q`)."""
    m, part = unit
    return m if part is None else f"{m.rsplit('.', 1)[0]}.{_TARGET_OF[(m.rsplit('.', 1)[1], part)]}"


def target_modules(adapted: Sequence[Unit], targets: List[Target], flag: str) -> Tuple[str, ...]:
    """--lora-target-modules that adapt exactly the adapters `adapted`: a module (or canonical part)
    name where every one of that name is adapted, `experts.<name>` where exactly the experts' are."""
    units = {_unit_name((t.megatron, p)): t.expert is not None for t in targets for p in (None, *t.parts)}
    adapted = [_unit_name(u) for u in adapted]
    names = []
    for leaf in sorted({m.rsplit(".", 1)[1] for m in adapted}):
        have = {m for m in adapted if m.endswith("." + leaf)}
        every = {u for u in units if u.endswith("." + leaf)}
        if have == every:
            names.append(leaf)
        elif have == {u for u in every if units[u]}:
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
    for bad, what in ((cfg.peft_type != peft.PeftType.LORA, f"a {cfg.peft_type} adapter"),
                      (getattr(cfg, "use_dora", False), "DoRA (use_dora)"),
                      (getattr(cfg, "lora_bias", False) or getattr(cfg, "bias", "none") != "none", "adapter biases"),
                      (bool(getattr(cfg, "modules_to_save", None)),
                       "modules_to_save (full weights beside the adapters)"),
                      (bool(getattr(cfg, "rank_pattern", None)) or bool(getattr(cfg, "alpha_pattern", None)),
                       "per-module ranks or alphas (rank_pattern / alpha_pattern)")):
        if bad:
            raise ValueError(f"{flag} {directory}: {what} has no Megatron LoRA counterpart (one rank and alpha, no "
                             "bias, adapters on linear_qkv / linear_proj / linear_fc1 / linear_fc2 only)")
    model = peft.get_peft_model(hf_model, cfg)
    seen = set()
    weights = load_peft_weights(directory, device="cpu")
    layers = _peft_layers(model)
    for layer in layers.values():  # the adapters leave the meta device, in the file's dtype
        for d in (layer.lora_A, layer.lora_B):
            d.to_empty(device="cpu").to(next(iter(weights.values())).dtype)
    set_peft_model_state_dict(model, weights)
    read = []  # (target, [(A, B) or None per Hugging Face part])
    for t in targets:
        found = [[n for n in part if n in layers] for part in t.hf]
        if not any(found):
            continue
        parts = []
        for part, have in zip(t.hf, found):
            copies = [_read(layers[n], t.expert) for n in have]
            seen.update(have)
            if any(not (torch.equal(a, copies[0][0]) and torch.equal(b, copies[0][1])) for a, b in copies[1:]):
                raise ValueError(f"{flag} {directory}: {part[0]} and its tied copy {part[1]} carry different "
                                 "adapters; Megatron's one module holds one")
            parts.append(copies[0] if copies else None)
        read.append((t, parts))
    # a kind of fused module (linear_qkv, linear_fc1) takes part adapters wherever one of its modules
    # is covered in part or with different A's, one shared-A adapter otherwise
    split = {t.megatron.rsplit(".", 1)[1] for t, parts in read if t.parts and
             (None in parts or any(not torch.equal(a, parts[0][0]) for a, _ in parts[1:]))}
    out: Adapters = {}
    for t, parts in read:
        names = [part[0] for part in t.hf]
        if t.parts and t.megatron.rsplit(".", 1)[1] in split:
            for p, ab in zip(t.parts, parts):
                if ab is not None:
                    out[f"{t.megatron}{A}_{p}"], out[f"{t.megatron}{B}_{p}"] = ab
            continue
        if None in parts:
            raise ValueError(f"{flag} {directory}: Megatron's {t.megatron} is one fused module; the adapter covers "
                             f"only {[n for n, f in zip(names, parts) if f is not None]} of {names}")
        if any(not torch.equal(a, parts[0][0]) for a, _ in parts[1:]):
            raise ValueError(f"{flag} {directory}: {names} have different lora_A, but Megatron's fused {t.megatron} "
                             "adapter shares one A and it has no part adapters; merge this adapter into the Hugging "
                             "Face model and convert that instead")
        out[t.megatron + A], out[t.megatron + B] = parts[0][0], t.join(*(b for _, b in parts))
    left = sorted(set(layers) - seen)
    if left:
        raise ValueError(f"{flag} {directory}: adapters on Hugging Face modules with no Megatron LoRA target: {left[:4]}")
    # use_rslora scales by alpha / sqrt(r), which is (alpha * sqrt(r)) / r
    alpha = float(cfg.lora_alpha) * (cfg.r ** 0.5 if getattr(cfg, "use_rslora", False) else 1.0)
    lora = LoRAConfig(cfg.r, alpha, float(cfg.lora_dropout), target_modules(list(adapter_units(out)), targets, flag))
    return lora, out
