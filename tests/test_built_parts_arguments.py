"""The constructor arguments that pick the parts of ``HybridLinearKVPool`` and ``SWAKVPool``
(docs/contract.md, "Selecting it", "FP4 parts"): an FP4 ``dtype`` with ``fp4_format`` builds FP4
parts, ``out_dtype`` reaches every part whose getters dequantize, and each combination no part takes
is refused with a ``ValueError`` naming the argument, the expected and the actual value."""

from __future__ import annotations

import pytest
import torch

from kvassert import DEVICE, FP4_POOL_DTYPE
from kvpool import HybridLinearKVPool, SWAKVPool
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
H, D = 2, 32


def hybrid(dtype, **kw) -> HybridLinearKVPool:
    return HybridLinearKVPool(8, dtype, 1, H, D, [1, 4], False, DEVICE, None, **kw)


def swa(dtype, **kw) -> SWAKVPool:
    return SWAKVPool(8, 4, 1, dtype, H, D, [0], [1], False, DEVICE, **kw)


MLA = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=16)


@pytest.mark.parametrize("build", [hybrid, swa], ids=["hybrid", "swa"])
@pytest.mark.parametrize(
    "dtype, fmt, want",
    [
        (FP4_POOL_DTYPE, None, "fp4_mx_block16"),
        (FP4_POOL_DTYPE, "fp4_mx_block16", "fp4_mx_block16"),
        (FP4_POOL_DTYPE, "nvfp4", "nvfp4"),
        ("fp4_e2m1", None, "fp4_mx_block16"),
        ("nvfp4", None, "nvfp4"),
    ],
    ids=["fp4_dtype", "fp4_dtype_mx", "fp4_dtype_nvfp4", "sglang_fp4_name", "sglang_nvfp4_name"],
)
def test_an_fp4_dtype_builds_fp4_parts_of_the_format_asked_for(build, dtype, fmt, want):
    pool = build(dtype, fp4_format=fmt)
    parts = [pool.full_kv_pool] + ([pool.swa_kv_pool] if build is swa else [])
    assert all(isinstance(p, MHATokenToKVPoolFP4) and p.fp4_format == want for p in parts)
    assert pool.fp4_format == want and pool.out_dtype == torch.bfloat16 and pool.store_dtype == torch.uint8


