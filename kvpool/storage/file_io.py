"""The file backend's directory and its I/O (``kvpool.storage.file``): where the directory is and
who may use it, the temporary files of writers still running, writes and reads of whole buffer
lists straight from and into host memory, and the bytes of a tensor to store.
"""

from __future__ import annotations

import ctypes
import os
import stat
import tempfile
from typing import Callable

import torch

#: The prefix of a page's temporary file, followed by its writer's process id.
TEMP_PREFIX = ".kvpage-tmp-"
#: Buffers per ``writev`` / ``readv`` call (the system's bound is at least 16 and usually 1024).
IOV_MAX = min(512, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16)


def default_file_path() -> str:
    """The directory used without ``file_path``: ``kvpool-hicache-<uid>`` in the temporary directory
    (one per user, so another user's directory is never picked up)."""
    return os.path.join(tempfile.gettempdir(), f"kvpool-hicache-{os.geteuid()}")


def owner_only_directory(path: object) -> str:
    """``path`` as an absolute directory that exists, is not a symlink, belongs to this user and is
    readable by its owner only, created (mode 0o700) if missing.

    Raises
    ------
    ValueError
        ``path`` not a non-empty str, or an existing entry that is a symlink, not a directory, owned
        by another user, or open to group or others (its mode is shown; ``chmod 700`` it).
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"file_path must be a non-empty path, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # the umask may have taken bits from 0o700
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"file_path must be a directory (not a symlink or a file), got {path}")
    if st.st_uid != os.geteuid():
        raise ValueError(f"file_path must belong to this user (uid {os.geteuid()}), got {path} owned by uid {st.st_uid}")
    if st.st_mode & 0o077:
        raise ValueError(
            f"file_path must be readable by its owner only (mode 0o700), got {path} with mode "
            f"{oct(stat.S_IMODE(st.st_mode))}"
        )
    return path


def writer_alive(temp_name: str) -> bool:
    """Whether the process whose id a temporary file's name carries is running."""
    try:
        pid = int(temp_name[len(TEMP_PREFIX) :].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, OverflowError, ProcessLookupError):
        return False
    except OSError:  # PermissionError: another user's process
        return True
    return pid > 0


def write_all(fd: int, data: memoryview | bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` until it has taken them all)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def vectored(move: Callable[[int, list[memoryview]], int], fd: int, views: list[memoryview]) -> bool:
    """``os.writev`` or ``os.readv`` of all of ``views`` in order, as many at a time as the system
    takes; False when a read meets the end of the file first."""
    views = [v for v in views if v.nbytes]
    while views:
        batch = views[:IOV_MAX]
        n = move(fd, batch)
        if n == 0:
            return False
        if n == sum(v.nbytes for v in batch):  # the usual case: all of them at once
            views = views[len(batch) :]
            continue
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return True


def region(ptr: int, size: int) -> memoryview:
    """``size`` bytes of host memory at ``ptr`` as a writable memoryview (no copy)."""
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


class HostViews:
    """Writable memoryviews of a host pool's buffers, from which a block's view is a slice (far
    cheaper than a new view of its address, which every block of every page would need)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), as_bytes(b)) for b in buffers if b.is_contiguous()]

    def view(self, ptr: int, size: int) -> memoryview:
        """``size`` bytes at ``ptr`` (a slice of the buffer holding them, else a view of their own)."""
        for base, end, whole in self.spans:
            if base <= ptr and ptr + size <= end:
                return whole[ptr - base : ptr - base + size]
        return region(ptr, size)


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def value_bytes(value: object, target: object, size: object, name: str) -> memoryview:
    """The bytes of a ``set``'s ``value`` (a CPU tensor; ``target`` and ``size`` None), as a
    memoryview; ValueError naming ``name`` otherwise."""
    if target is not None or size is not None:
        raise ValueError(f"{name} must be given as a tensor (HiCacheFile takes no target_location / target_sizes)")
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        got = f"a tensor on {value.device}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a CPU tensor, got {got}")
    return as_bytes(value.detach().contiguous())
