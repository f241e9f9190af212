"""How a :class:`~kvpool.storage.mooncake.MooncakeStore` reaches its Mooncake Store: the master's
and the metadata server's addresses and what this client lends the store (SGLang's
``MooncakeStoreConfig`` names), and the import of Mooncake's client with a reason when it fails.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Any

from kvpool.checks import positive_int
from kvpool.config import default_mooncake_bind_address
from kvpool.storage.mooncake_master import port_open

#: Mooncake's result codes this backend tells apart (mooncake-store's ``ErrorCode``).
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
#: The install line the errors name.
INSTALL_HINT = (
    'pip install -c constraints.txt -e ".[mooncake]" (mooncake-transfer-engine-non-cuda; '
    "mooncake-transfer-engine on a CUDA machine), and on Debian apt-get install libibverbs1"
)


def import_store_class() -> Any:
    """Mooncake's ``MooncakeDistributedStore`` class.

    Raises
    ------
    ImportError
        The package is missing or cannot load (a missing ``libibverbs.so.1`` on a CPU machine, say);
        the message keeps Mooncake's own reason and names what to install.
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"Mooncake Store cannot be imported ({e}); install it with {INSTALL_HINT}") from e
    return MooncakeDistributedStore


@dataclasses.dataclass(frozen=True)
class MooncakeConfig:
    """Where the store is and what this client lends it (SGLang's ``MooncakeStoreConfig`` names).

    Parameters
    ----------
    master_server_address : the master's RPC address, ``"host:port"``.
    metadata_server : the metadata server's URL, ``"http://host:port/metadata"`` (the master's
        built-in one with ``-enable_http_metadata_server=true``).
    local_hostname : the address other clients reach this one at (127.0.0.1: one machine only).
    protocol : ``"tcp"`` (or ``"rdma"`` with ``device_name``).
    device_name : RDMA devices, ``""`` for TCP.
    global_segment_size : bytes of this process's memory lent to the store (pages of every client
        may land there), >= 1.
    local_buffer_size : bytes of the client's own transfer buffer, >= 1.
    connect_timeout_s : how long a reachability probe of the master waits, > 0.
    retry_interval_s : after the master stops answering, calls return misses / False at once for
        this long before the master is probed again, > 0.

    Raises
    ------
    ValueError
        A field of the wrong kind or range, naming it.
    """

    master_server_address: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 64 << 20
    connect_timeout_s: float = 2.0
    retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("master_server_address", "metadata_server", "local_hostname", "protocol"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if not isinstance(self.device_name, str):
            raise ValueError(f"device_name must be a str, got {self.device_name!r}")
        self.master_host_port()
        url = urllib.parse.urlsplit(self.metadata_server)
        if url.scheme != "http" or not url.hostname or url.port is None:
            raise ValueError(f"metadata_server must be an http://host:port/... URL, got {self.metadata_server!r}")
        positive_int(self.global_segment_size, "global_segment_size")
        positive_int(self.local_buffer_size, "local_buffer_size")
        for name in ("connect_timeout_s", "retry_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    def master_host_port(self) -> tuple[str, int]:
        """``master_server_address`` as ``(host, port)``; ``ValueError`` unless it is ``host:port``."""
        host, sep, port = self.master_server_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master_server_address must be 'host:port', got {self.master_server_address!r}")
        return host, int(port)

    def metadata_host_port(self) -> tuple[str, int]:
        """The metadata server's ``(host, port)`` from its URL (port 0 when it names none)."""
        url = urllib.parse.urlsplit(self.metadata_server)
        return url.hostname or "", url.port or 0

    @classmethod
    def from_dict(cls, settings: dict) -> "MooncakeConfig":
        """A config from a dict of the field names (a storage config's ``extra_config``; other keys,
        which belong to other parts of the cache, are left alone)."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in ("master_server_address", "metadata_server") if n not in settings]
        if missing:
            raise ValueError(f"the Mooncake settings must give {' and '.join(missing)}, got keys {sorted(settings)}")
        return cls(**{k: v for k, v in settings.items() if k in names})


def check_reachable(config: MooncakeConfig) -> None:
    """Raise ConnectionError, naming the address and what to start, unless the master and the
    metadata server of ``config`` accept connections within ``connect_timeout_s`` (Mooncake's own
    setup retries an absent master for about 90 s before it fails)."""
    for what, (host, port) in (("master", config.master_host_port()), ("metadata server", config.metadata_host_port())):
        if not port_open(host, port, config.connect_timeout_s):
            raise ConnectionError(
                f"the Mooncake {what} at {host}:{port} does not accept connections (waited "
                f"{config.connect_timeout_s} s): start mooncake_master with -enable_http_metadata_server=true "
                f"(see the README, 'Storage tier: Mooncake'), or pass its address"
            )


def pin_transport_address(config: MooncakeConfig) -> None:
    """Make Mooncake's TCP transport give peers ``local_hostname``'s address to connect to (its
    ``MC_TCP_BIND_ADDRESS``; without it the transport offers the first active network interface's
    address whatever ``local_hostname`` says, so two engines on 127.0.0.1 would talk over that
    interface). A value already in the environment is left as it is; the setting is per process."""
    host = config.local_hostname
    if host.count(":") == 1:  # "host:port"
        host = host.split(":")[0]
    default_mooncake_bind_address(host)
