"""set_kv_buffer inside torch.compile(fullgraph=True), and the custom op under opcheck (SPEC 4.4)."""

from __future__ import annotations

import pytest
import torch

from kvassert import assert_same_bytes
from kvpool import MHATokenToKVPool
from kvpool.kernels import op  # noqa: F401  (registers torch.ops.kvpool.store_kv)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


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
