"""A Hydra `-m` job is named by the values it sweeps (runs/lr-optim.lr_0.003), in its folder and its wandb run name;
the end-to-end sweep is tests/test_train.py's multirun test."""
from omegaconf import OmegaConf

from training.run_folder import MAX_LABEL, job_label, multirun_job


def test_a_job_is_named_by_its_swept_values_only():
    import train

    argv = ["-m", "name=lr", "optim.lr=1e-3,3e-3", "train.steps=20", "scheduling=balanced,equal_token"]
    task = ["name=lr", "optim.lr=0.003", "train.steps=20", "scheduling=equal_token"]
    swept = train.swept_values(task, argv)
    assert swept == [("optim.lr", "0.003"), ("scheduling", "equal_token")]  # train.steps is the same in every job
    raw = {"name": "lr", "run_dir": "runs/lr", "logging": {"group": None}}
    job = multirun_job(raw, 1, swept)
    assert job["name"] == "lr-optim.lr_0.003+scheduling_equal_token" == job["run_dir"][len("runs/"):]
    assert job["logging"]["group"] == "lr"  # the wandb group stays the sweep's name; the wandb run takes `name`
    # the label is a Hydra value as it stands: `name=<it> resume=auto` resumes that job
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert OverridesParser.create().parse_overrides([f"name={job['name']}"])[0].value() == job["name"]


def test_odd_values_become_safe_and_a_sweep_without_values_keeps_the_number():
    assert job_label(3, [("+x", "[1, 2]"), ("data.urls", "/a/b*.tar")]) == "+x__1__2_+data.urls__a_b_.tar"
    assert job_label(3, []) == "3" and job_label(3, [("k", "v" * MAX_LABEL)]) == "3"
    assert multirun_job({"name": "n", "run_dir": "/scratch/n", "logging": {}}, 0, [("a", "1")])["run_dir"] == \
        "/scratch/n-a_1"
    assert OmegaConf.create(multirun_job({"name": "n", "run_dir": "runs/n", "logging": {}}, 2))["name"] == "n-2"
