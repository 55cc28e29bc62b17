"""Fine-tuning on top of a built model: frozen parameters by name, and LoRA adapters through peft.

    LoRA on a Linear W (out × in):   y = W x + b + (alpha / r) · B A x,   A: r × in (Kaiming), B: out × r (zeros)

so an adapted model starts equal to its base, and only A and B train. peft injects the adapter in place
(`inject_adapter_in_model`, as diffusers does): the model stays a WanTransformer whose adapted Linears read
`<module>.base_layer.weight`, `<module>.lora_A.default.weight`, `<module>.lora_B.default.weight`. Apply it before
`models/parallelize.py` (FSDP2 then shards the adapters with their block).

Adapter files are diffusers' Wan LoRA format, what `WanPipeline.load_lora_weights(folder)` and
`WanTransformer3DModel.load_lora_adapter(folder)` read: `pytorch_lora_weights.safetensors` with keys
`transformer.<module>.lora_A.weight` / `.lora_B.weight` (peft names, adapter name dropped) and the LoraConfig
(r, lora_alpha, target_modules, ...) as JSON under the safetensors metadata key `lora_adapter_metadata`, each field
prefixed `transformer.` — diffusers builds the adapter from it, so alpha ≠ rank round-trips (without the metadata
diffusers would assume alpha = rank). `merge_lora` folds W ← W + (alpha / r)·B A and removes the adapters, leaving
the plain keys that `save_pretrained` writes as a full diffusers model.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Iterable, Optional

import torch

from models.config import LoRAConfig, ModelConfig

ADAPTER = "default"                                 # peft's adapter name inside the model
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
METADATA_KEY = "lora_adapter_metadata"              # diffusers' LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer"                              # diffusers' WanPipeline component name
log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- applying
def apply_finetune(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """What `model.freeze` and `model.lora` ask for, in place: LoRA (base frozen) or the named parameters frozen.

    Idempotent, so a caller that cannot tell whether the factory already applied it may call it again.
    """
    if cfg.lora.enabled and not has_lora(model):
        apply_lora(model, cfg.lora)
    if cfg.freeze:
        freeze(model, cfg.freeze)
    return model


def freeze(model: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """requires_grad=False on every parameter whose name matches one of the regexes (re.search); their names."""
    patterns = list(patterns)
    frozen = [n for n, p in model.named_parameters() if any(re.search(pat, n) for pat in patterns)]
    unmatched = [pat for pat in patterns if not any(re.search(pat, n) for n, _ in model.named_parameters())]
    if unmatched:
        raise ValueError(f"model.freeze patterns {unmatched} match no parameter (names look like "
                         f"'blocks.0.attn1.to_q.weight', 'condition_embedder.text_embedder.linear_1.weight')")
    params = dict(model.named_parameters())
    for n in frozen:
        params[n].requires_grad_(False)
    return frozen


def has_lora(model: torch.nn.Module) -> bool:
    return ADAPTER in getattr(model, "peft_config", {})


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, target_modules: Optional[list[str]] = None,
               rank_pattern: Optional[dict] = None, alpha_pattern: Optional[dict] = None) -> torch.nn.Module:
    """Inject a LoRA adapter into every Linear whose name ends in one of `cfg.targets` (or exactly the
    `target_modules` given, as a loaded file names them); freeze everything else. In place; returns the model."""
    from peft import LoraConfig, inject_adapter_in_model

    if has_lora(model):
        raise ValueError("the model already holds a LoRA adapter; merge_lora() it first to stack another")
    targets = target_modules or cfg.targets
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    hit = sorted(n for n in linears if any(n == t or n.endswith("." + t) for t in targets))
    if not hit:
        raise ValueError(f"model.lora.targets={list(targets)} match no Linear module of the model (Wan block "
                         f"Linears end in to_q, to_k, to_v, to_out.0, ffn.net.0.proj, ffn.net.2)")
    missed = [t for t in targets if not any(n == t or n.endswith("." + t) for n in hit)]
    if missed:  # e.g. Wan's default targets on the MMDiT, whose feed-forwards are ff.net.*, not ffn.net.*
        log.warning("model.lora.targets %s match no Linear of this model: adapting the %d modules the others match",
                    missed, len(hit))
    peft_cfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha or cfg.rank, lora_dropout=cfg.dropout, target_modules=hit,
                          rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
                          init_lora_weights=True)
    inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    model.peft_config = {ADAPTER: peft_cfg}  # where peft's (and diffusers') state-dict helpers look
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    return model


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


# --------------------------------------------------------------------------------------------------- files
def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor shard gathered to the full tensor (a collective: every rank calls it), on the CPU."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.cpu().contiguous()


def lora_state_dict(model: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The adapter in diffusers' keys (`transformer.<module>.lora_A.weight`), full tensors on the CPU.

    Under FSDP2 every rank must call it (each adapter is gathered); all ranks get the same dict.
    """
    if not has_lora(model):
        raise ValueError("the model holds no LoRA adapter (model.lora.rank is 0)")
    tag = f".{ADAPTER}."
    out = {}
    for n, p in model.named_parameters():
        if ".lora_A." in n or ".lora_B." in n:
            t = _full(p)
            out[f"{PREFIX}.{n.replace(tag, '.')}"] = t.to(dtype) if dtype is not None else t
    return out


