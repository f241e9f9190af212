"""set_kv_buffer inside torch.compile(fullgraph=True), the custom op under opcheck, and on CUDA the
write captured in a CUDA graph and compiled in reduce-overhead mode (docs/contract.md, "Compiled
callers and CUDA graphs")."""

from __future__ import annotations

import pytest
import torch

from kvassert import DEVICE, Layer, assert_same_bytes, cuda_pool, cuda_values, gpu
from kvpool import MHATokenToKVPool, MLATokenToKVPool
from kvpool.kernels.store_kv import op as store_kv_op  # noqa: F401  (registers torch.ops.kvpool.store_kv)

def _model_step(pool: MHATokenToKVPool, layers: list[Layer]):
    """A toy forward pass: per layer, project, write K/V, read the cache back."""

    def step(x: torch.Tensor, loc: torch.Tensor, k_scale, v_scale) -> torch.Tensor:
        total = x.new_zeros(())
        for layer in layers:
            k = x * (layer.layer_id + 1)
            v = x - layer.layer_id
            pool.set_kv_buffer(layer, loc, k, v, k_scale, v_scale)
            total = total + pool.get_key_buffer(layer.layer_id)[loc.clamp(min=0)].float().sum()
        return total

    return step


def _pools(dtype):
    make = lambda: MHATokenToKVPool(64, 1, dtype, 2, 16, 2, DEVICE)  # noqa: E731
    return make(), make()


def _scales(kind):
    if kind == "none":
        return None, None
    if kind == "float":
        return 0.37, 1.5
    return torch.tensor([0.37], device=DEVICE), torch.tensor([1.5, 0.2], device=DEVICE)


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_fullgraph_compile_writes_the_same_bytes_as_eager(dtype, scale_kind):
    torch._dynamo.reset()
    compiled_pool, eager_pool = _pools(dtype)
    layers = [Layer(0), Layer(1)]
    ks, vs = _scales(scale_kind)
    x = torch.randn(5, 2, 16, device=DEVICE) * 30
    loc = torch.tensor([1, 9, -1, 33, 64], device=DEVICE)
    # aot_eager traces through Dynamo and AOTAutograd (graph breaks, functionalization of the
    # mutation) without paying for C++ code generation on every parameter combination.
    step = torch.compile(_model_step(compiled_pool, layers), fullgraph=True, backend="aot_eager")
    out = step(x, loc, ks, vs)
    expected = _model_step(eager_pool, layers)(x, loc, ks, vs)
    for layer in layers:
        for a, b in zip(compiled_pool.get_kv_buffer(layer.layer_id), eager_pool.get_kv_buffer(layer.layer_id)):
            assert_same_bytes(a, b, f"layer {layer.layer_id}")
    assert torch.equal(out, expected)


