"""Assertion helpers shared by the tests: byte-for-byte comparison that explains a mismatch; loading
an example script as a module."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor, as an integer tensor of the same element size."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor", any_nan: bool = False) -> None:
    """Equal bit patterns everywhere, NaN payloads and signs included (the two write paths store the
    same NaN bits). ``any_nan=True`` accepts any NaN pattern where both are NaN, for comparisons
    with values computed outside kvpool (torch's own conversions disagree about NaN bits).

    On failure, reports the mismatch count, the first bad index and both values there."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: shape/dtype differ: {tuple(actual.shape)} {actual.dtype} vs "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    differ = bits(a) != bits(e)
    if any_nan and a.dtype.is_floating_point:
        both_nan = torch.isnan(a.float()) & torch.isnan(e.float())
        differ &= ~both_nan
    count = int(differ.sum())
    if count:
        first = tuple(int(i) for i in differ.nonzero()[0])
        av, ev = a[first], e[first]
        ab, eb = int(bits(a)[first]), int(bits(e)[first])
        raise AssertionError(
            f"{what}: {count} of {differ.numel()} elements differ; first at {first}: "
            f"actual {float(av)!r} (bits {ab:#x}) vs expected {float(ev)!r} (bits {eb:#x})"
        )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a cache with a pattern no write produces by accident (0xFF bytes: NaN for FP8 and
    the floating types), so unwritten or wrongly written rows show up."""
    t.view(_INT_VIEW[t.element_size()]).fill_(-1)
    return t


# The fused kernel takes CPU tensors only through Triton's interpreter (conftest switches it on when
# there is no CUDA device); elsewhere the fused cases of the CPU suites are skipped, not failed.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="fused kernel on CPU tensors needs TRITON_INTERPRET=1")


def skip_fused_without_interpreter(name: str) -> None:
    if not INTERPRETER and ("fused" in name or "always" in name):
        pytest.skip("fused kernel on CPU tensors needs TRITON_INTERPRET=1")


def compiled_variants() -> int:
    """Number of compiled variants of the write kernel in Triton's in-process cache (skips the test
    where this Triton keeps its cache elsewhere)."""
    from kvpool.kernels import store_kv_kernel

    caches = getattr(store_kv_kernel._store_kv_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its kernel cache elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def frames_up_to(outer: str) -> int:
    """How deep the caller sits below function ``outer``: its frame, ``outer``'s and every frame
    between (0 when ``outer`` is not on the stack). Frame counts of a public call to its launch."""
    frame, depth = sys._getframe(1), 0
    while frame is not None:
        depth += 1
        if frame.f_code.co_name == outer:
            return depth
        frame = frame.f_back
    return 0


def load_example(name: str) -> types.ModuleType:
    """``examples/<name>.py`` as module ``name`` (registered in ``sys.modules``, where dataclasses
    resolve annotations; the examples import their shared modules from their own folder)."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
