"""Folders removed once the process that owns them is gone, however it went: a spool, a
world's side channel, a forkserver's socket folder. A launched rank 0 that gloo aborts over
a mismatched collective runs no finalizer, and no other process on its node may be left to
clean up, so a small process of its own (the janitor) waits for the owner's end."""

from __future__ import annotations

import os
import subprocess
import sys

JANITOR = """import os, shutil, sys, time
parent = int(sys.argv[2])  # not getppid() here: the owner may be gone before this line runs
while os.getppid() == parent:
    time.sleep(0.2)
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""
"""The janitor's program: waits while its parent (the owner) lives, then removes the folder."""


def remove_when_gone(path: str) -> None:
    """Start a janitor that removes ``path`` once this process is gone (see :data:`JANITOR`)."""
    subprocess.Popen([sys.executable, "-c", JANITOR, path, str(os.getpid()), "ddparity-janitor"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
