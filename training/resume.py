"""Resuming a run: which checkpoint, which config values win, and what is refused.

Which checkpoint: `resume=auto` takes the newest regular `step_N/` that passes `verify_checkpoint` and loads;
a damaged one — or one whose config.yaml, meta.json or RNG states fail to load after the check — is skipped with a
warning that names what was wrong, and the next older one is tried. Checkpoints the NaN guard wrote
(`diverged_step_N/`) are never taken by `auto`; name one explicitly to inspect it. `resume=PATH` takes that folder
or fails with the reason.

Lineage: a resume from an explicit checkpoint older than run_dir's newest starts a branch (a rollback). The newer
checkpoints, now abandoned, are moved into `run_dir/abandoned-<date>-<time>/` (kept, and named in the log), so
`resume=auto` can only take the current branch's. The checkpoint resumed from is the branch's rollback point:
carried on in every later checkpoint's meta.json (`lineage`), and never deleted by `keep_last`.

Which values win (the checkpoint's `config.yaml` against this run's config) is each key's resume class, declared
where its field is declared (this file keeps no list of keys; tests/test_resume_table.py writes the table out):
- `RESUME_DEFAULT = "<class>"` on a config dataclass classifies every field of it that declares none, so a field
  added later is classified by its section (`scheduling.*` and `data.*`: plan; `model.*`: trained; `optim.*`,
  `train.*`: free). A nested config dataclass without its own takes its enclosing one's (`data.raw.*` is plan).
- field metadata `{"resume": "<class>"}` classifies that field, and every key beneath it when it holds a dict;
  `{"resume_under": {pattern: class}}` classifies the keys beneath a dict field by pattern (`fnmatch` on the rest of
  the key: `optim.groups` declares `*.match` trained, `*` free); `{"switch": True}` marks a value whose 0 / null turns
  a part of the trained state off (`optim.ema_decay`, `model.lora.rank`).
`resume_table` walks the config dataclasses to {dotted key or pattern: Rule}; a key takes its exact entry, else the
longest pattern it matches (a section's `prefix.*` last), so a key the checkpoint has and this version lacks is
classified by its section. The classes (CLASSES):
- `plan` (changes the sample plan: the corpus, its buckets, the batch rule, `train.seed`) and `trained` (changes
  what is trained or its shape: `model.*` but the execution knobs, which parameters an `optim.groups` entry holds)
  are refused, because the stored plan position and optimizer state mean something else under them;
  `resume_force=true` takes them anyway, with a warning each;
- `execution` (how a step runs: the model's kernels and recompute, `data.num_workers`) and `free` (`optim.lr` and
  the other hyper-parameters, the LR schedule, `objective.*`, `train.steps`, `train.micro_batches` — which, like the
  number of processes, sets how many micro-batches a step takes from the same sample order — logging,
  checkpointing, ...) are this run's value, with one log line each. The optimizer's hyper-parameters are re-applied
  after the state is loaded (`apply_optim_config`): the LR follows the schedule from the new base rate at the
  restored step;
- `ignored` (what names this run or says how it starts: `name`, `run_dir`, `resume`, `launch.*`) is not compared.

What the checkpoint cannot serve (training/checkpoint.py's `fit_state` checks its keys before anything is read);
a switch turned on or off is not logged as a plain change:
- EMA turned on (`optim.ema_decay` null → a value): a fresh EMA starts from the loaded weights; turned off: the stored
  EMA is not loaded. The log says which.
- LoRA turned on or off (`model.lora.rank` 0 ↔ > 0) is refused up front like any `model.*` change, with the way on:
  export the checkpoint and start a new run from it (`model.pretrained`); `resume_force` cannot serve it either.
- Another optimizer type is refused (the state names differ); `resume_force=true` loads the model and EMA and starts
  the new optimizer from a fresh state.
A checkpoint whose files match their manifest but do not load is called intact, never damaged: the advice is to
resume with the config it was saved with, not to move it away.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import time
from fnmatch import fnmatchcase
from typing import Callable, NamedTuple, Optional

import yaml

from training.checkpoint import (CheckpointError, NotLoaded, files_match_manifest, list_checkpoints,
                                 verify_checkpoint)
from models.config import MODEL_CONFIGS
from training.run_configs import flatten
from training.run_folder import read_text
from training.config import TrainConfig, load_config
from training.dist import DistContext

log = logging.getLogger(__name__)

CLASSES = {  # what a resume does with a key whose value differs from the checkpoint's
    "plan": "changes the sample plan: refused unless resume_force",
    "trained": "changes what is trained or its shape: refused unless resume_force",
    "execution": "how a step runs, not what it computes: this run's value, logged",
    "free": "this run's value, logged",
    "ignored": "names this run or says how it starts: not compared",
}
REFUSED = ("plan", "trained")


class Rule(NamedTuple):
    """A key's resume class, and whether its 0 / null turns a part of the trained state off (a switch)."""
    cls: str
    switch: bool = False

    def __str__(self) -> str:
        return self.cls + " switch" * self.switch


