"""The fused path's eligibility gate (docs/contract.md, "The gate"): its decisions and their reasons,
the pool's three modes (``auto``, ``always``, ``never``), ``KVPOOL_FUSED`` over the constructor, and
the fallback counts in ``pool.stats``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvassert import cuda_pool, cuda_values, gpu
from kvpool import FusedPathUnavailable, MHATokenToKVPool, fused_eligibility
from kvpool.kernels.store_kv import writer as store_kv

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ==============================================================================================
# The gate, the modes and the stats.


CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def gate(**overrides):
    args = dict(
        device=CUDA, cache_dtype=torch.float8_e4m3fn, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16,
        head_dim=128, v_head_dim=128, k_cache_stride_d=1, v_cache_stride_d=1,
        k_scale=None, v_scale=None, triton_available=True, interpreter=False,
    )  # fmt: skip
    args.update(overrides)
    return fused_eligibility(**args)


def test_common_case_is_eligible():
    assert gate() == (True, "eligible")
    assert gate(k_scale=0.5, v_scale=torch.ones(1)) == (True, "eligible")
    assert gate(cache_dtype=torch.bfloat16, k_dtype=torch.float32) == (True, "eligible")
    assert gate(k_scale=torch.ones(8)) == (True, "eligible")  # per-head float32: fused too


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(triton_available=False), ["triton"]),
        (dict(device=CPU), ["cpu", "TRITON_INTERPRET"]),
        (dict(device=torch.device("meta")), ["'meta'"]),
        (dict(interpreter=True), ["TRITON_INTERPRET", "CPU tensors"]),
        (dict(cache_dtype=torch.float64), ["torch.float64"]),
        (dict(k_dtype=torch.int8), ["torch.int8"]),
        (dict(v_dtype=torch.float64), ["torch.float64"]),
        (dict(head_dim=2048), ["2048", "1024"]),
        (dict(v_head_dim=1025), ["1025"]),
        (dict(k_cache_stride_d=8), ["NHD", "8"]),
        (dict(k_scale=torch.ones(1, dtype=torch.bfloat16)), ["k_scale", "bfloat16", "float32"]),
        (dict(v_scale=torch.ones(1, dtype=torch.float64)), ["v_scale", "float64"]),
    ],
    ids=lambda x: "-".join(x) if isinstance(x, list) else None,
)
def test_each_condition_refuses_with_a_reason(overrides, words):
    ok, reason = gate(**overrides)
    assert not ok
    for w in words:
        assert w in reason, (w, reason)


def test_interpreter_makes_cpu_eligible():
    assert gate(device=CPU, interpreter=True) == (True, "eligible")


def test_gate_is_pure():
    args = dict(k_scale=0.5)
    assert gate(**args) == gate(**args) == gate(**args)


def _gate_pool(**kw):
    return MHATokenToKVPool(64, 1, torch.float8_e4m3fn, 2, 16, 2, "cpu", **kw)


def _gate_write(pool, scale=0.5, layer_id=0):
    k = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    pool.set_kv_buffer(None, torch.tensor([1, 2, 3]), k, k, scale, scale, layer_id_override=layer_id)


def test_auto_on_cpu_falls_back_and_counts_the_reason(caplog):
    pool = _gate_pool(fused="auto")
    with caplog.at_level(logging.INFO, logger="kvpool"):
        for _ in range(3):
            _gate_write(pool)
    assert pool.stats.fused_calls == 0 and pool.stats.reference_calls == 3
    [(reason, count)] = pool.stats.reasons.items()
    assert count == 3 and "cpu" in reason
    logged = [r for r in caplog.records if "reference path" in r.getMessage()]
    assert len(logged) == 1, "each new reason is logged once"


def test_never_takes_the_reference_path():
    pool = _gate_pool(fused="never")
    _gate_write(pool)
    assert pool.stats.reference_calls == 1 and pool.stats.reasons == {"fused='never'": 1}


def test_always_runs_the_kernel_on_cpu_through_the_interpreter():
    if not store_kv.INTERPRETER:
        pytest.skip("the interpreter is only switched on without CUDA")
    pool = _gate_pool(fused="always")
    _gate_write(pool)
    _gate_write(pool, scale=torch.ones(2))  # per-head scale: fused as well
    assert pool.stats.fused_calls == 2 and pool.stats.reference_calls == 0


def test_always_raises_with_the_reason_when_the_gate_refuses():
    if store_kv.INTERPRETER:
        pool = _gate_pool(fused="always")
        with pytest.raises(FusedPathUnavailable, match="k_scale is a torch.bfloat16 tensor"):
            _gate_write(pool, scale=torch.ones(1, dtype=torch.bfloat16))
        assert pool.stats.fused_calls == 0 and pool.stats.reference_calls == 0
    else:
        with pytest.raises(FusedPathUnavailable, match="device is cpu"):
            _gate_pool(fused="always")


def test_env_overrides_the_constructor(monkeypatch):
    monkeypatch.setenv("KVPOOL_FUSED", "never")
    pool = _gate_pool(fused="always")  # would raise on a plain CPU without the override
    assert pool.fused_mode == "never"
    monkeypatch.setenv("KVPOOL_FUSED", "sometimes")
    with pytest.raises(ValueError, match="KVPOOL_FUSED must be one of auto, always, never, got 'sometimes'"):
        _gate_pool()


def test_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="fused must be one of auto, always, never, got 'fast'"):
        _gate_pool(fused="fast")


def test_cpu_pool_does_not_warm_up():
    assert _gate_pool().warmup_seconds is None


@gpu
def test_auto_mode_routes_by_the_gate():
    pool = cuda_pool(fused="auto")
    x = cuda_values((5, 8, 128), torch.bfloat16, 9)
    loc = torch.arange(1, 6, device="cuda")
    pool.set_kv_buffer(None, loc, x, x, torch.linspace(0.1, 2, 8, device="cuda"), 0.3, layer_id_override=0)
    assert pool.stats.fused_calls == 1
    pool.set_kv_buffer(None, loc, x, x, torch.tensor([0.5], device="cuda", dtype=torch.bfloat16), None, layer_id_override=0)
    assert pool.stats.reference_calls == 1
    assert any("bfloat16" in r for r in pool.stats.reasons)
