"""Checkpoints with torch.distributed.checkpoint (one process, or sharded under FSDP2 — the same files).

A checkpoint is written into `run_dir/step_N.tmp/` and renamed to `step_N/` when every rank has finished, so a
folder named step_N is always complete. It holds the model, optimizer and EMA (DCP shards), the LR schedule and
loop state with the plan position (epoch, pos) in meta.json, every rank's RNG states, and the resolved config.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from training.dist import DistContext

STEP_DIR = re.compile(r"^step_(\d+)$")


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(run_dir):
        return []
    out = []
    for name in os.listdir(run_dir):
        m = STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(run_dir, name, "meta.json")):
            out.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(out)


def latest_checkpoint(run_dir: str) -> str | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _trainable_only(model_sd: dict, model) -> dict:
    """The trainable entries of a model state dict (a LoRA adapter: the frozen base comes from model.pretrained)."""
    keep = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in keep}


def save_checkpoint(run_dir: str, step: int, model, optimizer, ema, meta: dict, config_yaml: str,
                    ctx: DistContext, keep_last: int, trainable_only: bool = False) -> str:
    path = os.path.join(run_dir, f"step_{step}")
    tmp = path + ".tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    ctx.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": _trainable_only(model_sd, model) if trainable_only else model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group in one process
        dcp.save(state, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{ctx.rank}.pt"))
    ctx.barrier()
    if ctx.is_main:
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(config_yaml)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": ctx.world_size, **meta}, f, indent=1)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    ctx.barrier()
    return path


def load_checkpoint(path: str, model, optimizer, ema, ctx: DistContext, trainable_only: bool = False) -> dict:
    """Load into the live objects; returns meta.json. RNG states are restored when the world size is unchanged."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": _trainable_only(model_sd, model) if trainable_only else model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=not trainable_only))
    if ema is not None:
        ema.load_state_dict(state["ema"])
    rng_path = os.path.join(path, f"rng_rank{ctx.rank}.pt")
    if meta.get("world_size") == ctx.world_size and os.path.exists(rng_path):
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta
