"""SGLang's allocators and request tables loaded from its wheel, for the allocator benchmark's
side-by-side rows: its own code, run with stand-ins for the parts of SGLang it imports that the
measured calls never reach (an environment flag read, a page count from CPU lengths, a power of
two; a memory saver that does nothing, no custom memory pool).

    token, paged, version = load_allocators("sglang-0.5.9-py3-none-any.whl")
    req_table, mamba_pool, hybrid_table = load_tables("sglang-0.5.9-py3-none-any.whl")
"""

from __future__ import annotations

import __future__
import ast
import contextlib
import dataclasses
import importlib.util
import logging
import os
import sys
import tempfile
import types
import zipfile
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch

ALLOCATOR = "sglang/srt/mem_cache/allocator.py"
MEMORY_POOL = "sglang/srt/mem_cache/memory_pool.py"
#: What ``load_tables`` takes of ``memory_pool.py``: the request tables and the state pool, with the
#: module's size helper their constructors log with.
TABLES = ("ReqToTokenPool", "MambaPool", "HybridReqToTokenPool", "get_tensor_size_bytes")


def version_of(wheel: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        meta = next((n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA")), "sglang-?.dist-info")
    return meta.removesuffix(".dist-info").split("-", 1)[1]


def load_allocators(wheel: str) -> tuple[Any, Any, str]:
    """SGLang's ``TokenToKVPoolAllocator`` and ``PagedTokenToKVPoolAllocator`` from the wheel's
    ``allocator.py`` (imported as a module: its Triton kernels need their source on disk), and the
    wheel's version."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(ALLOCATOR).decode()

    def new_pages(seq_lens: torch.Tensor, page_size: int, prefix_lens: Optional[torch.Tensor] = None,
                  decode: bool = False) -> int:  # fmt: skip
        if prefix_lens is None or decode:
            return int(((seq_lens - 1) % page_size == 0).sum())
        return int(((seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size).sum())

    def power_of_2(n: int) -> int:
        return 1 << max(int(n) - 1, 0).bit_length()

    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        m = types.ModuleType(name)
        m.__path__ = []
        sys.modules[name] = m
    utils = types.ModuleType("sglang.srt.utils")
    utils.get_bool_env_var = lambda name, default="false": False
    utils.get_num_new_pages, utils.next_power_of_2 = new_pages, power_of_2
    sys.modules["sglang.srt.utils"] = utils
    # Triton reads a kernel's source from its file: the module is loaded from a copy on disk.
    path = os.path.join(tempfile.mkdtemp(prefix="sglang-allocator-"), "allocator.py")
    with open(path, "w") as f:
        f.write(source)
    full = "sglang.srt.mem_cache.allocator"
    spec = importlib.util.spec_from_file_location(full, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[full] = mod
    spec.loader.exec_module(mod)
    return mod.TokenToKVPoolAllocator, mod.PagedTokenToKVPoolAllocator, version_of(wheel)


class _NoMemorySaver:
    """Stands in for SGLang's ``TorchMemorySaverAdapter`` with the saver off."""

    @staticmethod
    def create(enable: bool = False) -> "_NoMemorySaver":
        return _NoMemorySaver()

    def region(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def load_tables(wheel: str) -> tuple[Any, Any, Any]:
    """SGLang's ``ReqToTokenPool``, ``MambaPool`` and ``HybridReqToTokenPool``: the definitions named
    in ``TABLES``, cut from the wheel's ``memory_pool.py`` (which imports much of SGLang) and run in
    a namespace holding what they use."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read(MEMORY_POOL).decode())
    body = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in TABLES]
    missing = set(TABLES) - {n.name for n in body}
    if missing:
        raise ValueError(f"{MEMORY_POOL} in {wheel} defines no {sorted(missing)}")
    code = compile(ast.Module(body=body, type_ignores=[]), MEMORY_POOL, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)  # fmt: skip
    module = types.ModuleType("sglang.srt.mem_cache.memory_pool")
    module.__dict__.update({
        "torch": torch, "np": np, "dataclass": dataclasses.dataclass, "dataclasses": dataclasses,
        "nullcontext": contextlib.nullcontext, "Any": Any, "List": List, "Optional": Optional, "Tuple": Tuple,
        "Union": Union, "logger": logging.getLogger("sglang.memory_pool"), "GB": 1 << 30, "_is_cpu": False,
        "_cpu_has_amx_support": False, "TorchMemorySaverAdapter": _NoMemorySaver, "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache",
        "maybe_init_custom_mem_pool": lambda device: (False, None, None),
    })  # fmt: skip
    sys.modules[module.__name__] = module  # dataclasses look their class's module up
    exec(code, module.__dict__)
    return module.ReqToTokenPool, module.MambaPool, module.HybridReqToTokenPool
