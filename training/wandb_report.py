"""A wandb report that compares the runs of one group, line by line, built through wandb's public API.

Two layers, so that what the report shows is testable without a server:

    panel_definitions(entity, project, group, x, metrics, group_by)   pure: one plain dict per panel; no network
    build_report(panels, title)                              a wandb_workspaces Report object (offline; not saved)
    check_ready() / save_report(report)                      online only: the package, the mode, an API key
    group_configs(entity, project, group)                    online only: the configs of the group's runs

Every panel is a line plot of one metric against an x-axis the trainer logs (`samples_seen` by default, so runs with
different batch tables line up), over the runs whose wandb group is `group` (MetricsLogger's `group`: logging.group,
a Hydra multirun's `name`), grouped by config keys (MetricsLogger logs the resolved config as wandb's config): one
line per value, the mean over its runs with a min–max band. Which keys: the ones the user names, else those whose
values differ between the group's runs (training/run_configs.py: optim.lr for an LR sweep), else
`scheduling.strategy`. With several keys the run set is grouped by all of them and each plot follows it.

Sections (a panel's `section`): `throughput` for perf/*, `balance` for balance/*, `loss` for train/loss and
val/loss; any other key is filed under its namespace. The metric names are docs/contracts.md §9's.

The report layer needs `wandb-workspaces` (`import wandb_workspaces.reports.v2`), imported only when used: it
replaced `wandb.apis.reports`, which in current wandb only says to install it.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from training.metrics import X_AXES
from training.run_configs import differing_keys

X_CHOICES = (*X_AXES, "_step")   # samples_seen / tokens_seen as logged; _step: wandb's step (optimizer steps)
STRATEGY_KEY = "scheduling.strategy"   # the path in the resolved config that names a run's strategy
GROUP_BY = f"config.{STRATEGY_KEY}"
DEFAULT_METRICS = ("perf/tokens_per_s",
                   "balance/busy_cv", "balance/idle_fraction", "balance/compute_cv_pred", "balance/step_time_cv",
                   "train/loss", "val/loss")
TITLES = {
    "perf/tokens_per_s": "throughput: global latent tokens/s",
    "perf/samples_per_s": "throughput: global samples/s",
    "perf/mfu": "throughput: MFU",
    "balance/busy_cv": "balance: measured busy CV over ranks (profiled steps)",
    "balance/idle_fraction": "balance: measured idle fraction (profiled steps)",
    "balance/compute_cv_pred": "balance: predicted compute CV over ranks",
    "balance/idle_fraction_pred": "balance: predicted idle fraction",
    "balance/step_time_cv": "balance: step-time CV (measured ÷ planned, last 50 steps)",
    "train/loss": "loss: train",
    "val/loss": "loss: validation (fixed batch, t and noise)",
}
SECTIONS = {"perf": "throughput", "balance": "balance"}
WORKSPACES_PIN = "wandb-workspaces==0.4.13"   # the version this module was written and tested against
FILTER_UNSAFE = "'\"<=>\\"
SYNC_HINT = "wandb sync runs/*/wandb/offline-run-*"


def section(metric: str) -> str:
    """throughput | balance | loss, else the metric's namespace."""
    if metric.endswith("loss"):
        return "loss"
    ns = metric.split("/", 1)[0]
    return SECTIONS.get(ns, ns)


