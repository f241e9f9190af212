"""The host tier: host-memory KV pages below a device pool (SGLang's HiCache host pool).

``pool.py`` is the host pool itself (buffers, layouts, pages, checks, the data-page API),
``schedule.py`` where and when its copies run, ``kernel_backend.py`` and ``direct_backend.py`` how,
``layer_counter.py`` the per-layer load events a device pool's getters wait on, ``memory.py`` the
pinned host buffers, ``pages.py`` the page allocator, ``mamba_host.py`` the hybrid models' state
slots parked on the host (``MambaPoolHost``) and parked with their KV (``HybridPoolHost``),
``swa_host.py`` a sliding-window model's two parts parked together (``SWAKVPoolHost``) and
``swa_pages.py`` its book of which SWA page holds a full page's SWA rows. The rules are
docs/contract.md, "Host tier".
"""

from kvpool.host.layer_counter import LayerTransferCounter
from kvpool.host.mamba_host import HybridPoolHost, MambaPoolHost
from kvpool.host.memory import LAYOUTS
from kvpool.host.pool import IO_BACKENDS, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from kvpool.host.swa_host import SWAKVPoolHost

__all__ = [
    "HybridPoolHost",
    "IO_BACKENDS",
    "LAYOUTS",
    "LayerTransferCounter",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPoolHost",
    "MambaPoolHost",
    "SWAKVPoolHost",
]
