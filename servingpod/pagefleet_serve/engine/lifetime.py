"""The engine's child processes never outlive their parent: the core process dies with the
API process, a tensor-parallel worker with its fork server (which exits with the core)."""

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when its parent dies (no orphan survives a killed
    server); elsewhere the closed pipe stops it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(1)
