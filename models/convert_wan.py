"""Convert a Wan 2.1 text-to-video checkpoint in the original layout (Wan-AI's `WanModel`) to the diffusers layout
that models/wan.py, `model.pretrained` and diffusers' WanTransformer3DModel load — and back (the command line:
scripts/convert_wan.py).

The source is a folder of `*.safetensors` shards (with WanModel's config.json when present), or one .safetensors /
.pth file; keys may carry a `model.diffusion_model.` / `diffusion_model.` prefix (ComfyUI). Key map (per block i):

    self_attn.{q,k,v,o}      → attn1.{to_q,to_k,to_v,to_out.0}     cross_attn.* → attn2.* (the same names)
    self_attn.norm_{q,k}     → attn1.norm_{q,k}                     norm3 (the affine cross-attention norm) → norm2
    ffn.0 / ffn.2            → ffn.net.0.proj / ffn.net.2           modulation → scale_shift_table
    text_embedding.{0,2}     → condition_embedder.text_embedder.linear_{1,2}
    time_embedding.{0,2}     → condition_embedder.time_embedder.linear_{1,2}
    time_projection.1        → condition_embedder.time_proj         head.head → proj_out, head.modulation →
    patch_embedding          → patch_embedding                                              scale_shift_table

(the same correspondence as diffusers' scripts/convert_wan_to_diffusers.py, written here as an exact per-key map
rather than substring replacements). The original norm1/norm2 and head.norm have no parameters. Image-to-video
keys (img_emb, k_img, v_img) are refused: models/wan.py implements T2V only. The config comes from WanModel's
config.json (dim, num_heads, ffn_dim, freq_dim, in_dim, out_dim, num_layers, eps, ...) or, without one, from the
tensor shapes with head_dim 128 (every Wan 2.1 model) unless num_heads says otherwise.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Optional

import torch

BLOCK_MODULES = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
    "norm3": "norm2", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}
BLOCK_PARAMS = {"modulation": "scale_shift_table"}
TOP_MODULES = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
}
TOP_PARAMS = {"head.modulation": "scale_shift_table"}
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "module.")
IMAGE_KEYS = re.compile(r"(^img_emb\.|\.k_img\.|\.v_img\.|\.norm_k_img\.)")
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")


def _invert(d: dict) -> dict:
    return {v: k for k, v in d.items()}


def _map_key(key: str, block_modules: dict, block_params: dict, top_modules: dict, top_params: dict) -> str:
    m = _BLOCK_KEY.fullmatch(key)
    if m:
        i, rest = m.groups()
        if rest in block_params:
            return f"blocks.{i}.{block_params[rest]}"
        module, _, param = rest.rpartition(".")
        if module in block_modules:
            return f"blocks.{i}.{block_modules[module]}.{param}"
    else:
        if key in top_params:
            return top_params[key]
        module, _, param = key.rpartition(".")
        if module in top_modules:
            return f"{top_modules[module]}.{param}"
    raise KeyError(key)


def original_to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original Wan 2.1 T2V keys (prefix stripped) → diffusers keys; the same tensors."""
    state = strip_prefix(state)
    image = sorted(k for k in state if IMAGE_KEYS.search(k))
    if image:
        raise ValueError(f"image-to-video weights ({image[:3]} ...) are not supported: models/wan.py is T2V only")
    out, unknown = {}, []
    for k, v in state.items():
        try:
            out[_map_key(k, BLOCK_MODULES, BLOCK_PARAMS, TOP_MODULES, TOP_PARAMS)] = v
        except KeyError:
            unknown.append(k)
    if unknown:
        raise ValueError(f"keys that are not part of the original Wan 2.1 T2V layout: {unknown[:5]}"
                         + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    return out


def diffusers_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers (our) keys → the original Wan 2.1 layout; the inverse of original_to_diffusers."""
    maps = (_invert(BLOCK_MODULES), _invert(BLOCK_PARAMS), _invert(TOP_MODULES), _invert(TOP_PARAMS))
    out, unknown = {}, []
    for k, v in state.items():
        try:
            out[_map_key(k, *maps)] = v
        except KeyError:
            unknown.append(k)
    if unknown:
        raise ValueError(f"keys that are not part of the diffusers Wan 2.1 T2V layout: {unknown[:5]} (a LoRA "
                         "model must be merged first: models.lora.merge_lora)")
    return out


def strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            return {k[len(prefix):]: v for k, v in state.items()}
    return state


def infer_config(state: dict[str, torch.Tensor], original_config: Optional[dict] = None,
                 num_heads: Optional[int] = None) -> dict:
    """Our (diffusers') WanTransformer config for a state dict in diffusers keys, from WanModel's config.json
    where given (it names the heads) and the tensor shapes otherwise."""
    oc = original_config or {}
    w = state["patch_embedding.weight"]  # (dim, in, p_t, p_h, p_w)
    dim, in_channels, patch = w.shape[0], w.shape[1], tuple(w.shape[2:])
    heads = num_heads or oc.get("num_heads") or dim // 128
    if dim % heads:
        raise ValueError(f"dim {dim} does not split into {heads} heads: pass --num-heads")
    layers = 1 + max(int(m.group(1)) for k in state if (m := _BLOCK_KEY.fullmatch(k)))
    config = dict(patch_size=patch, num_attention_heads=heads, attention_head_dim=dim // heads,
                  in_channels=in_channels, out_channels=state["proj_out.weight"].shape[0] // math.prod(patch),
                  text_dim=state["condition_embedder.text_embedder.linear_1.weight"].shape[1],
                  freq_dim=state["condition_embedder.time_embedder.linear_1.weight"].shape[1],
                  ffn_dim=state["blocks.0.ffn.net.0.proj.weight"].shape[0], num_layers=layers,
                  cross_attn_norm="blocks.0.norm2.weight" in state, eps=float(oc.get("eps", 1e-6)))
    checks = {"dim": dim, "in_dim": in_channels, "out_dim": config["out_channels"], "ffn_dim": config["ffn_dim"],
              "freq_dim": config["freq_dim"], "text_dim": config["text_dim"], "num_layers": layers,
              "patch_size": list(patch)}
    bad = {k: (oc[k], v) for k, v in checks.items() if k in oc and (list(oc[k]) if k == "patch_size" else oc[k]) != v}
    if bad:
        raise ValueError("config.json disagrees with the weights: " + ", ".join(f"{k}={a} but the tensors say {b}"
                                                                                 for k, (a, b) in bad.items()))
    if oc.get("model_type", "t2v") != "t2v":
        raise ValueError(f"model_type={oc['model_type']!r}: only Wan 2.1 text-to-video (t2v) converts")
    return config


def load_original(source: str) -> tuple[dict[str, torch.Tensor], Optional[dict]]:
    """(state dict as stored, WanModel's config.json or None) from a folder of safetensors or one file."""
    from safetensors.torch import load_file

    config = None
    if os.path.isdir(source):
        files = sorted(glob.glob(os.path.join(source, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{source} holds no .safetensors files")
        cfg_path = os.path.join(source, "config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                config = json.load(f)
    else:
        files = [source]
    state = {}
    for path in files:
        if path.endswith(".safetensors"):
            state.update(load_file(path))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            state.update(loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded)
    return state, config


def convert(source: str, out: str, dtype: str = "keep", max_shard_size: Optional[str] = None,
            num_heads: Optional[int] = None) -> str:
    """Original checkpoint → diffusers folder (config.json + safetensors), loaded strictly into our model first."""
    from models.wan import WanTransformer

    raw, original_config = load_original(source)
    state = original_to_diffusers(raw)
    del raw
    config = infer_config(state, original_config, num_heads)
    with torch.device("meta"):
        model = WanTransformer(**config)
    model.load_state_dict(state, strict=True, assign=True)  # every key present, every shape right
    if dtype != "keep":
        model._cast_params({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def convert_to_original(source: str, out: str) -> str:
    """A diffusers-format folder → `out/diffusion_pytorch_model.safetensors` + WanModel's config.json."""
    from safetensors.torch import save_file

    from models.wan import WanTransformer

    model = WanTransformer.from_pretrained(source)
    state = diffusers_to_original({k: v.contiguous() for k, v in model.state_dict().items()})
    c = model.config
    os.makedirs(out, exist_ok=True)
    save_file(state, os.path.join(out, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"_class_name": "WanModel", "model_type": "t2v", "dim": model.dim, "num_heads":
                   c["num_attention_heads"], "ffn_dim": c["ffn_dim"], "freq_dim": c["freq_dim"],
                   "in_dim": c["in_channels"], "out_dim": c["out_channels"], "text_dim": c["text_dim"],
                   "num_layers": c["num_layers"], "patch_size": list(c["patch_size"]), "eps": c["eps"],
                   "cross_attn_norm": c["cross_attn_norm"], "qk_norm": True}, f, indent=2)
    return out