def _declared(cls: str, where: str) -> str:
    if cls not in CLASSES:
        raise ValueError(f"{where} declares resume class {cls!r}: use one of {sorted(CLASSES)} (training/resume.py)")
    return cls


def resume_table(config, prefix: str = "", section: Optional[str] = None) -> dict[str, Rule]:
    """{dotted key or pattern: Rule} for config dataclass instance `config` (keys as `flatten` makes them), from the
    declarations beside its fields: each dataclass's RESUME_DEFAULT (a nested one without it takes `section`, its
    enclosing one's) as `prefix*`, each field's `resume` metadata or else that default, and for a dict field its
    entries (`key.*`, and `resume_under` patterns)."""
    name = type(config).__name__
    section = _declared(getattr(type(config), "RESUME_DEFAULT", section), f"{name}.RESUME_DEFAULT")
    table = {prefix + "*": Rule(section)}
    for f in dataclasses.fields(config):
        key, value = prefix + f.name, getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            table.update(resume_table(value, key + ".", section))
            continue
        rule = Rule(_declared(f.metadata.get("resume", section), f"{name}.{f.name}"), bool(f.metadata.get("switch")))
        table[key] = rule
        if isinstance(value, dict):
            table[key + ".*"] = Rule(rule.cls)
            for pattern, cls in f.metadata.get("resume_under", {}).items():
                table[f"{key}.{pattern}"] = Rule(_declared(cls, f"{name}.{f.name}[{pattern!r}]"))
    return table


@functools.lru_cache(maxsize=None)
def schema_table() -> dict[str, Rule]:
    """resume_table over this version's config, with every model architecture (`model:` takes any of them)."""
    table: dict[str, Rule] = {}
    for model in MODEL_CONFIGS.values():
        table.update(resume_table(TrainConfig(model=model())))
    return table


def resume_rule(key: str, table: Optional[dict] = None) -> Rule:
    """The Rule of dotted key `key`: its exact entry, else the longest pattern it matches (schema_table by default)."""
    table = schema_table() if table is None else table
    if key in table:
        return table[key]
    patterns = sorted((p for p in table if "*" in p), key=len, reverse=True)
    return table[next(p for p in patterns if fnmatchcase(key, p))]  # the root's "*" matches every key


def changes_plan(key: str) -> bool:
    """Whether a change of `key` is refused without resume_force (its class changes the plan or the trained state)."""
    return resume_rule(key).cls in REFUSED


def turned(key: str, a, b) -> Optional[str]:
    """'on' / 'off' where `key` is a switch (EMA's decay, LoRA's rank) turned on or off between a and b."""
    if not resume_rule(key).switch:
        return None
    was, now = bool(a), bool(b)  # ema_decay: null or a value; lora.rank: 0 or more
    return None if was == now else ("on" if now else "off")


LORA_WAY = ("the checkpoint holds a {was} weights and optimizer state, not {will}: export it (python scripts/export.py "
            "{ckpt} --out exported/NAME) and start a new run with model.pretrained=exported/NAME and the "
            "model.lora.rank you want")


def config_changes(saved: dict, now: dict) -> tuple[dict, dict]:
    """({key: (saved, now)} of a refused class (plan, trained), {key: (saved, now)} of the rest but `ignored`),
    between two plain configs already filled with their defaults (`typed_plain`)."""
    a, b = flatten(saved), flatten(now)
    plan, other = {}, {}
    for key in sorted(set(a) | set(b)):
        cls = resume_rule(key).cls
        if cls != "ignored" and a.get(key) != b.get(key):
            (plan if cls in REFUSED else other)[key] = (a.get(key), b.get(key))
    return plan, other


def typed_plain(raw: dict) -> dict:
    """A config dict with every default filled in, as this version's dataclasses make it (so a key the checkpoint
    predates compares equal at its default). A saved config this version cannot read is compared as it is."""
    try:
        return dataclasses.asdict(load_config(raw))
    except (ValueError, TypeError) as e:
        log.warning("the checkpoint's config.yaml does not load in this version (%s): compared as written", e)
        return raw