@pytest.mark.parametrize("build", [hybrid, swa], ids=["hybrid", "swa"])
@pytest.mark.parametrize("dtype, mode", [(FP4_POOL_DTYPE, "static"), (E4M3, "per_token_head")], ids=["fp4", "per_token_head"])
def test_out_dtype_reaches_every_part_whose_getters_dequantize(build, dtype, mode):
    pool = build(dtype, kv_scale_mode=mode, out_dtype=torch.float16)
    parts = [pool.full_kv_pool] + ([pool.swa_kv_pool] if build is swa else [])
    assert all(p.out_dtype == torch.float16 for p in parts) and pool.out_dtype == torch.float16
    layer = 1
    assert pool.get_key_buffer(layer).dtype == torch.float16
    assert pool.get_kv_buffer(layer)[1].dtype == torch.float16
    plain = build(BF16)
    assert plain.out_dtype is None and plain.fp4_format is None


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: hybrid(BF16, fp4_format="nvfp4"),
         r"fp4_format must be None unless dtype is FP4 \(.*'fp4_e2m1' or 'nvfp4'\), got 'nvfp4' with dtype=torch.bfloat16"),
        (lambda: swa(E4M3, fp4_format="fp4_mx_block16"),
         "fp4_format must be None unless dtype is FP4 .* with dtype=torch.float8_e4m3fn"),
        (lambda: hybrid(FP4_POOL_DTYPE, fp4_format="mxfp4"), "fp4_format must be 'fp4_mx_block16' or 'nvfp4', got 'mxfp4'"),
        (lambda: swa("nvfp4", fp4_format="fp4_mx_block16"),
         r"fp4_format must be 'nvfp4' \(or None\) with dtype='nvfp4', got 'fp4_mx_block16'"),
        (lambda: hybrid(FP4_POOL_DTYPE, fp4_format="nvfp4", **MLA),
         r"fp4_format must be 'fp4_mx_block16' \(or None\) with use_mla \(MLATokenToKVPoolFP4 stores exponent scales "
         r"only\), got 'nvfp4'"),
        (lambda: hybrid("nvfp4", **MLA), "fp4_format must be 'fp4_mx_block16' .* with use_mla"),
        (lambda: hybrid(FP4_POOL_DTYPE, k_global_scales=2.0, **MLA),
         r"k_global_scales/v_global_scales must be None with use_mla"),
        (lambda: hybrid(FP4_POOL_DTYPE, observe_amax=True),
         "observe_amax must be False with an FP4 dtype .*, got True"),
        (lambda: swa(FP4_POOL_DTYPE, observe_amax=True), "observe_amax must be False with an FP4 dtype"),
        (lambda: swa(FP4_POOL_DTYPE, kv_scale_mode="per_token_head"),
         r"kv_scale_mode must be 'static' with an FP4 dtype \(FP4 rows carry their own block scales\), got 'per_token_head'"),
        (lambda: hybrid(FP4_POOL_DTYPE, kv_scale_mode="per_token_head"), "kv_scale_mode must be 'static' with an FP4 dtype"),
        (lambda: hybrid(BF16, k_global_scales=2.0),
         "k_global_scales/v_global_scales must be None unless dtype is FP4 with fp4_format='nvfp4', got dtype=torch.bfloat16"),
        (lambda: hybrid(FP4_POOL_DTYPE, v_global_scales=2.0),
         "k_global_scales/v_global_scales are for fp4_format='nvfp4', got fp4_format='fp4_mx_block16'"),
        (lambda: swa("nvfp4", k_global_scales=[1.0, 2.0]),
         r"k_global_scales must be one float for every layer of both parts \(set_global_scales sets one layer's\), "
         "got a sequence of 2"),
        (lambda: hybrid("nvfp4", k_global_scales=[1.0]), r"k_global_scales must have one scale per layer \(2\), got 1"),
        (lambda: hybrid("nvfp4", k_global_scales=-1.0), "k_global_scales must be a positive finite float .*, got -1.0"),
        (lambda: hybrid(BF16, out_dtype=torch.float32),
         "out_dtype must be None for a part that hands out its buffers as stored .*, got torch.float32"),
        (lambda: swa(E4M3, out_dtype=torch.float16), "out_dtype must be None for a part that hands out its buffers"),
        (lambda: swa(FP4_POOL_DTYPE, out_dtype=torch.int8), "out_dtype must be torch.bfloat16, torch.float16 or torch.float32"),
        (lambda: SWAKVPool(8, 4, 1, FP4_POOL_DTYPE, H, 24, [0], [1], False, DEVICE),
         "head_dim must be a multiple of 16 for an FP4 pool"),
        (lambda: swa(FP4_POOL_DTYPE, token_to_kv_pool_class=MHATokenToKVPoolFP4),
         r"token_to_kv_pool_class must be MHATokenToKVPool \(the dtype and kv_scale_mode pick the parts' kind\), "
         "got 'MHATokenToKVPoolFP4'"),
    ],
    ids=[
        "fp4_format_with_bf16", "fp4_format_with_fp8", "unknown_format", "format_against_dtype_name", "nvfp4_mla",
        "nvfp4_name_mla", "global_scales_mla", "hybrid_calibration", "swa_calibration", "swa_per_token_head",
        "hybrid_per_token_head", "global_scales_not_fp4", "global_scales_not_nvfp4", "swa_per_layer_sequence",
        "hybrid_sequence_length", "negative_global_scale", "out_dtype_plain", "out_dtype_static_fp8",
        "out_dtype_not_floating", "head_dim_not_blocks", "fp4_pool_class",
    ],
)  # fmt: skip
def test_a_combination_no_part_takes_is_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_the_per_token_head_parts_still_take_their_own_dtype_only():
    with pytest.raises(ValueError, match="dtype must be torch.float8_e4m3fn or torch.float8_e5m2 for a per-token-head"):
        hybrid(BF16, kv_scale_mode="per_token_head")
    pool = swa(E4M3, kv_scale_mode="per_token_head")
    assert isinstance(pool.swa_kv_pool, MHATokenToKVPoolFP8PerTokenHead) and pool.fp4_format is None
