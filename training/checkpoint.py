"""Checkpoints with torch.distributed.checkpoint (one process, or sharded under FSDP2 — the same files).

A checkpoint is written into `run_dir/step_N.tmp/` and renamed to `step_N/` when every rank has finished, so a
folder named step_N is always complete. It holds the model, optimizer and EMA (DCP shards), the LR schedule and
loop state with the plan position (epoch, pos) in meta.json, every rank's RNG states (plain tensors), the resolved
config, and `manifest.json`: the size and SHA-256 of every other file, written last.

Loading never unpickles code. DCP's `.metadata` is read by an unpickler that admits only DCP's own metadata classes
(`SAFE_GLOBALS`); the non-tensor values of the state dict (the optimizer's hyper-parameters) and the RNG files are
read with `torch.load(weights_only=True)`. A crafted checkpoint can therefore fail to load, never run code.
`verify_checkpoint` checks a folder against its manifest (truncated, missing or damaged files) before anything is
read; every rank hashes its share of the files and the verdict is agreed.

A checkpoint written because the NaN guard tripped is `diverged_step_N/`: kept for inspection, never counted by
`keep_last`, never taken by `resume=auto`, written once and never overwritten.

What the checkpoint cannot serve (`fit_state`, before any tensor is read): its keys (DCP's metadata) are compared with
what this run's model, optimizer and EMA ask for. Another optimizer type (other state names) or other model weights
(LoRA turned on or off, a forced change of shape) raise `StateMismatch`, a config error rather than damage, so a good
checkpoint is never skipped or called damaged for it; with `force` an optimizer of another type starts from a fresh
state instead. EMA turned on starts a fresh EMA from the loaded weights; EMA turned off leaves the stored one unread.
Each is said in the log. A read that fails for another reason shows the last lines of its cause (where a traceback
says what went wrong).

Lineage: meta.json's `lineage.rollback_point` names the checkpoint the current branch started from (a resume from
an explicit older checkpoint, training/resume.py); `keep_last` never deletes it.

No file of a checkpoint is read or written through a link (training/run_folder.py's `open_in`; the manifest's files
must be regular files, and DCP's `.metadata` may only name plain file names). A full disk during a save raises
"no space left on <path>", removes the half-written `step_N.tmp/` and leaves every older checkpoint in place.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import stat
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner as _default_planner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from training.dist import DistContext
from training.run_folder import NoSpaceLeft, no_space, open_in, read_text, write_whole

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
DIVERGED_PREFIX = "diverged_"
MANIFEST = "manifest.json"
HASH_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete, damaged or not ours to load."""


class NotLoaded(CheckpointError):
    """Tensors that DCP could not read into this run's objects, from files that passed their manifest: most likely
    something this run asks of them (a shape, a key), not damage."""


class StateMismatch(ValueError):
    """A sound checkpoint that this run's config cannot take (another optimizer type, other model weights): the
    config is what to change, not the checkpoint (so not a CheckpointError: resume=auto does not skip past it)."""


def tail(text: str, lines: int = 8, chars: int = 1500) -> str:
    """The last `lines` lines of an error's text (at most `chars` characters): a traceback's cause is at its end."""
    return "\n".join(str(text).strip().splitlines()[-lines:])[-chars:]


# ---------------------------------------------------------------------------------------------------------------
# Reading without running code
# ---------------------------------------------------------------------------------------------------------------

