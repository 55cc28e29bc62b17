"""Run under `torchrun --nproc_per_node 2` by tests/test_distributed.py: train.py's run() on the Hydra overrides
argv[2:], recording on every rank, step by step, the plan plan_step returned (every rank's micro-batches: B, S,
sample ids, loss weights), the micro-batches this rank trained (B, S) with its loss sum, and the metrics row the
loop logs (every rank computes it; only rank 0 writes it). Checks nothing itself; writes rank r's record as JSON to
argv[1]/rank<r>.json."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from tests.helpers import run_training  # noqa: E402


def main(out: str, overrides: list[str]) -> None:
    plans, trained, rows = [], [], []
    plan_step, train_step = train.plan_step, train.train_step

    def recording_plan(*args, **kw):
        plan, nxt = plan_step(*args, **kw)
        plans.append([[{"B": mb.B, "S": mb.S, "ids": list(mb.ids), "weights": list(mb.weights)} for mb in row]
                      for row in plan.ranks])
        return plan, nxt

    def recording_step(*args, **kw):
        st = train_step(*args, **kw)
        trained.append({"B": st.B, "S": st.S, "loss_sum": st.loss_sum})
        return st

    class RecordingLogger(train.MetricsLogger):
        def log_metrics(self, step, metrics):
            rows.append({"step": step, **metrics})
            super().log_metrics(step, metrics)

    train.plan_step, train.train_step, train.MetricsLogger = recording_plan, recording_step, RecordingLogger
    run_training(overrides)
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"plans": plans, "trained": trained, "rows": rows}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
