"""One writer per run directory: <run.dir>/lock, held with flock(2) by the process that writes the run.

A trainer's main process (rank 0 / jax process 0) for the whole run, a conversion that writes a run while it writes it.
Another process that would write there is refused in one line naming the holder (host, pid, since when) before it writes
or moves anything; the other processes of the holder's own job take no lock.

The kernel drops the lock when its holder's process ends, however it ends (SIGKILL, a lost node, torchrun stopping
its workers before a restart): the file stays, with the dead holder's name in it, and the next run takes it over.
So no process id is ever guessed alive or dead. Readers (generate, convert --from a run) take no lock.

Where the file system cannot lock (flock answers ENOLCK, EOPNOTSUPP or ENOSYS: NFS without its lock daemon, Lustre
mounted noflock), the run goes on after one warning, unguarded: refusing would leave no way to train there. Any
other failure to lock (a read-only run.dir, an I/O error) is one line, before anything is written. Locks keep
runs apart across hosts only where the file system's locks do (NFS with its lock daemon, Lustre with -o flock,
GPFS); mounted with local locks (nolock, localflock) they keep apart the runs of one host.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

from jaxpar.core.errors import UserError, os_error_line

LOCK_FILE = "lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
_HELD: set = set()  # the RunLocks this process holds


class RunLock:
    """The lock on a run directory, held by the process that writes the run.

    `with RunLock(run_dir) as lock: lock.acquire() ...`: held from acquire() (by the process that writes the run; the
    others of its job never call it) until the with-block ends, or until the process does.
    """

    def __init__(self, run_dir: str):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK_FILE)
        self.fd, self.unguarded = None, False

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> "RunLock":
        """Hold <run_dir>/lock, or one line naming its holder (UserError).

        Again after run_dir was moved (resume=false moves an old run aside with its lock file): the lock of the
        new run_dir.
        """
        if self.unguarded or (self.fd is not None and _same_file(self.fd, self.path)):
            return self
        self.release()
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(f"run.dir={self.run_dir}: cannot lock it for this run: {os_error_line(e)}") from None
        try:
            holder = _lock_or_holder(fd)
        except OSError as e:
            os.close(fd)
            return self._unlockable(e)
        if holder is not None:
            os.close(fd)
            raise UserError(
                f"run.dir={self.run_dir} is in use by another run: {holder} (it holds {self.path}); "
                "wait for it to end or stop it, or choose another run.dir"
            )
        self.fd = fd
        _HELD.add(self)
        _write_holder(fd)
        return self

    def _unlockable(self, e: OSError) -> "RunLock":
        if e.errno not in _UNSUPPORTED:
            raise UserError(f"run.dir={self.run_dir}: cannot lock {self.path}: {e.strerror}") from None
        self.unguarded = True
        print(
            f"warning: run.dir={self.run_dir}: its file system cannot lock {self.path} ({e.strerror}); this run "
            "goes on without keeping a second run out of it",
            file=sys.stderr,
            flush=True,
        )
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        _HELD.discard(self)
        try:
            os.ftruncate(self.fd, 0)  # an empty file: no holder, or one that has not written its name yet
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def _lock_or_holder(fd: int) -> str | None:
    """None once this process holds the lock; else who does.

    A new holder writes its name just after taking the lock, and an old one empties the file just before letting go:
    an empty file is read again for a moment.
    """
    for _ in range(40):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            pass
        holder = _read_holder(fd)
        if holder:
            return holder
        time.sleep(0.05)
    return "a process that has not written its name"


def _write_holder(fd: int) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def _read_holder(fd: int) -> str | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return f"host {record['host']}, pid {record['pid']}, since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _forget_in_child() -> None:
    """A forked child (a data loader's worker) closes its copy: the lock must end with the process that took it.

    (The parent's descriptor keeps it held; closing a copy does not release a flock.)
    """
    for lock in _HELD:
        os.close(lock.fd)
        lock.fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)
