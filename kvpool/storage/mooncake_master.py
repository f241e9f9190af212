"""Start and stop a ``mooncake_master``: Mooncake Store's master with its built-in HTTP metadata
server, the one process a fleet of engines shares (docs/contract.md, "Storage tier").

:class:`MooncakeMaster` runs the binary that PyPI's ``mooncake-transfer-engine`` (or its
``-non-cuda`` build) installs inside the ``mooncake`` package, with its RPC, metadata and metrics
servers on ``host`` (127.0.0.1 unless told otherwise) and on free ports unless given, waits until
both the RPC and the metadata port accept connections, and stops it by its process id.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Optional, Sequence

from kvpool.checks import is_int

#: Seconds ``start`` waits for the master's ports by default (it is up in about 1 s on 2 cores).
START_TIMEOUT_S = 30.0


def master_binary() -> str:
    """The path of the ``mooncake_master`` executable: the one inside the installed ``mooncake``
    package, else a ``mooncake_master`` on ``PATH``.

    Raises
    ------
    FileNotFoundError
        Neither exists (the message says what to install).
    """
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            return path
    on_path = shutil.which("mooncake_master")
    if on_path:
        return on_path
    raise FileNotFoundError(
        "mooncake_master not found: install Mooncake Store (pip install -c constraints.txt -e \".[mooncake]\", "
        "or mooncake-transfer-engine on a CUDA machine)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.25) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _port(value: object, name: str) -> int:
    if not is_int(value) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be an int in 0..65535 (0: a free port), got {value!r}")
    return int(value)


class MooncakeMaster:
    """One ``mooncake_master`` process with its HTTP metadata server.

    Parameters
    ----------
    host : the address every server of the master binds to (RPC, metadata, metrics);
        ``"127.0.0.1"`` by default. Engines on other machines need an address they can reach.
    rpc_port, http_port, metrics_port : the ports (0: a free one, picked at ``start``).
    binary : the executable (default :func:`master_binary`).
    extra_args : more ``-flag=value`` arguments (``-default_kv_lease_ttl=...``, ...).

    Attributes
    ----------
    master_server_address : ``"host:rpc_port"``, what a store's ``master_server_address`` takes.
    metadata_server : ``"http://host:http_port/metadata"``, what a store's ``metadata_server`` takes.
    pid : the process id while it runs, else None.
    log_path : the file its output goes to while it runs (removed by ``stop``; ``log_tail`` reads it).

    Examples
    --------
    >>> with MooncakeMaster() as master:
    ...     store = MooncakeStore(config, master_server_address=master.master_server_address,
    ...                           metadata_server=master.metadata_server)
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        http_port: int = 0,
        metrics_port: int = 0,
        *,
        binary: Optional[str] = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty str, got {host!r}")
        self.host = host
        self.rpc_port = _port(rpc_port, "rpc_port")
        self.http_port = _port(http_port, "http_port")
        self.metrics_port = _port(metrics_port, "metrics_port")
        if isinstance(extra_args, str) or not all(isinstance(a, str) for a in extra_args):
            raise ValueError(f"extra_args must be a sequence of str, got {extra_args!r}")
        self.binary = binary
        self.extra_args = list(extra_args)
        self.log_path: Optional[str] = None
        self._proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> Optional[int]:
        """The master's process id while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def master_server_address(self) -> str:
        """``host:rpc_port``, what a store's ``master_server_address`` takes."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """The URL of its built-in HTTP metadata server, what a store's ``metadata_server`` takes."""
        return f"http://{self.host}:{self.http_port}/metadata"

    def command(self) -> list[str]:
        """The command line ``start`` runs (ports as they are now)."""
        return [
            self.binary or master_binary(),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.http_port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}",
            *self.extra_args,
        ]

    def start(self, timeout: float = START_TIMEOUT_S) -> "MooncakeMaster":
        """Launch the master and wait until its RPC and metadata ports accept connections.

        Raises
        ------
        RuntimeError
            It is running already, it exited, or its ports did not open within ``timeout`` seconds
            (the process is then stopped); the message carries the end of its log.
        FileNotFoundError
            No ``mooncake_master`` (see :func:`master_binary`).
        """
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"this mooncake_master is running already (pid {self._proc.pid})")
        for name in ("rpc_port", "http_port", "metrics_port"):
            if getattr(self, name) == 0:
                setattr(self, name, free_port(self.host))
        fd, self.log_path = tempfile.mkstemp(prefix="kvpool-mooncake-master-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code, tail = self._proc.returncode, self.log_tail()
                self.stop()
                raise RuntimeError(f"mooncake_master exited with status {code} at start:\n{tail}")
            if port_open(self.host, self.rpc_port) and port_open(self.host, self.http_port):
                return self
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"mooncake_master did not open {self.master_server_address} within {timeout} s:\n{tail}")

    def stop(self) -> None:
        """Kill the process (SIGKILL to its process id) and wait for it; nothing when it is not running."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self.log_path is not None:
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass
            self.log_path = None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the master's output."""
        if self.log_path is None or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
