"""The K/V write's argument types, which the pools' API and the kernels share: a scale (and the range
a float scale must lie in), the geometry a write is checked against, and the names errors give the
arguments. A leaf module: it imports nothing of kvpool's, so every folder may import it."""

from __future__ import annotations

from typing import NamedTuple, Union

import torch

#: A K or V scale as a write takes it: None (no scale), a Python float, or a tensor of one element
#: (per tensor) or one per head.
Scale = Union[None, float, torch.Tensor]

# A float scale is used as float32(scale). It must lie in float32's positive normal range: GPUs may
# flush float32 subnormals to zero in division, so a subnormal scale would not divide the same way on
# every path; and values above FLT_MAX (even those that would round down to it) overflow torch's
# float32 conversion. Comparing the double against the bounds avoids a float32 round trip.
F32_MIN_NORMAL = 2.0**-126
F32_MAX = (2.0 - 2.0**-23) * 2.0**127


class Geometry(NamedTuple):
    """What a write is checked against: the caches' element type, head counts, head dims, device."""

    cache_dtype: torch.dtype
    heads: int
    head_dim: int
    v_heads: int
    v_head_dim: int
    device: torch.device


class ArgNames(NamedTuple):
    """What the caller calls each argument, so errors name the argument the caller wrote."""

    k: str
    v: str
    loc: str
    k_scale: str = "k_scale"
    v_scale: str = "v_scale"


#: The names of a pool's ``set_kv_buffer`` arguments, and of the public write functions' arguments.
POOL_NAMES = ArgNames("cache_k", "cache_v", "loc")
FUNCTION_NAMES = ArgNames("k", "v", "cache_loc")