def check_config(ckpt: str, now, force: bool, is_main: bool) -> None:
    """Refuse (or, forced, warn about) plan changes; log every other change. `now` is this run's TrainConfig.
    A run resumed without a wandb group keeps the one it was started with (a Hydra multirun's sweep name): its wandb
    run is the same run, so it stays with the runs it is compared to."""
    if not os.path.lexists(os.path.join(ckpt, "config.yaml")):
        return
    try:
        saved = yaml.safe_load(read_text(ckpt, "config.yaml")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt}/config.yaml does not parse ({type(e).__name__}: {str(e)[:300]})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt}/config.yaml is not a mapping")
    group = (saved.get("logging") or {}).get("group")
    if now.logging.group is None and group is not None:
        now.logging.group = group
        if is_main:
            log.info("resume: logging.group %r kept (the run's wandb group)", group)
    plan, other = config_changes(typed_plain(saved), dataclasses.asdict(now))
    lora = plan.get("model.lora.rank")
    if lora and turned("model.lora.rank", *lora):  # no force serves it (checkpoint.fit_state refuses it too)
        on = turned("model.lora.rank", *lora) == "on"
        raise ValueError(f"resuming {ckpt} with model.lora.rank {lora[0]!r} → {lora[1]!r} turns LoRA "
                         f"{'on' if on else 'off'}; " + LORA_WAY.format(was="full model's" if on else "LoRA adapter's",
                                                                  will="an adapter's" if on else "a full model's",
                                                                  ckpt=ckpt))
    if plan and not force:
        lines = "\n".join(f"  {k}: {a!r} → {b!r}" for k, (a, b) in plan.items())
        raise ValueError(f"resuming {ckpt} with values that change the plan or the trained state:\n{lines}\n"
                         f"The stored plan position and optimizer state mean something else under them. Resume "
                         f"without those overrides, start a new run (another name), or set resume_force=true.")
    if is_main:
        for k, (a, b) in plan.items():
            log.warning("resume_force: %s %r → %r (the plan position is reread under the new plan)", k, a, b)
        for k, (a, b) in other.items():
            if turned(k, a, b):  # EMA on or off: said where the checkpoint is loaded (checkpoint.fit_state)
                continue
            log.info("resume: %s %r → %r (this run's value is used)", k, a, b)


