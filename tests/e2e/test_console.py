"""The console: a live progress bar on a terminal (a pseudo-terminal here), plain lines when piped."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from tests.helpers import ROOT

LOG_FOUR_STEPS = """
import sys
from jaxpar.core.run.metrics import MetricsLog
log = MetricsLog(sys.argv[1], True, 4)
for step in range(1, 5):
    log.log({"step": step, "loss": 2.0 / step, "tokens_per_sec": 1000.0, "mfu": 0.25,
             **({"eval_loss": 0.75} if step == 4 else {})})
log.close()
"""


def console(tmp_path, terminal: bool) -> str:
    tmp_path.mkdir()
    cmd = [sys.executable, "-c", LOG_FOUR_STEPS, str(tmp_path)]
    if not terminal:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a 160-column terminal
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=follower, stderr=subprocess.STDOUT, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closes when the process exits
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=60) == 0
    os.close(leader)
    return b"".join(chunks).decode()


def test_progress_bar_on_a_terminal_and_lines_when_piped(tmp_path):
    piped = console(tmp_path / "piped", terminal=False)
    lines = piped.splitlines()
    assert lines[0] == "step 1/4 | loss 2.0000 | 1,000 tok/s | mfu 25.0%" and len(lines) == 4, piped
    assert "%|" not in piped
    tty = console(tmp_path / "tty", terminal=True)
    assert "4/4 [00:00<00:00" in tty and "%|" in tty, tty  # the bar, elapsed<remaining (ETA)
    assert "loss 0.6667 | 1,000 tok/s | mfu 25.0%" in tty  # step 3 in the postfix
    assert "step 1/4 | loss 2.0000" not in tty  # no per-step lines on a terminal
    assert "step 4/4 | loss 0.5000 | eval 0.7500" in tty  # evaluations stay on screen as lines
