"""How a command-line entry point (train.py, scripts/*.py) reports a mistake the user can fix: a ValueError (a bad
value, a run without what was asked of it) or a missing file prints its message alone and exits with status 2, as
argparse does for a bad flag; HYDRA_FULL_ERROR=1 shows the whole trace (the name Hydra users already know).

The machine's refusals are reported the same way: a full disk anywhere in an error's chain as "no space left on
<path>" (a checkpoint's own message says what was kept), and a path this user may not write or read (a read-only
file system, another user's folder) as "<path>: <reason>" with the way out."""
from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Callable, Optional

from training.run_folder import no_space

USER_ERRORS = (ValueError, FileNotFoundError)
DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


def refusal(e: BaseException) -> Optional[str]:
    """The message a user error ends with, or None for an error that is not the user's to fix."""
    if isinstance(e, USER_ERRORS):
        return str(e)
    full = no_space(e)
    if full is not None:
        return full.strerror
    if isinstance(e, OSError) and e.errno in DENIED and e.filename:
        return (f"{e.filename}: {e.strerror}. This user cannot write (or read) it: point the setting that names it "
                f"(run_dir for a run folder) at a folder this user may write, or change the folder's permissions")
    return None


def wants_trace() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


@contextlib.contextmanager
def user_errors():
    """Inside it, a user error ends the process with its message and status 2 (the trace under HYDRA_FULL_ERROR=1)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 — only refusals are reported here; anything else is raised as it is
        message = refusal(e)
        if message is None or wants_trace():
            raise
        prog = os.path.basename(sys.argv[0]) or "script"
        print(f"{prog}: error: {message}\n(HYDRA_FULL_ERROR=1 shows where it came from)", file=sys.stderr)
        sys.exit(2)


def run_main(main: Callable[[], object]) -> None:
    """Run a script's main(); a user error ends it with its message and status 2, anything else as Python would.
    An int that main returns is the exit status."""
    with user_errors():
        status = main()
    sys.exit(status if isinstance(status, int) else 0)