def test_inductor_keeps_the_write_in_place():
    """With the default backend, the generated code calls our op on the cache itself: no clone or
    copy of the whole cache (which is what makes a compiled index_put_ cost 650 us)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled_pool, eager_pool = _pools(torch.float8_e4m3fn)
    layers = [Layer(0), Layer(1)]
    ks = torch.tensor([0.37], device=DEVICE)
    x = torch.randn(5, 2, 16, device=DEVICE) * 30
    loc = torch.tensor([1, 9, -1, 33, 64], device=DEVICE)
    step = torch.compile(_model_step(compiled_pool, layers), fullgraph=True)
    _, sources = run_and_get_code(step, x, loc, ks, ks)
    code = "\n".join(sources)
    assert code.count("torch.ops.kvpool.store_kv.default(") == len(layers)
    assert ".clone(" not in code and "aten.copy_" not in code and "copy_(" not in code
    _model_step(eager_pool, layers)(x, loc, ks, ks)
    for layer in layers:
        for a, b in zip(compiled_pool.get_kv_buffer(layer.layer_id), eager_pool.get_kv_buffer(layer.layer_id)):
            assert_same_bytes(a, b, f"layer {layer.layer_id}")
    # a second call with new values reuses the compiled graph and still writes in place
    x2 = torch.randn_like(x)
    step(x2, loc, ks, ks)
    _model_step(eager_pool, layers)(x2, loc, ks, ks)
    for a, b in zip(compiled_pool.get_kv_buffer(1), eager_pool.get_kv_buffer(1)):
        assert_same_bytes(a, b, "second call")


def _op_args(cache_dtype, scales):
    k = torch.randn(4, 2, 8, device=DEVICE)
    v = torch.randn(4, 2, 8, device=DEVICE, dtype=torch.bfloat16)
    k_cache = torch.zeros(10, 2, 8, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros(10, 2, 8, dtype=cache_dtype, device=DEVICE)
    loc = torch.tensor([1, -1, 3, 12], device=DEVICE)
    st = torch.tensor([0.5], device=DEVICE) if scales == "tensor" else None
    sv = 0.25 if scales == "value" else None
    return (k, v, k_cache, v_cache, loc, st, st, sv, sv, "auto")


ALL_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("scales", ["tensor", "value", "none"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_opcheck_16_and_32_bit_caches(cache_dtype, scales):
    torch.library.opcheck(torch.ops.kvpool.store_kv.default, _op_args(cache_dtype, scales), test_utils=ALL_OPCHECKS)


@pytest.mark.parametrize("scales", ["tensor", "value", "none"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_opcheck_fp8_caches(cache_dtype, scales):
    """opcheck's test_schema compares tensors with arithmetic that torch does not implement for FP8
    ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'), so for FP8 caches it is replaced
    by the property it checks: the op mutates exactly the arguments it declares."""
    args = _op_args(cache_dtype, scales)
    torch.library.opcheck(
        torch.ops.kvpool.store_kv.default, args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )  # fmt: skip
    args = _op_args(cache_dtype, scales)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    torch.ops.kvpool.store_kv.default(*args)
    declared = {id(args[2]), id(args[3])}
    for t, b in zip(tensors, before):
        changed = not torch.equal(t.view(torch.uint8), b.view(torch.uint8)) if t.element_size() == 1 else not torch.equal(t, b)
        assert changed == (id(t) in declared), "the op must mutate k_cache and v_cache and nothing else"


# --- MLA: the one op writes the two column views of one latent buffer ---------------------------

MLA_R, MLA_ROPE = 16, 8


def _mla_step(pool: MLATokenToKVPool, layers: list[Layer], entry: str):
    """A toy MLA forward pass: per layer, project a latent row, write it (whole or as its two
    parts), gather the batch's rows back and read the cache."""

    def step(x: torch.Tensor, loc: torch.Tensor, k_scale) -> torch.Tensor:
        total = x.new_zeros(())
        for layer in layers:
            row = x * (layer.layer_id + 1)
            if entry == "row":
                pool.set_kv_buffer(layer, loc, row, None, k_scale)
            else:
                pool.set_mla_kv_buffer(layer, loc, row[:, :, :MLA_R], row[:, :, MLA_R:], k_scale)
            nope, rope = pool.get_mla_kv_buffer(layer, loc, dst_dtype=torch.float32)
            total = total + nope.sum() + rope.sum() + pool.get_value_buffer(layer.layer_id)[loc.clamp(min=0)].float().sum()
        return total

    return step


def _mla_pools(dtype):
    make = lambda: MLATokenToKVPool(64, 1, dtype, MLA_R, MLA_ROPE, 2, DEVICE)  # noqa: E731
    return make(), make()


# Scale kinds and dtypes reach the same op as the MHA cases above; these cover the two entry points.
@pytest.mark.parametrize(
    "entry, dtype, scale_kind",
    [("row", torch.float8_e4m3fn, "tensor"), ("parts", torch.float8_e4m3fn, "float"), ("parts", torch.bfloat16, "none")],
    ids=["row-fp8-tensor", "parts-fp8-float", "parts-bf16-none"],
)
def test_mla_fullgraph_compile_writes_the_same_bytes_as_eager(entry, dtype, scale_kind):
    torch._dynamo.reset()
    compiled_pool, eager_pool = _mla_pools(dtype)
    layers = [Layer(0), Layer(1)]
    ks = _scales(scale_kind)[0]
    x = torch.randn(5, 1, MLA_R + MLA_ROPE, device=DEVICE) * 30
    loc = torch.tensor([1, 9, -1, 33, 64], device=DEVICE)
    step = torch.compile(_mla_step(compiled_pool, layers, entry), fullgraph=True, backend="aot_eager")
    out = step(x, loc, ks)
    expected = _mla_step(eager_pool, layers, entry)(x, loc, ks)
    for a, b in zip(compiled_pool.kv_buffer, eager_pool.kv_buffer):
        assert_same_bytes(a, b, "latent buffer")
    assert torch.equal(out, expected)
    assert bool(compiled_pool.get_key_buffer(1).view(torch.uint8)[9].any()), "the compiled write wrote"


