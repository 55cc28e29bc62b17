"""How a command-line entry point (train.py, scripts/*.py) reports a mistake the user can fix: a ValueError (a bad
value, a run without what was asked of it) or a missing file prints its message alone and exits with status 2, as
argparse does for a bad flag; HYDRA_FULL_ERROR=1 shows the whole trace (the name Hydra users already know)."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

USER_ERRORS = (ValueError, FileNotFoundError)


def wants_trace() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


@contextlib.contextmanager
def user_errors():
    """Inside it, a user error ends the process with its message and status 2 (the trace under HYDRA_FULL_ERROR=1)."""
    try:
        yield
    except USER_ERRORS as e:
        if wants_trace():
            raise
        prog = os.path.basename(sys.argv[0]) or "script"
        print(f"{prog}: error: {e}\n(HYDRA_FULL_ERROR=1 shows where it came from)", file=sys.stderr)
        sys.exit(2)


def run_main(main: Callable[[], object]) -> None:
    """Run a script's main(); a user error ends it with its message and status 2, anything else as Python would.
    An int that main returns is the exit status."""
    with user_errors():
        status = main()
    sys.exit(status if isinstance(status, int) else 0)