_DCP_MD = "torch.distributed.checkpoint.metadata"
SAFE_GLOBALS = {
    (_DCP_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                           "TensorProperties", "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch dtypes; anything else (os.system, builtins.eval, ...) is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in SAFE_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which a checkpoint never holds")


_PLAIN = re.compile(r"[\w.\-]+")  # a file name of a checkpoint folder: no separators


def read_metadata(path: str):
    """DCP's `Metadata` of a checkpoint folder, read by the restricted unpickler."""
    with open_in(path, ".metadata", "rb") as f:
        try:
            md = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{path}/.metadata refused: {e}") from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
            raise CheckpointError(f"{path}/.metadata is damaged ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):  # plain data unpickles without a global: a dict, a number, ...
        raise CheckpointError(f"{path}/.metadata holds a {type(md).__name__}, not DCP's Metadata (damaged)")
    for info in (md.storage_data or {}).values():  # DCP opens path / relative_path
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _PLAIN.fullmatch(name) or name.startswith(".."):
            raise CheckpointError(f"{path}/.metadata names the file {name!r}, not a file of this folder")
    return md


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = read_metadata(str(self.path))
        if md.storage_meta is None:  # written by a torch that predates it
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are read with weights_only=True (DCP's own uses False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # the planner module's own helper, wherever a torch version keeps it
            _default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict, path: str) -> None:
    """dcp.load(state, path) in place, without unpickling anything but tensors, numbers and strings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group in one process
        dcp.load(state, storage_reader=_SafeReader(path), planner=_SafePlanner())


# ---------------------------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------------------------

def _sha256(folder: str, name: str) -> str:
    h = hashlib.sha256()
    with open_in(folder, name, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _my_share(names: list[str], ctx: DistContext) -> list[str]:
    return [n for i, n in enumerate(sorted(names)) if i % ctx.world_size == ctx.rank]


def write_manifest(path: str, ctx: DistContext) -> None:
    """Every rank hashes its share of the folder's files; rank 0 writes manifest.json (collective)."""
    names = sorted(n for n in os.listdir(path) if n != MANIFEST) if ctx.is_main else None
    names = ctx.broadcast_object(names)
    mine = {n: {"size": os.path.getsize(os.path.join(path, n)), "sha256": _sha256(path, n)}
            for n in _my_share(names, ctx)}
    entries = {}
    for part in ctx.gather_objects(mine):
        entries.update(part)
    error = None
    if ctx.is_main:
        try:
            write_whole(path, MANIFEST, json.dumps({"files": dict(sorted(entries.items()))}, indent=1))
        except Exception as e:  # noqa: BLE001 — any rank's failure, agreed on below
            error = e
    _agreed(error, ctx)


def _check_files(path: str, files: dict, names: list[str]) -> Optional[str]:
    for n in names:
        if not _PLAIN.fullmatch(n) or n.startswith(".."):
            return f"manifest names {n!r}, which is not a file of this folder"
        want, p = files[n], os.path.join(path, n)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return f"{n} is missing"
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            return f"{n} is {'a link' if stat.S_ISLNK(st.st_mode) else 'not a regular file'} (never read through)"
        if st.st_size != want.get("size"):
            return f"{n} has {st.st_size} bytes, the manifest says {want.get('size')}"
        if _sha256(path, n) != want.get("sha256"):
            return f"{n} does not match its SHA-256 in the manifest (damaged)"
    return None


def files_match_manifest(path: str, names: tuple[str, ...]) -> bool:
    """Whether `names` of checkpoint `path` are listed in its manifest and match it (size and SHA-256): one process,
    no collective, only these files read — for the small files read before the run starts (its config.yaml)."""
    try:
        files = json.loads(read_text(path, MANIFEST))["files"]
        return all(n in files for n in names) and _check_files(path, files, list(names)) is None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def verify_checkpoint(path: str, ctx: DistContext) -> Optional[str]:
    """None when `path` is a complete checkpoint whose files match their manifest, else what is wrong (the same
    answer on every rank). A checkpoint without its manifest is damaged: nothing else says its files are whole."""
    problem = None
    if not os.path.lexists(os.path.join(path, "meta.json")):
        problem = "no meta.json (not a complete checkpoint)"
    elif not os.path.lexists(os.path.join(path, MANIFEST)):
        problem = f"no {MANIFEST}: its files cannot be verified (deleted, or written by a version before manifests)"
    else:
        try:
            files = json.loads(read_text(path, MANIFEST))["files"]
            for n in (".metadata", "meta.json"):
                if n not in files:
                    raise KeyError(n)
            problem = _check_files(path, files, _my_share(list(files), ctx))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            problem = f"{MANIFEST} is damaged ({type(e).__name__}: {e})"
    flags = ctx.all_gather_floats([float(problem is not None)])[:, 0]
    if problem is None and flags.max() > 0:
        problem = f"rank {int(flags.argmax())} found a damaged or missing file (its log names it)"
    return problem


@dataclass
class LoopState:
    """Where the loop is (saved in meta.json, restored on resume): optimizer steps done, the plan position
    (epoch, pos: the global sample position the plan is a function of), samples and latent tokens trained on, and
    the NaN guard's counts."""
    step: int = 0
    epoch: int = 0
    pos: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    bad_in_a_row: int = 0
    skipped_steps: int = 0

    @classmethod
    def from_meta(cls, meta: dict) -> "LoopState":
        return cls(**{f.name: int(meta[f.name]) for f in fields(cls) if f.name in meta})

    def meta(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# Listing, saving, loading
# ---------------------------------------------------------------------------------------------------------------

def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the complete regular checkpoints in run_dir, oldest first (diverged ones, and links, are not
    listed)."""
    if not os.path.isdir(run_dir):
        return []
    out = []
    for name in os.listdir(run_dir):
        m = STEP_DIR.match(name)
        p = os.path.join(run_dir, name)
        if m and not os.path.islink(p) and os.path.lexists(os.path.join(p, "meta.json")):
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


def _live_state(model, optimizer, ema, trainable_only: bool) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": _trainable_only(model_sd, model) if trainable_only else model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def _remove(path: str) -> None:
    """Remove a file, a link (never what it points to) or a folder."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _agreed(error: Optional[BaseException], ctx: DistContext) -> None:
    """Raise on every rank when any rank's local write failed — the failing rank its own error, the others an
    OSError naming it (ENOSPC where it was one) — so that no rank waits in a later barrier for one that left.
    Collective; one process: raise its own error."""
    if ctx.distributed:
        full = error is not None and no_space(error, "") is not None
        said = ctx.gather_objects(None if error is None else (full, f"{type(error).__name__}: {error}"))
        failed = [(r, e) for r, e in enumerate(said) if e is not None]
        if failed and error is None:
            r, (full, what) = failed[0]
            raise OSError(errno.ENOSPC if full else errno.EIO, f"rank {r} could not write its part of the "
                          f"checkpoint ({what})")
    if error is not None:
        raise error


def _write(tmp: str, step: int, model, optimizer, ema, meta: dict, config_yaml: str, ctx: DistContext,
           trainable_only: bool, diverged: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group in one process
        # collective: DCP gathers every rank's write failure and raises it on all of them
        dcp.save(_live_state(model, optimizer, ema, trainable_only), checkpoint_id=tmp)
    error = None
    try:
        rng = io.BytesIO()
        torch.save(_rng_state(), rng)  # into memory: torch's zip writer would turn a full disk into its own error
        write_whole(tmp, f"rng_rank{ctx.rank}.pt", rng.getvalue())
        if ctx.is_main:
            write_whole(tmp, "config.yaml", config_yaml)
            write_whole(tmp, "meta.json", json.dumps({"step": step, "world_size": ctx.world_size,
                                                      "diverged": diverged, "optimizer": type(optimizer).__name__,
                                                      **meta}, indent=1))
    except Exception as e:  # noqa: BLE001 — any rank's failure, agreed on below
        error = e
    _agreed(error, ctx)
    write_manifest(tmp, ctx)


def save_checkpoint(run_dir: str, step: int, model, optimizer, ema, meta: dict, config_yaml: str,
                    ctx: DistContext, keep_last: int, trainable_only: bool = False, diverged: bool = False) -> str:
    """Write step_N/ (or diverged_step_N/) atomically; a regular one then prunes all but the newest keep_last and
    the rollback point (`meta["lineage"]["rollback_point"]`). A diverged_step_N that exists is kept as it is.
    A full disk raises NoSpaceLeft ("no space left on <path>") with step_N.tmp removed."""
    path = os.path.join(run_dir, f"{DIVERGED_PREFIX if diverged else ''}step_{step}")
    if diverged and os.path.lexists(path):
        if ctx.is_main:
            log.warning("%s exists: kept as it was first written (a diverged checkpoint is never overwritten)", path)
        return path
    tmp = path + ".tmp"
    error = None
    if ctx.is_main:
        try:
            _remove(tmp)
            os.makedirs(tmp)
        except Exception as e:  # noqa: BLE001 — any rank's failure, agreed on below
            error = e
    try:
        _agreed(error, ctx)  # every rank's writes are agreed on before the next collective: none waits for a rank
        _write(tmp, step, model, optimizer, ema, meta, config_yaml, ctx, trainable_only, diverged)  # that left
    except BaseException as e:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        full = no_space(e, tmp)
        if full is None:
            raise
        kept = latest_checkpoint(run_dir)
        raise NoSpaceLeft(errno.ENOSPC, f"{full.strerror} while writing {os.path.basename(path)}: it was not "
                          f"written, and {'the last good checkpoint ' + kept + ' is kept' if kept else 'no older checkpoint exists'}"
                          f". Free space, then resume=auto") from e
    error = None
    if ctx.is_main:
        try:
            _remove(path)
            os.rename(tmp, path)
            if not diverged:
                keep = (meta.get("lineage") or {}).get("rollback_point")
                for _, old in list_checkpoints(run_dir)[:-keep_last]:
                    if os.path.basename(old) != keep:
                        shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 — said to every rank, none left waiting
            error = e
    _agreed(error, ctx)
    return path


def read_meta(path: str) -> dict:
    try:
        meta = json.loads(read_text(path, "meta.json"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/meta.json is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("step", "epoch", "pos")):
        raise CheckpointError(f"{path}/meta.json lacks the loop state (step, epoch, pos)")
    return meta


def _names(keys, section: str) -> set[str]:
    return {k[len(section) + 1:] for k in keys if k.startswith(section + ".")}


def _listed(names, n: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def fit_state(path: str, held: dict, state: dict, meta: dict, optimizer, force: bool, is_main: bool) -> bool:
    """Fit the live state dict `state` ({model, optim, ema?}) to what the checkpoint holds (`held`: DCP's flat key →
    its storage metadata), in place, before anything is read: the EMA entry is dropped where the checkpoint has none
    (returns True: the caller starts a fresh EMA from the loaded weights), the optimizer entry where `force` takes
    another optimizer type (it starts fresh). Other weights or shapes, or another optimizer type unforced, raise
    StateMismatch."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat = flatten_state_dict(state)[0]
    want = set(flat)
    missing, extra = _names(want, "model") - _names(held, "model"), _names(held, "model") - _names(want, "model")
    shapes = {k[6:]: (tuple(held[k].size), tuple(t.shape)) for k, t in flat.items() if k.startswith("model.")
              and k in held and hasattr(held[k], "size") and tuple(held[k].size) != tuple(t.shape)}
    if shapes and not (missing or extra):
        raise StateMismatch(f"{path} holds weights of other shapes than this run's model (a forced model.* change): "
                            + "; ".join(f"{k} {a} here {b}" for k, (a, b) in list(shapes.items())[:4])
                            + ". The checkpoint is intact: resume with the model.* values it was saved with (its "
                            "config.yaml), or start a new run under another name")
    if missing or extra:
        lora = any("lora" in n for n in missing | extra)
        raise StateMismatch(
            f"{path} holds other model weights than this run's model: "
            + (f"this model's {_listed(missing)} are not in it" if missing else "")
            + ("; " if missing and extra else "") + (f"it holds {_listed(extra)}, which this model lacks" if extra else "")
            + (". LoRA was turned on or off (model.lora.rank): the checkpoint is intact, but holds "
               "an adapter's or a full model's weights and optimizer state, not the other. To go on from it, export it "
               f"(python scripts/export.py {path} --out exported/NAME) and start a new run with "
               "model.pretrained=exported/NAME and the model.lora.rank you want" if lora else
               ". The checkpoint is intact: resume with the model.* values it was saved with (its config.yaml), or "
               "start a new run under another name"))
    saved_kind, kind = meta.get("optimizer"), type(optimizer).__name__
    held_opt = {n.rsplit(".", 1)[-1] for n in _names(held, "optim.state")}
    want_opt = {n.rsplit(".", 1)[-1] for n in _names(want, "optim.state")}
    if held_opt != want_opt or (saved_kind is not None and saved_kind != kind):
        was = f"{saved_kind}'s" if saved_kind else "another optimizer's"
        if not force:
            raise StateMismatch(
                f"{path} holds {was} state ({_listed(held_opt)}); this run's optimizer is {kind} "
                f"({_listed(want_opt) or 'no state'}): the optimizer type changed (optim.*). The checkpoint is "
                f"intact: resume with the optimizer it was saved with, or set resume_force=true to load the model "
                f"(and EMA) and start {kind} from a fresh state")
        state.pop("optim")
        if is_main:
            log.warning("resume_force: %s holds %s state, this run's optimizer is %s: the model (and EMA) are "
                        "loaded, the optimizer starts from a fresh state", path, was, kind)
    ema_fresh = "ema" in state and not _names(held, "ema")
    if ema_fresh:
        state.pop("ema")
        if is_main:
            log.info("resume: %s holds no EMA (optim.ema_decay was null): a fresh EMA starts from the loaded "
                     "weights", path)
    elif "ema" not in state and _names(held, "ema") and is_main:
        log.info("resume: optim.ema_decay is null: the EMA that %s holds is not loaded (dropped)", path)
    return ema_fresh


def load_checkpoint(path: str, model, optimizer, ema, ctx: DistContext, trainable_only: bool = False,
                    force: bool = False) -> dict:
    """Load into the live objects; returns meta.json. RNG states are restored when the world size is unchanged.
    Raises CheckpointError for a folder that is damaged or holds anything but data, StateMismatch for a sound one
    this run cannot take (`fit_state`; `force`: another optimizer type starts fresh)."""
    meta = read_meta(path)
    if not isinstance(meta.get("lr_scheduler"), dict):
        raise CheckpointError(f"{path}/meta.json has no lr_scheduler state")
    rng = _read_rng(path, ctx) if meta.get("world_size") == ctx.world_size else None
    md = read_metadata(path)  # its refusals as they are (inside dcp.load they come wrapped in DCP's exception)
    state = _live_state(model, optimizer, ema, trainable_only)
    ema_fresh = fit_state(path, md.state_dict_metadata, state, meta, optimizer, force, ctx.is_main)
    try:
        safe_load(state, path)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP raises every rank's read error on all ranks, as one
        # CheckpointException (a BaseException) whose text is every rank's traceback: its cause is at the end
        raise NotLoaded(f"{path} could not be read ({type(e).__name__}: ...\n{tail(e)})") from e
    options = StateDictOptions(strict=not trainable_only)
    if "optim" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)
    if ema is not None:
        if ema_fresh:
            ema.reset(model)
        else:
            ema.load_state_dict(state["ema"])
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def _read_rng(path: str, ctx: DistContext) -> Optional[dict]:
    """This rank's RNG states, checked against the generators they go into (a wrong-size state is refused here,
    before anything is loaded, not by torch.set_rng_state after the weights were)."""
    name = f"rng_rank{ctx.rank}.pt"
    if not os.path.lexists(os.path.join(path, name)):
        return None
    try:
        with open_in(path, name, "rb") as f:
            rng = torch.load(f, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}/{name} refused or damaged ({type(e).__name__}: {e})") from None
    want = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and "cuda" in rng:
        want["cuda"] = torch.cuda.get_rng_state()
    for k, ref in want.items():
        got = rng.get(k) if isinstance(rng, dict) else None
        if not isinstance(got, torch.Tensor) or got.dtype != ref.dtype or got.shape != ref.shape:
            shown = (got.dtype, tuple(got.shape)) if isinstance(got, torch.Tensor) else type(got).__name__
            raise CheckpointError(f"{path}/{name}: the {k} RNG state is {shown}, this generator's is "
                                  f"{(ref.dtype, tuple(ref.shape))}")
    return rng