def lora_metadata(model: torch.nn.Module) -> dict:
    """The LoraConfig fields diffusers rebuilds the adapter from, prefixed as its pipelines save them.

    A minimal set rather than peft's full to_dict(): LoraConfig(**metadata) must also work on older peft versions.
    """
    c = model.peft_config[ADAPTER]
    # The exact module names (peft may have shortened its own list to suffixes once it had injected).
    fields = {"r": c.r, "lora_alpha": c.lora_alpha, "target_modules": sorted(lora_modules(model)),
              "lora_dropout": c.lora_dropout, "bias": c.bias, "use_dora": c.use_dora, "use_rslora": c.use_rslora}
    for name in ("rank_pattern", "alpha_pattern"):
        if getattr(c, name):
            fields[name] = dict(getattr(c, name))
    return {f"{PREFIX}.{k}": v for k, v in fields.items()}


def save_lora(model: torch.nn.Module, out_dir: str, is_main: bool = True,
              dtype: Optional[torch.dtype] = None) -> str:
    """Write `out_dir/pytorch_lora_weights.safetensors` (+ metadata) as diffusers reads it; returns the file.

    Every rank calls it under FSDP2 (the adapters are gathered); only `is_main` writes.
    """
    from safetensors.torch import save_file

    state = lora_state_dict(model, dtype)
    path = os.path.join(out_dir, LORA_WEIGHT_NAME)
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        meta = {"format": "pt", METADATA_KEY: json.dumps(lora_metadata(model), indent=2, sort_keys=True)}
        save_file(state, path + ".tmp", metadata=meta)
        os.replace(path + ".tmp", path)
    return path


def read_lora(path: str) -> tuple[dict[str, torch.Tensor], Optional[dict]]:
    """(state dict in diffusers' `transformer.` keys, metadata or None) from a file or a folder holding one.

    Other Wan LoRA layouts (original `diffusion_model.*`, musubi `lora_unet_*`) go through diffusers' own converter.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    if os.path.isdir(path):
        path = os.path.join(path, LORA_WEIGHT_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no LoRA adapter at {path} (expected {LORA_WEIGHT_NAME} or a .safetensors file)")
    state = load_file(path)
    with safe_open(path, framework="pt") as f:
        raw = (f.metadata() or {}).get(METADATA_KEY)
    meta = json.loads(raw) if raw else None
    if not all(k.startswith(PREFIX + ".") for k in state):
        from diffusers import WanPipeline  # slow import: only for foreign layouts

        state = WanPipeline.lora_state_dict(state)
        if not all(k.startswith(PREFIX + ".") for k in state):
            state = {f"{PREFIX}.{k}": v for k, v in state.items()}
    return state, meta


def load_lora(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """Inject the adapter a file describes into a model without one and load its weights (strictly)."""
    from peft import set_peft_model_state_dict

    state, meta = read_lora(path)
    state = {k[len(PREFIX) + 1:]: v for k, v in state.items()}
    if any(".lora_" not in k for k in state):
        raise ValueError(f"{path}: not a LoRA adapter (keys without lora_A/lora_B, e.g. "
                         f"{next(k for k in state if '.lora_' not in k)!r})")
    ranks = {k.rsplit(".lora_B", 1)[0]: v.shape[1] for k, v in state.items() if ".lora_B." in k}
    modules = sorted(ranks)
    fields = {k[len(PREFIX) + 1:]: v for k, v in (meta or {}).items() if k.startswith(PREFIX + ".")}
    if fields:  # the adapter's own LoraConfig, as diffusers rebuilds it
        rank, alpha = int(fields["r"]), float(fields.get("lora_alpha", fields["r"]))
        rank_pattern, alpha_pattern = fields.get("rank_pattern"), fields.get("alpha_pattern")
    else:  # diffusers' convention without metadata: the most common rank, and scale 1 (alpha = rank) everywhere
        rank = max(set(ranks.values()), key=list(ranks.values()).count)
        alpha = float(rank)
        rank_pattern = {f"^{m}$": r for m, r in ranks.items() if r != rank}
        alpha_pattern = dict(rank_pattern)
    cfg = LoRAConfig(rank=rank, alpha=alpha, targets=modules, dropout=float(fields.get("lora_dropout", 0.0)))
    apply_lora(model, cfg, target_modules=modules, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{path} does not fit the model: unexpected {list(result.unexpected_keys)[:4]}, "
                         f"missing {missing[:4]}")
    return model


# -------------------------------------------------------------------------------------------------- merging
@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Fold every adapter into its base weight (W ← W + scale·B A) and remove it, in place: afterwards the model has
    the plain diffusers keys again (`save_pretrained` writes a full model; nothing of peft remains)."""
    if not has_lora(model):
        return model
    for name, module in lora_modules(model).items():
        module.merge(adapter_names=[ADAPTER])
        parent, _, child = name.rpartition(".")
        base = module.get_base_layer()
        setattr(model.get_submodule(parent) if parent else model, child, base)
    del model.peft_config
    return model
