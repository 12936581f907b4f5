"""glibc's malloc, set for XLA:CPU before the process gets going.

XLA:CPU allocates each step's temporary buffer (tens of MB for gpt2-tiny) with malloc. glibc serves a block that
large with a fresh mmap and unmaps it when the step frees it, so every one of its pages faults again the next step
(~25k minor faults a step on gpt2-tiny: a third of the step on CPU). glibc's `glibc.malloc.hugetlb=1` tunable
(glibc >= 2.35) backs those mappings with transparent huge pages: 146 faults a step, +30-50% tokens/s
(benchmarks/cpu_gap/README.md). glibc reads its tunables once, at process start, so the jaxpar CLIs re-execute
themselves with it, once, before importing jax. A GLIBC_TUNABLES already in the environment (even empty) is the
user's choice and is left alone.
"""

from __future__ import annotations

import os
import sys

HUGE_PAGES = "glibc.malloc.hugetlb=1"


def wants_relaunch(
    module: str, argv: list[str] = sys.orig_argv, environ=os.environ, platform: str = sys.platform
) -> bool:
    """Only for `python [options] -m <module> ...` itself.

    Not under a host program that runs the module as __main__ in its own process (pdb, cProfile, coverage, a
    notebook's %run), whose command line is not ours.
    """
    if platform != "linux" or "GLIBC_TUNABLES" in environ:
        return False
    if "-m" not in argv or argv[argv.index("-m") + 1 : argv.index("-m") + 2] != [module]:
        return False
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"; absent on musl
    except (AttributeError, OSError, ValueError):
        return False
    return name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)


def relaunch_with_huge_pages(module: str) -> None:
    """Re-execute `python ...

    -m module ...` with `HUGE_PAGES` set (same PID, same signals); if the exec fails, go on without it.
    """
    if wants_relaunch(module):
        os.environ["GLIBC_TUNABLES"] = HUGE_PAGES
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
        except OSError as e:
            print(f"note: running without {HUGE_PAGES} (re-executing {sys.executable} failed: {e})", file=sys.stderr)