def panel_definitions(entity: str, project: str, group: str, x: str = "samples_seen",
                      metrics: Sequence[str] = DEFAULT_METRICS,
                      group_by: Sequence[str] = (STRATEGY_KEY,)) -> list[dict]:
    """One dict per metric, in the order given: {title, section, entity, project, x, y: [metric],
    group_by: ["config.<key>", ...], filters: {group}}. ValueError for an empty name, an x-axis the trainer does not
    log, a bad metric list or a bad config key."""
    for field_name, value in (("entity", entity), ("project", project), ("group", group)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{field_name} must be a non-empty name, got {value!r}")
    if set(group) & set(FILTER_UNSAFE) or not group.isprintable():
        # the report's run filter is a quoted expression that wandb_workspaces parses without escapes
        raise ValueError(f"group must not contain any of {FILTER_UNSAFE} or control characters, got {group!r}: "
                         f"rename the runs' group (logging.group)")
    if x not in X_CHOICES:
        raise ValueError(f"x must be one of {X_CHOICES} (what the trainer logs as x-axes), got {x!r}")
    metrics = list(metrics)
    if not metrics or any(not isinstance(m, str) or not m.strip() for m in metrics):
        raise ValueError(f"metrics must be one or more metric names (docs/contracts.md §9, e.g. perf/tokens_per_s), "
                         f"got {metrics!r}")
    if len(set(metrics)) != len(metrics) or x in metrics:
        raise ValueError(f"metrics must be distinct and must not repeat the x-axis {x!r}, got {metrics!r}")
    group_by = list(group_by)
    if not group_by or any(not isinstance(k, str) or not k.strip() or set(k) & set(FILTER_UNSAFE + " ")
                           for k in group_by) or len(set(group_by)) != len(group_by):
        raise ValueError(f"group_by must be one or more distinct config keys as dotted paths (optim.lr, "
                         f"scheduling.strategy), got {group_by!r}")
    by = [f"config.{k}" for k in group_by]
    return [{"title": TITLES.get(m, m), "section": section(m), "entity": entity, "project": project, "x": x,
             "y": [m], "group_by": by, "filters": {"group": group}} for m in metrics]


def _workspaces():
    """wandb_workspaces.reports.v2, or RuntimeError saying how to install it."""
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError as e:
        raise RuntimeError(f"building a wandb report needs the wandb-workspaces package: "
                           f"pip install {WORKSPACES_PIN}   (offline, scripts/compare_runs.py compares runs "
                           f"from their metrics.jsonl instead)") from e
    return wr


def build_report(panels: list[dict], title: Optional[str] = None, description: Optional[str] = None):
    """A wandb_workspaces Report from panel_definitions' dicts: one panel grid whose run set holds the group's runs,
    grouped by the panels' config keys, and one line plot per panel (grouped by the key where there is one; with
    several, by the run set's grouping). Builds the object only: nothing is sent until save_report. ValueError where
    the panels disagree on entity, project, group or grouping."""
    if not panels:
        raise ValueError("panels is empty: make them with panel_definitions(...)")
    shared = {(p["entity"], p["project"], p["filters"]["group"], tuple(p["group_by"])) for p in panels}
    if len(shared) != 1:
        raise ValueError(f"all panels must share entity, project, group and group_by (one run set), got {shared}")
    entity, project, group, group_by = shared.pop()
    if not group_by or not all(k.startswith("config.") for k in group_by):
        raise ValueError(f"group_by must name config keys as config.<path>, got {list(group_by)!r}")
    wr = _workspaces()
    from wandb_workspaces import expr

    run_filter = f"Metric('Group') == '{group}'"
    parsed = expr.expr_to_filters(run_filter)   # what save() will send: the group must come back unchanged
    if (parsed.key.section, parsed.key.name, parsed.value) != ("run", "group", group):
        raise ValueError(f"wandb_workspaces reads the run filter {run_filter!r} as {parsed.key.name} "
                         f"{parsed.op} {parsed.value!r}: rename the runs' group (logging.group) to plain characters")
    runset = wr.Runset(entity=entity, project=project, name=f"group {group}", filters=run_filter,
                       groupby=list(group_by))
    keys = [k[len("config."):] for k in group_by]
    line_by = wr.Config(keys[0]) if len(keys) == 1 else None
    plots = [wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]), groupby=line_by,
                         groupby_aggfunc="mean", groupby_rangefunc="minmax") for p in panels]
    named = " × ".join(keys)
    description = description or (f"Runs of wandb group {group}: one line per {named} (the mean over its runs, "
                                  f"min–max band), against {panels[0]['x']}.")
    return wr.Report(entity=entity, project=project, title=title or f"{group}: by {named}",
                     description=description, blocks=[wr.PanelGrid(runsets=[runset], panels=plots)])


def check_ready() -> None:
    """RuntimeError, naming the fix, unless a report can be saved: the package is installed, WANDB_MODE is not
    offline or disabled, and wandb has an API key that its server accepts (wandb.Api() reads the key from
    WANDB_API_KEY or ~/.netrc, refusing at once where there is none, and verifies it with the server)."""
    _workspaces()
    mode = os.environ.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun"):
        raise RuntimeError(f"WANDB_MODE={mode}: a report is made on the wandb server. Run with WANDB_MODE=online "
                           f"(or unset it), after `wandb login`; runs logged offline must be uploaded first: "
                           f"{SYNC_HINT}")
    import wandb

    try:
        wandb.Api()
    except wandb.errors.UsageError as e:
        raise RuntimeError(f"wandb has no API key ({e}). Run `wandb login` (or set WANDB_API_KEY), and upload "
                           f"runs logged offline with {SYNC_HINT}") from e
    except wandb.errors.AuthenticationError as e:
        raise RuntimeError(f"wandb could not verify the API key ({e}): check it with `wandb login --relogin` and "
                           f"that the server (WANDB_BASE_URL, default https://api.wandb.ai) can be reached") from e


def default_group_by(configs: Sequence[dict]) -> list[str]:
    """The config keys whose values differ between these runs' configs (training/run_configs.py), else
    scheduling.strategy."""
    return differing_keys(configs) or [STRATEGY_KEY]


def group_configs(entity: str, project: str, group: str) -> list[dict]:
    """The configs of the runs in wandb group `group` (online: wandb.Api; check_ready first)."""
    import wandb

    return [dict(r.config) for r in wandb.Api().runs(f"{entity}/{project}", filters={"group": group})]


def save_report(report) -> str:
    """Save the report on the server (check_ready first); returns its URL."""
    check_ready()
    report.save()
    return report.url