def test_mla_inductor_keeps_the_write_in_place():
    """Both entry points in one graph: the generated code hands the op two views of the layer's
    buffer (no clone or copy of the cache)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled_pool, eager_pool = _mla_pools(torch.float8_e4m3fn)
    ks = torch.tensor([0.37], device=DEVICE)

    def step(pool):
        # No arithmetic of its own, so Inductor generates no kernel to compile (the CPU suite's
        # time); test_inductor_keeps_the_write_in_place covers reads after writes.
        def fn(x, loc):
            pool.set_kv_buffer(Layer(0), loc, x, None, ks)
            pool.set_mla_kv_buffer(Layer(1), loc, x[:, :, :MLA_R], x[:, :, MLA_R:], 2.0)

        return fn

    x = torch.randn(5, 1, MLA_R + MLA_ROPE, device=DEVICE) * 30
    loc = torch.tensor([1, 9, -1, 33, 64], device=DEVICE)
    _, sources = run_and_get_code(torch.compile(step(compiled_pool), fullgraph=True), x, loc)
    code = "\n".join(sources)
    assert code.count("torch.ops.kvpool.store_kv.default(") == 2
    assert ".clone(" not in code and "aten.copy_" not in code and "copy_(" not in code
    step(eager_pool)(x, loc)
    for a, b in zip(compiled_pool.kv_buffer, eager_pool.kv_buffer):
        assert_same_bytes(a, b, "latent buffer")


@pytest.mark.parametrize("scales", ["tensor", "value", "none"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_opcheck_with_caches_that_are_two_views_of_one_buffer(cache_dtype, scales):
    """The MLA pool passes the op two column ranges of one buffer as its two caches."""
    buf = torch.zeros(10, 1, 12, dtype=cache_dtype, device=DEVICE)
    k = torch.randn(4, 1, 8, device=DEVICE)
    v = torch.randn(4, 1, 4, device=DEVICE, dtype=torch.bfloat16)
    loc = torch.tensor([1, -1, 3, 12], device=DEVICE)
    st = torch.tensor([0.5], device=DEVICE) if scales == "tensor" else None
    sv = 0.25 if scales == "value" else None
    args = (k, v, buf[:, :, :8], buf[:, :, 8:], loc, st, st, sv, sv, "auto")
    utils = ALL_OPCHECKS if cache_dtype.itemsize > 1 else ALL_OPCHECKS[1:]  # see test_opcheck_fp8_caches
    torch.library.opcheck(torch.ops.kvpool.store_kv.default, args, test_utils=utils)


# --- on CUDA: CUDA graphs and the reduce-overhead mode -------------------------------------------


@gpu
def test_cuda_graph_replays_with_the_current_scale_and_slots():
    pool = cuda_pool(fused="auto")
    ref = cuda_pool(fused="never")
    k_scale = torch.tensor([0.5], device="cuda")
    v_scale = torch.tensor([2.0], device="cuda")
    x = cuda_values((64, 8, 128), torch.bfloat16, 5)
    loc = torch.randperm(4096, device="cuda")[:64]
    static_x, static_loc = x.clone(), loc.clone()
    pool.set_kv_buffer(None, static_loc, static_x, static_x, k_scale, v_scale, layer_id_override=0)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(None, static_loc, static_x, static_x, k_scale, v_scale, layer_id_override=1)
    for step, (ks, vs) in enumerate([(0.37, 3.3), (1e-3, 0.01), (7.0, 0.9)]):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        static_x.copy_(cuda_values((64, 8, 128), torch.bfloat16, 100 + step))
        static_loc.copy_(torch.randperm(4096, device="cuda")[:64])
        graph.replay()
        ref.set_kv_buffer(None, static_loc, static_x, static_x, torch.tensor([ks], device="cuda"),
                          torch.tensor([vs], device="cuda"), layer_id_override=1)  # fmt: skip
        torch.cuda.synchronize()
        for a, b in zip(pool.get_kv_buffer(1), ref.get_kv_buffer(1)):
            assert_same_bytes(a, b, f"replay {step}")


@gpu
def test_reduce_overhead_compile_matches_eager():
    torch._dynamo.reset()
    layers = [Layer(0), Layer(1)]
    compiled_pool, eager_pool = cuda_pool(fused="auto"), cuda_pool(fused="auto")
    scale = torch.tensor([0.37], device="cuda")

    def step(pool, x, loc):
        for layer in layers:
            pool.set_kv_buffer(layer, loc, x * (layer.layer_id + 1), x, scale, scale)
        return pool.get_key_buffer(1)[loc].float().sum()

    compiled = torch.compile(lambda x, loc: step(compiled_pool, x, loc), mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        x = cuda_values((32, 8, 128), torch.bfloat16, 200 + i)
        loc = torch.randperm(4096, device="cuda")[:32] + 0
        out = compiled(x, loc)
        expected = step(eager_pool, x, loc)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        for layer in layers:
            for a, b in zip(compiled_pool.get_kv_buffer(layer.layer_id), eager_pool.get_kv_buffer(layer.layer_id)):
                assert_same_bytes(a, b, f"step {i}")
