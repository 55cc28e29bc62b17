"""The run's typed configuration: the composed Hydra dict → nested dataclasses, checked before any compute.

Each component keeps its own dataclass beside it (models/config.py, data/config.py, scheduling/config.py,
training/optim.py, ...); this file composes them and turns a plain dict into them, refusing unknown keys and
wrong types with a ValueError that names the field. No code below train.py sees a DictConfig.

Numbers are checked here once for every field, before any dataclass sees them: an `int` or `float` field (and
every number inside a typed list, tuple or dict field) must be a finite number of that type (not a bool, not a
string; an `int` field takes no fractional part), and any number inside an untyped container (a dict of
encoder kwargs, a list of sources) must be finite. NaN would slip through the range checks (every comparison
with it is false) and ±Inf through one-sided ones, so the ranges in each `__post_init__` assume finite values.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from data.config import DataConfig
from models.config import CHECKPOINTING, MODEL_CONFIGS, ModelConfig
from models.flow_matching import ObjectiveConfig
from models.sampler import SampleConfig
from scheduling.config import SchedulingConfig
from training.metrics import LoggingConfig, MetricsConfig
from training.optim import OptimConfig
from training.shared_gpu import check_mode


MAX_PROCESSES = 256  # processes train.py starts on one node (8-16 GPUs; CPU processes for tests)
MAX_LAYERS = 1024    # transformer blocks: the largest video DiTs have 60; a typo's 10^6 would build for hours


@dataclass
class LaunchConfig:
    RESUME_DEFAULT = "ignored"  # how this run starts: another number of processes resumes alike
    num_processes: int = 1  # processes on this node; train.py starts them when no launcher did
    device: str = "auto"    # auto | cuda | cpu: cuda refuses a machine without a GPU for every local process
    cpu_threads: Optional[int] = None  # intra-op threads per CPU process; null: OMP_NUM_THREADS, else 1
    force: bool = False     # on CPUs, run even where the estimated host memory exceeds this machine's RAM (a GPU
                            # preset with launch.device=cpu is refused there otherwise: training/host_memory.py)
    debug_share_gpu: Optional[str] = None  # debug only: several ranks on one GPU (nccl | gloo | host), to rehearse
                                           # the multi-rank CUDA code; training/shared_gpu.py

    def __post_init__(self):
        if not 1 <= self.num_processes <= MAX_PROCESSES:
            raise ValueError(f"launch.num_processes must lie in [1, {MAX_PROCESSES}] (processes on this node; more "
                             f"nodes: a multi-node launcher), got {self.num_processes}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"launch.device must be auto, cuda or cpu, got {self.device!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"launch.cpu_threads must be ≥ 1 or null, got {self.cpu_threads}")
        check_mode(self.debug_share_gpu)


@dataclass
class LoopConfig:
    RESUME_DEFAULT = "free"
    steps: int = 60
    seed: int = field(default=0, metadata={"resume": "plan"})  # in [0, 2^64)
    micro_batches: int = 2      # M: micro-batches per rank per optimizer step (gradient accumulation)
    log_every: int = 1
    val_every: int = 20
    max_bad_steps: int = 5      # NaN/Inf losses in a row before the run stops
    progress: bool = True
    sample_every: int = 0       # steps between validation clips (sample:) in run_dir/samples/; 0: never
    gc_every: int = 50          # steps between Python garbage collections (paused inside steps); 0: Python's own
    cuda_graphs: str = "auto"   # auto | on | off: micro-batches replayed as CUDA graphs (training/cuda_graphs.py)
    graph_max_tokens: int = 16384  # micro-batches of more tokens (B·S) stay eager: their kernels hide the host

    def __post_init__(self):
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"train.cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        for name in ("steps", "micro_batches", "log_every", "val_every", "max_bad_steps", "graph_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be ≥ 1, got {getattr(self, name)}")
        for name, what in (("sample_every", "never"), ("gc_every", "Python's own schedule")):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be ≥ 0 (0: {what}), got {getattr(self, name)}")
        if not 0 <= self.seed < 2**64:  # torch.manual_seed's range; numpy's default_rng refuses negative seeds
            raise ValueError(f"train.seed must lie in [0, 2^64), got {self.seed}")


@dataclass
class CheckpointConfig:
    RESUME_DEFAULT = "free"
    every: int = 0              # steps between checkpoints; 0: only at the end and on SIGTERM/SIGINT
    keep_last: int = 2
    at_end: bool = True

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be ≥ 0, got {self.every}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be ≥ 1, got {self.keep_last}")


IGNORED = {"resume": "ignored"}  # field metadata: names this run or how it starts, not compared on resume


@dataclass
class TrainConfig:
    # Each field's resume class (what a resume does when its value differs from the checkpoint's) is declared here
    # and beside each section's fields: RESUME_DEFAULT and field metadata, read by training/resume.py.
    RESUME_DEFAULT = "free"
    name: str = field(default="default", metadata=IGNORED)
    run_dir: str = field(default="runs/default", metadata=IGNORED)
    resume: Optional[str] = field(default=None, metadata=IGNORED)  # null | auto | a checkpoint folder
    resume_force: bool = field(default=False, metadata=IGNORED)  # resume even where the config changes the plan
                                                                 # or the trained state
    overwrite: bool = field(default=False, metadata={"resume": "ignored"})  # a fresh run into a folder holding
                                  # another: its files move aside (run_folder.py); how a run starts, never kept
    show_buckets: bool = field(default=False, metadata=IGNORED)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    model: Any = field(default_factory=ModelConfig)  # ModelConfig | MMDiTConfig, chosen by model.name
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        check_name(self.name)
        if self.resume not in (None, "auto") and not isinstance(self.resume, str):
            raise ValueError(f"resume must be null, 'auto' or a checkpoint folder, got {self.resume!r}")


def check_name(name: str) -> None:
    """`name` is a plain folder name: the run's folder is runs/<name>, so `..` would be the repository and `.` the
    runs/ folder itself."""
    seps = {"/", "\\", "\0"} | {os.sep} | ({os.altsep} if os.altsep else set())
    if name in ("", ".", "..") or any(s in name for s in seps) or name != name.strip():
        raise ValueError(f"name must be a plain folder name (not empty, '.' or '..', no '/' or '\\', no leading or "
                         f"trailing space): the run's folder is runs/<name>; got name={name!r}")


def config_warnings(cfg: "TrainConfig") -> list[str]:
    """Values that are allowed but probably not meant (train.py logs each)."""
    out = []
    if cfg.optim.warmup_steps > cfg.train.steps:
        out.append(f"optim.warmup_steps={cfg.optim.warmup_steps} is more than train.steps={cfg.train.steps}: the LR "
                   f"never reaches optim.lr={cfg.optim.lr:g} (it ends at {cfg.train.steps / cfg.optim.warmup_steps:.0%}"
                   f" of it); lower optim.warmup_steps")
    return out


def _number(tp, value, where: str):
    """A finite int (no fractional part) or float for field `where`; bools and strings are refused."""
    what = "an integer" if tp is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be {what}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an int past the float range
        raise ValueError(f"{where} must be a finite number, got {value!r}") from None


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0] if len(args) == 1 else Any, value, where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        return from_dict(tp, value, where + ".")
    if tp is Any:  # no declared type: only the numbers inside are checked (finite), wherever they sit
        if isinstance(value, dict):
            return {k: _coerce(Any, v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(_coerce(Any, v, f"{where}[{i}]") for i, v in enumerate(value))
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number, got {value!r}")
        return value
    if value is None and tp in (dict, list):
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if tp in (int, float):
        return _number(tp, value, where)
    if tp is str:
        if not isinstance(value, str):
            values = {"model.checkpointing": CHECKPOINTING}.get(where)
            hint = (" (YAML and the command line read an unquoted true, false, on or off as a boolean: name "
                    + (f"one of {', '.join(values)})" if values else "one of the key's values)")
                    if isinstance(value, bool) else "")
            raise ValueError(f"{where} must be a string, got {value!r}{hint}")
        return value
    if tp in (tuple, list, dict) or origin in (tuple, list, dict):
        want, args = origin or tp, typing.get_args(tp)
        if not isinstance(value, (list, tuple) if want in (tuple, list) else dict):
            raise ValueError(f"{where} must be a {want.__name__}, got {value!r}")
        if want is dict:
            return {k: _coerce(args[1] if args else Any, v, f"{where}.{k}") for k, v in value.items()}
        if want is tuple and args and args[-1] is not Ellipsis:  # tuple[int, int, int]: a fixed length
            if len(value) != len(args):
                raise ValueError(f"{where} must hold {len(args)} values, got {value!r}")
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        return want(_coerce(args[0] if args else Any, v, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def from_dict(cls, d: dict, where: str = ""):
    """Build dataclass `cls` from a nested plain dict; unknown keys and wrong types name their field."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        keys = ", ".join(f"{where}{k}" for k in unknown)
        raise ValueError(f"unknown config key(s) {keys}; known here: {sorted(names)}")
    kwargs = {k: _coerce(hints[k], v, f"{where}{k}") for k, v in d.items()}
    return cls(**kwargs)


