"""Test setup.

Without a CUDA device the Triton kernels run through Triton's interpreter on CPU tensors, which must
be switched on before any ``@triton.jit`` function is defined, so before kvpool is imported. Tests
that need CUDA carry the ``gpu`` marker and are skipped without a device.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hypothesis import settings  # noqa: E402

# CI has two cores and no GPU; keep property tests quick and free of deadline flakiness.
settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["reference", "kernel"])
def copy_path(request, monkeypatch):
    """The row copies (moves, CPU copies, host tier) on their reference path, and on the row-copy
    kernel run on CPU tables through Triton's interpreter."""
    from kvpool.kernels.copy_rows import launcher as copy_rows

    if request.param == "kernel":
        if not copy_rows.INTERPRETER:
            pytest.skip("the row-copy kernel on CPU tensors needs TRITON_INTERPRET=1")
        monkeypatch.setattr(copy_rows, "kernel_on_cpu", True)
    return request.param
