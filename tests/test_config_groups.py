"""`python train.py --help` lists the config groups a user can pick with group=option: it lists every folder Hydra
finds under conf/ (its list_groups, minus its own `hydra`), and those must be exactly the groups of conf/train.yaml's
defaults list. accelerate's launch configs were a folder there, so `accelerate` was listed and `accelerate=...` failed."""
import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from tests.helpers import CONF


def test_help_lists_only_the_defaults_lists_groups():
    with initialize_config_dir(config_dir=CONF, version_base=None):
        listed = set(GlobalHydra.instance().config_loader().list_groups("")) - {"hydra"}
    with open(f"{CONF}/train.yaml") as f:
        defaults = {next(iter(d)) for d in yaml.safe_load(f)["defaults"] if isinstance(d, dict)
                    and not next(iter(d)).startswith("override hydra/")}  # Hydra's own groups are not listed
    assert listed == defaults and "conf" in listed
