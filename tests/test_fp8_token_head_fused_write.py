"""The fused per-token-head FP8 write (docs/contract.md, "Per-token-head FP8"): K and V in one
launch, bit-identical to the reference path for every input (NaN, infinities, zero and subnormal
rows, strided inputs, odd shapes, padding and out-of-range slots, verify writes); the gate and the
modes as the FP8 write's. On a CPU the kernel runs through Triton's interpreter (``fused="always"``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvassert import DEVICE, FP8, INPUT_DTYPES, INTERPRETER, assert_same_bytes, assert_same_parts, fused_runs, gpu, id_of
from kvassert import poisoned_parts, qkv_slices, spread_rows
from kvpool import FusedPathUnavailable
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead

H, D, DV, SIZE = 3, 96, 40, 20  # an odd head count and head dims that are not powers of two


def pool(fused: str, dtype: torch.dtype = torch.float8_e4m3fn, heads: int = H, dim: int = D, v_dim: int = DV,
         **kw) -> MHATokenToKVPoolFP8PerTokenHead:  # fmt: skip
    p = MHATokenToKVPoolFP8PerTokenHead(SIZE, 1, dtype, heads, dim, 1, DEVICE, v_head_dim=v_dim, fused=fused, **kw)
    return poisoned_parts(p)  # unwritten or wrongly written rows show up


def stored(p: MHATokenToKVPoolFP8PerTokenHead) -> list[torch.Tensor]:
    return [getattr(p, name)[0] for name in p.part_names]


def special_rows(t: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Heads at very different magnitudes, with an all-zero head, a head of subnormals, one of NaN
    only, and infinities beside finite values."""
    x = spread_rows(t, H, dim, torch.float32, seed).cpu()
    x *= torch.exp2(torch.randint(-30, 30, (t, H, 1), generator=torch.Generator().manual_seed(seed)).float())
    x[1, 0] = 0.0
    x[1, 1] = -0.0
    x[2, 0] = 1e-40 if dtype != torch.float16 else 3e-6
    x[2, 1] = float("nan")
    x[3, 2, :3] = torch.tensor([float("inf"), -float("inf"), 1.5])
    return x.to(dtype).to(DEVICE)


@fused_runs
@pytest.mark.parametrize("dtype", FP8, ids=id_of)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_slice"])
def test_fused_write_is_the_reference_write_bit_for_bit(dtype, in_dtype, strided):
    k, v = special_rows(7, D, in_dtype, 1), special_rows(7, DV, in_dtype, 2)
    if strided:  # K and V sliced out of one wider projection, as a fused QKV output is
        k, v = qkv_slices(k, v)
    loc = torch.tensor([4, -1, 9, 2, SIZE + 1, 17, 0], device=DEVICE)
    fused, reference = pool("always", dtype), pool("never", dtype)
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert fused.stats.fused_calls == 1 and reference.stats.reference_calls == 1
    assert_same_parts(fused, reference)
    untouched = [r for r in range(SIZE + 1) if r not in (4, 9, 2, 17, 0)]
    assert bool((fused.k_buffer[0][untouched] == 0xA5).all()), "a row no slot named was written"


@fused_runs
def test_int32_slots_an_empty_write_and_a_verify_write():
    k, v = special_rows(6, D, torch.bfloat16, 3), special_rows(6, DV, torch.bfloat16, 4)
    loc_2d = torch.tensor([[5, 6, 7], [1, 3, 11]], dtype=torch.int32, device=DEVICE)
    commit = torch.tensor([2, 3], device=DEVICE)
    fused, reference = pool("always"), pool("never")
    for p in (fused, reference):
        p.set_kv_buffer(None, torch.tensor([5, 6, 7, 1, 3, 12], dtype=torch.int32, device=DEVICE), k, v, layer_id_override=0)
        p.set_kv_buffer(None, torch.zeros(0, dtype=torch.int64, device=DEVICE), k[:0], v[:0], layer_id_override=0)
        p.set_kv_buffer_prefix_valid(None, loc_2d, commit, k.flip(0), v.flip(0), layer_id_override=0)
    assert_same_parts(fused, reference)
    expected = pool("never")  # the verify write is the plain write of the committed tokens
    expected.set_kv_buffer(None, torch.tensor([5, 6, 7, 1, 3, 12], device=DEVICE), k, v, layer_id_override=0)
    expected.set_kv_buffer(None, torch.tensor([5, 6, -1, 1, 3, 11], device=DEVICE), k.flip(0), v.flip(0), layer_id_override=0)
    assert_same_parts(reference, expected)