def load_config(d: dict) -> TrainConfig:
    model = dict(d.get("model") or {})
    name = model.get("name", "wan")
    if name not in MODEL_CONFIGS:
        raise ValueError(f"model.name must be one of {sorted(MODEL_CONFIGS)}, got {name!r}")
    cfg = from_dict(TrainConfig, {**d, "model": from_dict(MODEL_CONFIGS[name], model, "model.")})
    _check_cross_fields(cfg)
    return cfg


def _check_cross_fields(cfg: TrainConfig) -> None:
    from data.buckets import bucket_table, near_name

    m = cfg.model
    if m.attention_layers > MAX_LAYERS:
        raise ValueError(f"model.num_layers: {m.attention_layers} transformer blocks is past the {MAX_LAYERS} this "
                         f"trainer builds; lower model.num_layers (and model.num_single_layers for the MMDiT)")
    if cfg.optim.warmup_steps > 100 * cfg.train.steps:
        raise ValueError(f"optim.warmup_steps={cfg.optim.warmup_steps} is more than 100 × train.steps="
                         f"{cfg.train.steps}: the LR would stay under 1 % of optim.lr for the whole run; lower "
                         "optim.warmup_steps")
    table = bucket_table(cfg.data.buckets, patch=m.patch)  # validates every bucket against the model's patch
    if m.text_len > cfg.data.encoders.max_text_len:
        # The text encoder keeps at most max_text_len tokens per caption, so every text position past it is zero
        # padding on every sample: attention compute and memory spent on nothing (diffusers' pipelines pad to the
        # length they truncate at: 512 for Wan's UMT5, 256 for HunyuanVideo's LLaMA).
        raise ValueError(f"model.text_len={m.text_len} exceeds data.encoders.max_text_len="
                         f"{cfg.data.encoders.max_text_len}, the most tokens the text encoder keeps per caption: "
                         "lower model.text_len (or raise data.encoders.max_text_len)")
    rope_max = m.rope_max_seq_len  # Wan's RoPE covers this many positions per axis (the MMDiT's: any)
    if rope_max is not None:
        for name, b in table.items():
            grid = b.patch_grid
            if max(grid) > rope_max:
                raise ValueError(f"data.buckets.{name} is a {grid} (t, h, w) patch grid, past "
                                 f"model.rope_max_seq_len={rope_max}: raise it or use a smaller bucket")
    if cfg.train.sample_every and cfg.model.name != "wan":
        raise ValueError(f"train.sample_every={cfg.train.sample_every} samples validation clips with Wan's sampler; "
                         f"model.name={cfg.model.name} needs its text mask and pooled text there, not yet wired: set "
                         "train.sample_every=0")
    if cfg.sample.bucket is not None and cfg.sample.bucket not in table:
        near = near_name(cfg.sample.bucket, table)
        raise ValueError(f"sample.bucket={cfg.sample.bucket!r} is not in data.buckets ({sorted(table)})"
                         + (f": a typo for {near}?" if near else ""))
    if cfg.data.synthetic.mix and cfg.data.index is None and cfg.data.sources is None:
        unknown = set(cfg.data.synthetic.mix) - set(table)
        if unknown:
            raise ValueError(f"data.synthetic.mix names buckets {sorted(unknown)} missing from data.buckets"
                             + "".join(f"; is {n} a typo for {near}?" for n in sorted(unknown)
                                       if (near := near_name(n, table))))
    sc = cfg.scheduling
    if sc.m_mem is not None:
        too_long = [n for n, b in table.items() if b.tokens > sc.m_mem]
        if too_long:
            raise ValueError(f"scheduling.m_mem={sc.m_mem:g} is below the tokens S of buckets {too_long} "
                             f"(S up to {max(b.tokens for b in table.values())}): raise it or drop those buckets")
    if sc.strategy == "equal_token" and sc.m_tokens is None and sc.calibration is None:
        raise ValueError("scheduling.m_tokens must be set for the equal_token strategy "
                         "(tokens per micro-batch, e.g. the largest bucket's S)")
    if sc.strategy == "dual_constraint" and sc.calibration is None and None in (sc.m_mem, sc.m_comp, sc.p):
        raise ValueError("scheduling.dual_constraint needs scheduling.m_mem, scheduling.m_comp and scheduling.p "
                         "(or scheduling.calibration to fit them)")
    if sc.calibration is None:  # no file to take m_mem from: planner=reformed refused before any process starts
        from scheduling.planner import check_m_mem

        check_m_mem(sc.planner, sc.m_mem)
    if sc.strategy in ("cost", "balanced") and sc.calibration is None:
        raise ValueError(f"scheduling.strategy={sc.strategy} predicts step times from a cost model: set "
                         "scheduling.calibration (scripts/calibrate.py writes one)")


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose_config(overrides=()) -> TrainConfig:
    """The typed run config from conf/ and Hydra-style overrides (`conf=NAME` picks a preset), composed as train.py
    composes it: what every script that takes KEY=VALUE overrides reads."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        raw = OmegaConf.to_container(compose(config_name="train", overrides=list(overrides)), resolve=True)
    raw.pop("hydra", None)
    return load_config(raw)


def unknown_override_keys(overrides: list[str], groups: set[str]) -> list[str]:
    """For each command-line override whose key no config can hold — a typo like `train.step=20` — what it should
    say: the key, and the nearest known one. Hydra's own refusal suggests appending the key (`+train.step=20`), which
    load_config then refuses too; this runs before Hydra. Checked: keys into the config's dataclasses (model.* against
    every model's fields); not checked: keys with + ~ @ or / (Hydra's group paths: hydra/job_logging=disabled),
    hydra.*, config-group choices (`groups`: conf, scheduling, ...), and anything below a dict or list field (bucket
    names, optim.groups), which load_config and the data checks name. Nothing is checked where the command line adds
    config folders (--config-dir, --config-path, --config-name or hydra.searchpath): their groups are not known here."""
    if any(a.split("=", 1)[0] in ("-cd", "--config-dir", "-cp", "--config-path", "-cn", "--config-name")
           or a.startswith(("hydra.searchpath", "+hydra.searchpath", "++hydra.searchpath")) for a in overrides):
        return []
    out = []
    for arg in overrides:
        key, eq, _ = arg.partition("=")
        if (not eq or arg.startswith("-") or key.startswith(("+", "~")) or "@" in key or "/" in key
                or key.split(".")[0] == "hydra"):
            continue
        if key in groups:
            continue
        level, path = [TrainConfig], []
        for part in key.split("."):
            names = {f.name: typing.get_type_hints(c)[f.name] for c in level for f in dataclasses.fields(c)}
            if part not in names:
                near = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
                where = ".".join(path) or "the config"
                out.append(f"{key}: {where} has no key {part!r}" + (f" (did you mean {'.'.join(path + near)}?)"
                                                                      if near else f"; known: {sorted(names)}"))
                break
            path.append(part)
            tp = names[part]
            if part == "model" and len(path) == 1:
                level = list(MODEL_CONFIGS.values())
            elif dataclasses.is_dataclass(tp):
                level = [tp]
            else:
                break  # a value, a dict or a list: what lies below is load_config's to check
    return out
