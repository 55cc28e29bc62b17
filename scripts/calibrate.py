"""Calibrate the scheduler for a training config: time real training steps over (bucket, B), fit, write the file.

    python scripts/calibrate.py conf=wan21_1p3b                      writes runs/calibrate/wan21_1p3b/calibration.json
    python scripts/calibrate.py conf=wan21_1p3b +calibrate.out=DIR   writes DIR/calibration.json (or a .json path)
    python scripts/calibrate.py conf=wan21_1p3b +calibrate.blocks=4 +calibrate.max_points=12 +calibrate.time_budget_s=420
    python scripts/calibrate.py conf=wan21_8gpu launch.num_processes=1 +calibrate.blocks=18 +calibrate.fsdp_ranks=8
                                                                     a one-GPU slice of the 14B for FSDP over 8 ranks
                                                                     (scripts/h200_14b.sh)
    torchrun --nproc_per_node 8 scripts/calibrate.py conf=wan21_8gpu  the live FSDP set-up; feasibility agreed by
                                                                     all-reduce, rank 0 writes the file
    python scripts/calibrate.py +calibrate.refit=FILE +calibrate.fit_min_tokens=N
                                                                     fit FILE's measured points again (no device)
    python scripts/calibrate.py +calibrate.check=[i480:461] scheduling.calibration=FILE
                                                                     run those micro-batches against FILE's models

Options (`+calibrate.KEY=VALUE`) and what the benchmark measures: training/shape_benchmark.py (CalibrateOptions). A fit
that misses its own points by more than 15 % is warned about, with what to do. The trainer runs the same benchmark on
first use with scheduling.calibration=auto.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0)

import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from training.cli import user_errors  # noqa: E402
from training.config import load_config  # noqa: E402
from training.shape_benchmark import CalibrateOptions, calibrate_config, refit_file  # noqa: E402


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(dcfg) -> None:
    raw = OmegaConf.to_container(dcfg, resolve=True)
    raw.pop("hydra", None)
    command = "python " + " ".join(sys.argv[:1] + [a for a in sys.argv[1:] if not a.startswith("hydra")])
    with user_errors():  # training/cli.py: the message alone and exit status 2
        opts = CalibrateOptions.of(raw.pop("calibrate", None))
        if opts.refit:
            refit_file(opts.refit, opts.fit_min_tokens, command, opts.out)
            return
        calibrate_config(load_config(raw), opts, command=command, warn=lambda s: print(f"warning: {s}"))


if __name__ == "__main__":
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    main()