@fused_runs
@settings(max_examples=15, deadline=None)  # each example is an interpreted launch on a CPU
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=24, max_size=24),
    st.sampled_from(INPUT_DTYPES),
    st.sampled_from(FP8),
)
def test_any_rows_fused_are_the_reference_rows(values, in_dtype, dtype):
    k = torch.tensor(values, dtype=torch.float32).reshape(2, 2, 6).to(in_dtype).to(DEVICE)  # 2 tokens, 2 heads
    v = k[..., 1:4]
    loc = torch.tensor([3, 8], device=DEVICE)
    fused, reference = (pool(mode, dtype, heads=2, dim=6, v_dim=3) for mode in ("always", "never"))
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert_same_parts(fused, reference)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_write_through_a_slot_map_is_the_write_at_the_mapped_slots(mode):
    if mode == "always" and DEVICE == "cpu" and not INTERPRETER:
        pytest.skip("fused kernel on CPU tensors needs TRITON_INTERPRET=1")
    k, v = special_rows(4, D, torch.bfloat16, 10), special_rows(4, DV, torch.bfloat16, 11)
    slot_map = torch.tensor([0, 7, 0, 12, 3, -1], device=DEVICE)  # another pool's 5 slots, then -1
    mapped, expected = pool(mode), pool(mode)
    mapped.set_kv_buffer(None, torch.tensor([1, 3, 9, 4], device=DEVICE), k, v, layer_id_override=0, slot_map=slot_map)
    expected.set_kv_buffer(None, torch.tensor([7, 12, -1, 3], device=DEVICE), k, v, layer_id_override=0)
    assert_same_parts(mapped, expected)
    before = [b.clone() for b in stored(mapped)]
    with pytest.raises(ValueError, match="slot_map must be int64"):
        mapped.set_kv_buffer(None, torch.tensor([1, 3, 9, 4], device=DEVICE), k, v, layer_id_override=0,
                             slot_map=slot_map.to(torch.int32))  # fmt: skip
    for name, a, b in zip(mapped.part_names, stored(mapped), before):
        assert_same_bytes(a, b, name)


@fused_runs
def test_given_scales_are_checked_then_not_used():
    k, v = special_rows(4, D, torch.float16, 5), special_rows(4, DV, torch.float16, 6)
    loc = torch.tensor([1, 2, 5, 6], device=DEVICE)
    plain, scaled = pool("always"), pool("always")
    plain.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    scaled.set_kv_buffer(None, loc, k, v, 0.25, torch.full((H,), 3.0, device=DEVICE), layer_id_override=0)
    assert_same_parts(plain, scaled)


def test_auto_takes_the_fused_path_on_cuda_and_the_reference_on_a_cpu_saying_why():
    p = pool("auto")
    k, v = special_rows(4, D, torch.bfloat16, 7), special_rows(4, DV, torch.bfloat16, 8)
    p.set_kv_buffer(None, torch.tensor([1, 2, 3, 4], device=DEVICE), k, v, layer_id_override=0)
    if DEVICE == "cpu":  # the interpreter runs only with fused="always"
        assert not p.fused_verdict[0] and "device is cpu" in p.fused_verdict[1]
        assert p.stats.reference_calls == 1 and p.stats.reasons == {p.fused_verdict[1]: 1}
    else:
        assert p.fused_verdict == (True, "eligible") and p.stats.fused_calls == 1 and p.stats.reference_calls == 0


def test_never_counts_its_reason_and_always_raises_where_the_gate_refuses(monkeypatch):
    p = pool("never")
    p.set_kv_buffer(None, torch.tensor([1], device=DEVICE), special_rows(4, D, torch.float32, 9)[:1],
                    special_rows(4, DV, torch.float32, 9)[:1], layer_id_override=0)  # fmt: skip
    assert p.stats.reasons == {"fused='never'": 1}
    monkeypatch.setattr("kvpool.kernels.store_fp8_token.writer.store_fp8_token_kv", None)
    with pytest.raises(FusedPathUnavailable, match="fused='always' but triton is not installed"):
        pool("always")


