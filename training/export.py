"""Exporting a training checkpoint as a diffusers-format folder (config.json + safetensors), or its LoRA adapter
(the command line: scripts/export.py).

The checkpoint's own resolved config builds the model; the (possibly sharded, possibly adapter-only) DCP checkpoint
loads into one full model in this process (training/load.py), optionally with the EMA weights. A LoRA model is
merged (W + scale·B A) and written as a full model that diffusers' `WanTransformer3DModel.from_pretrained` and our
`WanTransformer.from_pretrained` load; `adapter=True` writes the adapter alone in diffusers' LoRA format instead
(`WanPipeline.load_lora_weights(out)`).

Writing. The export is written into a fresh temporary folder beside `out` and renamed to `out` once whole, so `out`
holds exactly one export: a killed export leaves no half folder under that name, and an earlier export's weights
file can never sit beside the new one (a single `diffusion_pytorch_model.safetensors` left beside new shards is what
from_pretrained would load). Whatever `out` held before — a folder with files, a file, a link — is moved aside to
`<out>.old-<UTC time>` first, never deleted and never written through, with a warning naming where it went.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Optional

from training.load import checkpoint_config, find_checkpoint, load_checkpoint_model

log = logging.getLogger(__name__)


def move_aside(out: str) -> Optional[str]:
    """Move whatever is at `out` (not an empty folder, which is removed) to `<out>.old-<UTC time>[-n]`; its new
    path, or None when there was nothing to keep. A link is moved as a link: its target is never touched."""
    if not os.path.lexists(out):
        return None
    if os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out):
        os.rmdir(out)
        return None
    base = f"{out.rstrip(os.sep)}.old-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    aside, n = base, 1
    while os.path.lexists(aside):
        aside, n = f"{base}-{n}", n + 1
    os.rename(out, aside)
    return aside


def export(checkpoint: str, out: str, ema: bool = False, max_shard_size: str | None = None,
           adapter: bool = False) -> str:
    """Write the export into `out` (rules in the module docstring); returns `out`."""
    from models.lora import has_lora, merge_lora, save_lora

    path = find_checkpoint(checkpoint)
    if path is None:
        raise FileNotFoundError(f"{checkpoint} is neither a checkpoint (step_N/) nor a run folder holding one")
    model = load_checkpoint_model(path, checkpoint_config(path), ema)
    if adapter and not has_lora(model):
        raise ValueError(f"{path} was not trained with a LoRA adapter (model.lora.rank is 0): export it whole")
    out = out.rstrip(os.sep) or out
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.export-", dir=parent)  # same disk: the rename is atomic
    try:
        if adapter:
            save_lora(model, tmp)
        else:
            merge_lora(model).save_pretrained(tmp, max_shard_size=max_shard_size)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export gets a plain folder's mode
        aside = move_aside(out)
        try:
            os.rename(tmp, out)
        except BaseException:
            if aside:
                os.rename(aside, out)  # put the earlier export back rather than leave nothing under its name
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside:
        log.warning("%s held an earlier export (or other files): moved aside to %s", out, aside)
    return out
