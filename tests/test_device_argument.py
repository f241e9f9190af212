"""A device argument this torch cannot use is refused at construction with one ValueError naming it,
by every pool, allocator, request table and writer (not torch's own assertion deep in an allocation)."""

import pytest
import torch

from kvassert import state_params
from kvpool import (
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from kvpool.checks import resolve_device


def _unusable_cuda() -> str:
    """A CUDA device name this torch cannot use: plain ``cuda`` without CUDA, else one past the last GPU."""
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


BUILDERS = {
    "MHATokenToKVPool": lambda d: MHATokenToKVPool(16, 1, torch.bfloat16, 1, 8, 1, d),
    "MLATokenToKVPool": lambda d: MLATokenToKVPool(16, 1, torch.bfloat16, 8, 4, 1, d),
    "TokenToKVPoolAllocator": lambda d: TokenToKVPoolAllocator(16, device=d),
    "PagedTokenToKVPoolAllocator": lambda d: PagedTokenToKVPoolAllocator(16, 4, device=d),
    "ReqToTokenPool": lambda d: ReqToTokenPool(4, 16, d),
    "MambaPool": lambda d: MambaPool(size=4, cache_params=state_params(), device=d),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_cuda_device_this_torch_cannot_use_is_one_clear_error(name):
    device = _unusable_cuda()
    with pytest.raises(ValueError, match=r"^device must be a device this torch can use: .*got '" + device):
        BUILDERS[name](device)


def test_the_error_names_the_argument_it_was_given_as():
    with pytest.raises(ValueError, match=r"^cache_device must be a device this torch can use"):
        resolve_device(_unusable_cuda(), "cache_device")


def test_cpu_and_usable_devices_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
