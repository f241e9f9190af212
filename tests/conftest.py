"""Test setup.

Without a CUDA device the Triton kernel runs through Triton's interpreter on CPU tensors, which must
be switched on before any ``@triton.jit`` function is defined, so before kvpool is imported.
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
