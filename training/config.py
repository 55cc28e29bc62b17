"""The run's typed configuration: the composed Hydra dict → nested dataclasses, checked before any compute.

Each component keeps its own dataclass beside it (models/config.py, data/config.py, scheduling/config.py,
training/optim.py, ...); this file composes them and turns a plain dict into them, refusing unknown keys and
wrong types with a ValueError that names the field. No code below train.py sees a DictConfig.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from data.config import DataConfig
from models.config import MODEL_CONFIGS, ModelConfig
from models.flow_matching import ObjectiveConfig
from models.sampler import SampleConfig
from scheduling.config import SchedulingConfig
from training.metrics_log import LoggingConfig, MetricsConfig
from training.optim import OptimConfig


@dataclass
class LaunchConfig:
    num_processes: int = 1  # processes on this node; train.py starts them when no launcher did

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"launch.num_processes must be ≥ 1, got {self.num_processes}")


@dataclass
class LoopConfig:
    steps: int = 60
    seed: int = 0
    micro_batches: int = 2      # M: micro-batches per rank per optimizer step (gradient accumulation)
    log_every: int = 1
    val_every: int = 20
    max_bad_steps: int = 5      # NaN/Inf losses in a row before the run stops
    progress: bool = True
    sample_every: int = 0       # steps between validation clips (sample:) in run_dir/samples/; 0: never
    gc_every: int = 50          # steps between Python garbage collections (paused inside steps); 0: Python's own

    def __post_init__(self):
        for name in ("steps", "micro_batches", "log_every", "val_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be ≥ 1, got {getattr(self, name)}")
        for name, what in (("sample_every", "never"), ("gc_every", "Python's own schedule")):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be ≥ 0 (0: {what}), got {getattr(self, name)}")


@dataclass
class CheckpointConfig:
    every: int = 0              # steps between checkpoints; 0: only at the end and on SIGTERM/SIGINT
    keep_last: int = 2
    at_end: bool = True

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be ≥ 0, got {self.every}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be ≥ 1, got {self.keep_last}")


@dataclass
class TrainConfig:
    name: str = "default"
    run_dir: str = "runs/default"
    resume: Optional[str] = None  # null | auto | a checkpoint folder
    show_buckets: bool = False
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
        if not self.name or "/" in self.name:
            raise ValueError(f"name must be a non-empty string without '/', got {self.name!r}")
        if self.resume not in (None, "auto") and not isinstance(self.resume, str):
            raise ValueError(f"resume must be null, 'auto' or a checkpoint folder, got {self.resume!r}")


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, where) if len(args) == 1 else value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        return from_dict(tp, value, where + ".")
    if tp is Any or value is None and tp in (dict, list):
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    if tp in (tuple, list, dict) or origin in (tuple, list, dict):
        want = origin or tp
        if not isinstance(value, (list, tuple) if want in (tuple, list) else dict):
            raise ValueError(f"{where} must be a {want.__name__}, got {value!r}")
        return want(value)
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
    from data.buckets import bucket_table

    table = bucket_table(cfg.data.buckets)  # validates every bucket
    if cfg.train.sample_every and cfg.model.name != "wan":
        raise ValueError(f"train.sample_every={cfg.train.sample_every} samples validation clips with Wan's sampler; "
                         f"model.name={cfg.model.name} needs its text mask and pooled text there, not yet wired: set "
                         "train.sample_every=0")
    if cfg.sample.bucket is not None and cfg.sample.bucket not in table:
        raise ValueError(f"sample.bucket={cfg.sample.bucket!r} is not in data.buckets ({sorted(table)})")
    if cfg.data.synthetic.mix and cfg.data.index is None and cfg.data.sources is None:
        unknown = set(cfg.data.synthetic.mix) - set(table)
        if unknown:
            raise ValueError(f"data.synthetic.mix names buckets {sorted(unknown)} missing from data.buckets")
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
    if sc.strategy in ("cost", "balanced") and sc.calibration is None:
        raise ValueError(f"scheduling.strategy={sc.strategy} predicts step times from a cost model: set "
                         "scheduling.calibration (scripts/calibrate.py writes one)")