def plan_record(batch_sizes: dict, calibration: Optional[str], world_size: int) -> dict:
    """What meta.json keeps of the plan the run made (its "plan"): the batch table (bucket → B), which lays out the
    epoch the stored position counts in (scheduling/planner.py _layout); the calibration file that set it, by path
    and content hash; the number of processes, which rescales an FSDP memory bound."""
    digest = None
    if calibration and os.path.isfile(calibration):
        with open(calibration, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return {"batch_sizes": {n: int(b) for n, b in batch_sizes.items()}, "calibration": calibration,
            "calibration_sha256": digest, "world_size": int(world_size)}


def plan_changed(saved: Optional[dict], now: dict, force: bool) -> bool:
    """Whether this run's batch table differs from the one the checkpoint's plan position counts in (`saved`: its
    meta.json "plan"; a checkpoint without one predates the check: False). Where it does, the caller starts a new
    epoch (as data.loader.corpus_changed does): the position would otherwise repeat or skip samples of this epoch.
    A table changed by the calibration file's content under the same path (a refit, --write-chosen, a re-measured
    file) changed behind the run's back: refused (ValueError) unless `force`. One changed by what this resume
    changes itself — another number of processes (an FSDP memory bound rescales with it), an execution setting
    (model.checkpointing, precision: the run plans from another record or file), another calibration file — goes on
    from a new epoch with a warning naming the cause."""
    if not saved or not isinstance(saved.get("batch_sizes"), dict) or saved["batch_sizes"] == now["batch_sizes"]:
        return False
    diff = ", ".join(f"{n} {saved['batch_sizes'].get(n)} → {now['batch_sizes'].get(n)}"
                     for n in sorted(set(saved["batch_sizes"]) | set(now["batch_sizes"]))
                     if saved["batch_sizes"].get(n) != now["batch_sizes"].get(n))
    edited = (saved.get("calibration") == now["calibration"] and saved.get("calibration_sha256")
              and saved.get("calibration_sha256") != now["calibration_sha256"])
    if edited:
        what = (f"the batch table is not the run's ({diff}): the calibration it planned with, {now['calibration']}, "
                "changed since (its content hash differs)")
        if not force:
            raise ValueError(f"resume refused: {what}. The saved plan position counts samples in the run's table, so "
                             "under another it would repeat or skip samples of this epoch. Restore that calibration "
                             "file, start a new run (another name), or set resume_force=true to go on with this table "
                             "from a new epoch.")
        log.warning("resume_force: %s; starting a new epoch under this table", what)
        return True
    if saved.get("world_size") not in (None, now["world_size"]):
        why = (f"the number of processes changed ({saved['world_size']} → {now['world_size']}), which rescales the "
               "memory bound")
    elif saved.get("calibration") != now["calibration"]:
        why = (f"the run planned with {saved.get('calibration') or 'no calibration'}, this resume with "
               f"{now['calibration']}")
    else:
        why = "a setting this resume changes (logged above as this run's value) plans other batch sizes"
    log.warning("resume: the batch table is not the run's (%s): %s. The saved position counts samples in the run's "
                "table, so this resume starts a new epoch under the new one (the rest of this epoch is not seen)",
                diff, why)
    return True


def saved_run_config(resume: str, run_dir: str) -> Optional[dict]:
    """The config the run to resume was trained with: the named checkpoint's config.yaml, or for `auto` that of the
    newest checkpoint whose config.yaml and meta.json match its manifest — a newest one damaged or cut short is
    skipped here as resume=auto skips it, so its values are not kept over those of the one loaded. None where there
    is none or it does not read (the resume itself then says why)."""
    path = named_checkpoint(resume, run_dir) if resume != "auto" else next(
        (p for _, p in reversed(list_checkpoints(run_dir)) if files_match_manifest(p, ("meta.json", "config.yaml"))),
        None)  # newest first, hashing no more than it must
    if path is None:
        return None
    try:
        saved = yaml.safe_load(read_text(path, "config.yaml"))
    except (OSError, ValueError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return saved if isinstance(saved, dict) else None


def keep_run_values(raw: dict, saved: dict, given: set[str]) -> list[tuple[str, object, object]]:
    """Resuming continues the run's config with this command line's changes, not with the defaults: a key that may
    change on resume (not refused, not ignored) whose value differs from the run's, and that the command line does
    not name (itself, or a group above it: `optim=adafactor` names optim.*), keeps the run's value — a swept
    optim.lr stays the sweep's, not the default's. raw (this run's plain config) is changed in place; returns
    [(key, the config's value, the run's, kept)]."""
    a, b = flatten(saved), flatten(raw)
    kept = []
    for key in sorted(set(a) & set(b)):
        if a[key] == b[key] or resume_rule(key).cls in (*REFUSED, "ignored"):
            continue
        if any(key == g or key.startswith(g + ".") for g in given):
            continue
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = a[key]
        kept.append((key, b[key], a[key]))
    return kept


def named_checkpoint(resume: str, run_dir: str) -> str:
    """The folder resume=<name> means: a bare name (no folder in it: resume=step_200) is run_dir's checkpoint of that
    name where run_dir has one, whatever the current folder holds; a path is the path as given."""
    inside = os.path.join(run_dir, resume)
    bare = os.path.basename(os.path.normpath(resume)) == resume
    return inside if bare and os.path.isdir(inside) else resume


def candidates(resume: str, run_dir: str) -> list[str]:
    """The checkpoints to try, in order: newest first for `auto`, the named one otherwise."""
    if resume == "auto":
        return [p for _, p in reversed(list_checkpoints(run_dir))]
    path = named_checkpoint(resume, run_dir)
    if not os.path.isdir(path):
        raise ValueError(f"resume={resume}: no such folder, as given or in run_dir ({run_dir}); name a checkpoint "
                         f"folder (runs/NAME/step_N, or step_N of this run), or resume=auto to take the newest one")
    if not os.path.exists(os.path.join(path, "meta.json")):
        raise ValueError(f"resume={resume}: {path} holds no meta.json, so it is no complete checkpoint (a step_N "
                         "folder); use resume=auto to take the newest one in run_dir")
    return [path]


def resume(resume: Optional[str], run_dir: str, ctx: DistContext, load: Callable[[str], dict]) -> tuple[Optional[str], Optional[dict]]:
    """(path, meta) of the checkpoint loaded by `load(path) -> meta`, or (None, None) when there is none to take.

    With `auto` a checkpoint that fails verification or loading is skipped with a warning; a named one raises. A
    config this checkpoint cannot serve (a ValueError from `load` that is no CheckpointError) raises at once. One whose
    files match their manifest but fail to load is called intact: the advice never says to move it away."""
    if not resume:
        return None, None
    if resume == "auto" and not list_checkpoints(run_dir) and ctx.is_main:
        log.warning("resume=auto: %s holds no checkpoint, so this run starts from scratch (if you meant to go on with "
                    "another run, check name= or run_dir=)", run_dir)
    intact = []  # verified, yet not loaded: the cause is between it and this run, not in its files
    for path in candidates(resume, run_dir):
        problem = verify_checkpoint(path, ctx)
        if problem is None:
            try:
                meta = load(path)
            except CheckpointError as e:
                problem = str(e)
                if isinstance(e, NotLoaded):
                    intact.append(path)
            else:
                if resume != "auto":
                    meta["lineage"] = branch(run_dir, path, meta, ctx)
                return path, meta
        if resume != "auto":
            raise ValueError(f"resume={path}: {problem}" + (f"\n{INTACT}" if intact else ""))
        log.warning("resume=auto: skipping %s: %s; trying the next older checkpoint", path, problem)
    if resume == "auto" and intact:
        raise ValueError(f"resume=auto: no checkpoint in {run_dir} could be loaded (each one's problem is logged "
                         f"above). {', '.join(os.path.basename(p) for p in intact)}: {INTACT}")
    if resume == "auto" and list_checkpoints(run_dir):
        raise ValueError(f"resume=auto: no checkpoint in {run_dir} could be loaded (each one's problem is logged "
                         f"above); move the damaged ones away to start from scratch")
    return None, None


INTACT = ("its files match their manifest (intact, not damaged): the load failed on what this run asks of it. Keep "
          "it; resume with the config it was saved with (its config.yaml), or start a new run under another name")


def nothing_to_do(ckpt: str, step: int, steps: int) -> str:
    """What a resume whose checkpoint is already at or past train.steps says before it stops (exit status 0)."""
    return (f"nothing to do: {ckpt} is at step {step} and train.steps={steps}, so no step is left to train; raise "
            f"train.steps (e.g. train.steps={step + max(steps, 1)}) to go on from it")


def branch(run_dir: str, path: str, meta: dict, ctx: DistContext) -> dict:
    """After an explicit resume from `path`: move run_dir's newer checkpoints aside (abandoned) and return the
    lineage the new branch carries. Without newer ones the run simply continues (its lineage unchanged)."""
    lineage = dict(meta.get("lineage") or {})
    newer = [p for s, p in list_checkpoints(run_dir) if s > meta["step"]]
    if not newer:
        return lineage
    inside = os.path.isdir(run_dir) and os.path.samefile(os.path.dirname(os.path.abspath(path)), run_dir)
    aside = ctx.broadcast_object(os.path.join(run_dir, time.strftime("abandoned-%Y%m%d-%H%M%S")))
    if ctx.is_main:
        os.makedirs(aside, exist_ok=True)
        for p in newer:
            os.rename(p, os.path.join(aside, os.path.basename(p)))
        log.warning("resume=%s starts a branch: the newer checkpoints %s are abandoned, moved to %s (kept; "
                    "resume=auto no longer takes them)%s", path, ", ".join(os.path.basename(p) for p in newer), aside,
                    f"; {os.path.basename(path)} is kept as the rollback point" if inside else "")
    ctx.barrier()
    abandoned = [os.path.join(os.path.basename(aside), os.path.basename(p)) for p in newer]
    return {"rollback_point": os.path.basename(path) if inside else None,
            "abandoned": lineage.get("abandoned", []) + abandoned}


def optim_hyperparameters(optimizer) -> list[dict]:
    """The per-group values this run's config gives (taken before a checkpoint's state replaces them)."""
    return [{k: g[k] for k in ("initial_lr", "weight_decay", "betas", "eps", "foreach", "fused") if k in g}
            for g in optimizer.param_groups]


def apply_optim_config(optimizer, scheduler, fresh: list[dict]) -> None:
    """Put this run's hyper-parameters back over a loaded optimizer state, and the LR the schedule gives at the
    restored step from the new base rates (the formula the scheduler itself applies each step)."""
    if len(fresh) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(optimizer.param_groups)} parameter groups, this "
                         f"config makes {len(fresh)}: optim.groups or the trainable parameters changed")
    for i, (g, f) in enumerate(zip(optimizer.param_groups, fresh)):
        g.update(f)
        scheduler.base_lrs[i] = f["initial_lr"]
    lrs = [base * lam(scheduler.last_epoch) for base, lam in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    scheduler._last_lr = lrs