@gpu
@pytest.mark.parametrize("dtype", FP8, ids=id_of)
@pytest.mark.parametrize("heads, dim, v_dim, tokens", [(8, 128, 128, 3000), (2, 256, 256, 1000), (3, 96, 80, 777)],
                         ids=["llama_h8_d128", "qwen_h2_d256", "odd_h3_d96"])  # fmt: skip
def test_on_cuda_model_shapes_and_every_bf16_pattern_store_the_reference_bytes(dtype, heads, dim, v_dim, tokens):
    g = torch.Generator(device="cuda").manual_seed(heads * dim)
    k = torch.randn(tokens, heads, dim, device="cuda", generator=g) * torch.exp2(
        torch.randint(-30, 30, (tokens, heads, 1), device="cuda", generator=g).float())  # fmt: skip
    k = k.to(torch.bfloat16)
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    flat = k.view(-1)
    n = min(flat.numel(), patterns.numel())
    flat[:n] = patterns[:n]  # every bf16 bit pattern (subnormals, NaN payloads, infinities) somewhere
    v = k[..., :v_dim].flip(0)
    loc = torch.randperm(tokens + 16, device="cuda", generator=g)[:tokens]
    fused, reference = (MHATokenToKVPoolFP8PerTokenHead(tokens + 16, 1, dtype, heads, dim, 1, "cuda", v_head_dim=v_dim,
                                                        fused=mode) for mode in ("always", "never"))  # fmt: skip
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert fused.stats.fused_calls == 1 and reference.stats.reference_calls == 1
    assert_same_parts(fused, reference)


@gpu
def test_a_captured_write_replays_with_the_current_rows_and_slots():
    t = 64
    fused, reference = pool("always"), pool("never")
    static_k = torch.zeros(t, H, D, dtype=torch.bfloat16, device="cuda")
    static_v = torch.zeros(t, H, DV, dtype=torch.bfloat16, device="cuda")
    static_loc = torch.full((t,), -1, device="cuda")
    fused.set_kv_buffer(None, static_loc, static_k, static_v, layer_id_override=0)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.set_kv_buffer(None, static_loc, static_k, static_v, layer_id_override=0)
    for step in range(3):
        static_k.copy_(special_rows(t, D, torch.bfloat16, 20 + step))
        static_v.copy_(special_rows(t, DV, torch.bfloat16, 30 + step))
        static_loc.copy_(torch.randperm(SIZE + 1, device="cuda")[: min(t, SIZE + 1)].repeat(4)[:t])
        static_loc[SIZE + 1 :] = -1  # each slot once; the rest padding
        graph.replay()
        reference.set_kv_buffer(None, static_loc, static_k, static_v, layer_id_override=0)
        torch.cuda.synchronize()
        assert_same_parts(fused, reference)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_strided_slot_map_is_read_at_its_strides(mode):
    """A slot map that is a view with a stride (every other entry of a longer tensor) maps each
    entry of ``loc`` to the same row on both paths."""
    if mode == "always" and DEVICE == "cpu" and not INTERPRETER:
        pytest.skip("fused kernel on CPU tensors needs TRITON_INTERPRET=1")
    k, v = special_rows(4, D, torch.bfloat16, 14)[1:], special_rows(4, DV, torch.bfloat16, 15)[1:]
    slot_map = torch.tensor([0, 9, 7, 9, 0, 9, 12, 9, 3, 9, -1], device=DEVICE)[::2]  # 0, 7, 0, 12, 3, -1
    mapped, expected = pool(mode), pool(mode)
    mapped.set_kv_buffer(None, torch.tensor([1, 3, 4], device=DEVICE), k, v, layer_id_override=0, slot_map=slot_map)
    expected.set_kv_buffer(None, torch.tensor([7, 12, 3], device=DEVICE), k, v, layer_id_override=0)
    assert_same_parts(mapped, expected)
