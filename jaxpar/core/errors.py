"""One exception type for bad user input: printed as a single line, non-zero exit.

And library noise kept out of the console (quiet_logs).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from contextlib import contextmanager


class UserError(Exception):
    """A problem with the config, mesh, data or a checkpoint that the user must fix."""


def os_error_line(e: OSError) -> str:
    """An OSError as the user needs it: the path(s) and what the system said, without the errno number."""
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    what = e.strerror or str(e) or type(e).__name__
    return f"{' -> '.join(paths)}: {what}" if paths else what


def error_line(e: BaseException) -> str | None:
    """The one line for an error the user must fix, or None for anything else.

    An error the user must fix: bad input, a missing file or directory, a full disk, no permission. Anything else is a
    bug, whose traceback must stay.
    """
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, OSError):  # FileNotFoundError, PermissionError, IsADirectoryError, ENOSPC, ...
        return os_error_line(e)
    return None


def check_output_dir(path: str, name: str, given: str | None = None) -> None:
    """`path` is a directory, or can be made one.

    Else one line naming `name` (the key or flag) and the value `given` to it, before any work (os.makedirs would
    say only 'File exists' of a file there, or above it).
    """
    at, path = os.path.abspath(path), path if given is None else given
    while not os.path.lexists(at):  # the nearest part of the path that is there
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        what = "a broken symbolic link" if os.path.islink(at) else "a file"
        raise UserError(f"{name}={path}: {at} is {what}, not a directory; choose another {name}")
    if not os.access(at, os.W_OK | os.X_OK):
        raise UserError(f"{name}={path}: no permission to write in {at}")


def check_output_file(path: str, name: str) -> None:
    """A file the command will write at its end: checked before the work (its folder is made when written)."""
    if os.path.isdir(path):
        raise UserError(f"{name}={path} is a directory; name a file")
    check_output_dir(os.path.dirname(os.path.abspath(path)), name, path)


# How long a rank other than 0 that refused a run waits for rank 0 to say why (`cli`): rank 0 meets the same
# error, and its exit ends the wait sooner (the launcher then stops every process).
RANK_ZERO_WAIT_S = 30.0


def cli(main=None, *, rank=None, teardown=None):
    """Decorate a command's `main(argv) -> int`.

    A UserError or an OSError becomes one `error:` line, exit status 2. Where several processes run one command,
    `rank()` says which this is: a UserError (every process meets the same) is printed by rank 0 alone, an OSError
    (this process's own file system) by each process that meets it, naming its rank. `teardown()` runs after `main`,
    error or not (after rank 0's line).
    """

    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            def several() -> bool:  # read after main: a launcher's variables may be adopted there (srun's)
                return rank is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1

            wait = False
            try:
                try:
                    return main(*args, **kwargs)
                except UserError as e:
                    if rank is None or rank() == 0:
                        print(f"error: {error_line(e)}", file=sys.stderr, flush=True)
                    else:
                        wait = several()
                finally:
                    if teardown is not None:
                        teardown()
            except OSError as e:  # main's, or the teardown's
                who = f"rank {rank()}: " if several() else ""
                print(f"error: {who}{error_line(e)}", file=sys.stderr, flush=True)
            if wait:
                wait_for_rank_zero()
            return 2

        return run

    return wrap(main) if main is not None else wrap


def wait_for_rank_zero() -> None:
    """torchrun and DeepSpeed's launcher stop every process as soon as one fails.

    Had this rank exited first, rank 0 could be stopped before printing the line. So it waits until the launcher
    stops it, which rank 0's exit brings about (SIGTERM takes its default action: a stop handler may be installed),
    or for the limit.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(RANK_ZERO_WAIT_S)


@contextmanager
def quiet_logs(*names: str):
    """These libraries' loggers at ERROR while inside (e.g. an import that warns of what it cannot load here)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
