"""The pools' SGLang API: MHATokenToKVPool (and the hybrid models' pools) take SGLang's constructor
arguments, positionally in SGLang's order, so SGLang call sites carry over; kvpool's own options are
keyword-only. The buffers a pool allocates, its getters (views, never copies), its layer ids and the
errors of its constructor. Every public class, function and method of kvpool has a docstring."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import kvpool
from kvassert import CACHE_DTYPES, DEVICE, Layer, assert_same_bytes, skip_fused_without_interpreter
from kvpool import HybridLinearKVPool, HybridReqToTokenPool, MambaCacheParams, MambaPool, MambaStateShape, MHATokenToKVPool

CPU = "cpu"  # the SGLang-argument tests; the buffer tests run on the suite's device

SGLANG_ORDER = (
    "size", "page_size", "dtype", "head_num", "head_dim", "layer_num", "device", "enable_memory_saver",
    "v_head_dim", "swa_head_num", "swa_head_dim", "swa_v_head_dim", "start_layer", "end_layer",
    "enable_alt_stream", "enable_kv_cache_copy",
)  # fmt: skip


def test_positional_parameters_are_sglangs_and_the_rest_keyword_only():
    params = list(inspect.signature(MHATokenToKVPool).parameters.values())
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == SGLANG_ORDER
    assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} >= {"fused", "warmup", "validate", "observe_amax"}
    with pytest.raises(TypeError):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 1, CPU, False, None, None, None, None, None, None, True, False, "never")


def test_all_sixteen_positional_arguments():
    pool = MHATokenToKVPool(16, 2, torch.float8_e4m3fn, 4, 8, 3, CPU, False, 6, None, None, None, 2, 4, True, False)
    assert (pool.size, pool.page_size, pool.dtype, pool.store_dtype) == (16, 2, torch.float8_e4m3fn, torch.uint8)
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == (4, 8, 6)
    assert (pool.layer_num, pool.start_layer, pool.end_layer) == (3, 2, 4)
    assert (pool.row_dim, pool.v_row_dim) == (32, 24)
    k, v = pool.get_kv_buffer(4)
    assert k.shape == (18, 4, 8) and v.shape == (18, 4, 6)
    with pytest.raises(IndexError):
        pool.get_key_buffer(5)


def test_sglang_keywords_and_defaults():
    pool = MHATokenToKVPool(
        size=8, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=2, device=CPU,
        enable_memory_saver=False, start_layer=None, end_layer=None, enable_alt_stream=False,
        enable_kv_cache_copy=True,
    )  # fmt: skip
    assert (pool.start_layer, pool.end_layer, pool.v_head_dim) == (0, 1, 16)
    assert (pool.row_dim, pool.v_row_dim) == (32, 32)


@pytest.mark.parametrize(
    "swa, expected",
    [
        (dict(swa_head_num=3, swa_head_dim=16, swa_v_head_dim=12), (3, 16, 12)),
        (dict(swa_head_num=3), (3, 8, 6)),
        (dict(swa_v_head_dim=10), (2, 8, 10)),
        (dict(swa_head_dim=32, swa_v_head_dim=24), (2, 32, 24)),
    ],
    ids=["all", "heads", "v_dim", "dims"],
)
def test_swa_arguments_replace_the_geometry(swa, expected):
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 2, 8, 1, CPU, v_head_dim=6, **swa)
    h, d, dv = expected
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == expected
    assert (pool.row_dim, pool.v_row_dim) == (h * d, h * dv)
    k, v = pool.get_kv_buffer(0)
    assert k.shape == (9, h, d) and v.shape == (9, h, dv)
    x, y = torch.randn(2, h, d), torch.randn(2, h, dv)
    pool.set_kv_buffer(None, torch.tensor([3, 5]), x, y, layer_id_override=0)
    assert torch.equal(k[[3, 5]], x.to(torch.bfloat16)) and torch.equal(v[[3, 5]], y.to(torch.bfloat16))
    with pytest.raises(ValueError, match=rf"cache_k must have {h} heads"):
        pool.set_kv_buffer(None, torch.tensor([1]), torch.randn(1, h + 1, d), y[:1], layer_id_override=0)


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_memory_saver_is_refused_naming_the_keyword(how):
    args = (8, 1, torch.bfloat16, 1, 8, 1, CPU)
    with pytest.raises(ValueError, match=r"enable_memory_saver must be False.*got True"):
        if how == "positional":
            MHATokenToKVPool(*args, True)
        else:
            MHATokenToKVPool(*args, enable_memory_saver=True)


@pytest.mark.parametrize("name", ["enable_alt_stream", "enable_kv_cache_copy"])
def test_sglang_flags_must_be_bools(name):
    with pytest.raises(ValueError, match=rf"{name} must be a bool, got 'yes'"):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 1, CPU, **{name: "yes"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(swa_head_num=0), "head_num must be a positive int, got 0"),
        (dict(swa_head_dim=-8), "head_dim must be a positive int, got -8"),
        (dict(swa_v_head_dim=2.0), "v_head_dim must be a positive int, got 2.0"),
        (dict(start_layer=3, end_layer=3), r"end_layer must be start_layer \+ layer_num - 1 = 4"),
    ],
)
def test_bad_sglang_geometry_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 2, CPU, **kwargs)


# --- buffers, getters and layer ids ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_buffers_shapes_dtypes_and_views(dtype):
    pool = MHATokenToKVPool(100, 4, dtype, 3, 16, 2, DEVICE, v_head_dim=8, start_layer=5, warmup=False)
    assert (pool.start_layer, pool.end_layer, pool.layer_num) == (5, 6, 2)
    assert pool.store_dtype == (torch.uint8 if dtype.itemsize == 1 else dtype)
    for layer_id in (5, 6):
        k, v = pool.get_kv_buffer(layer_id)
        assert k.shape == (104, 3, 16) and v.shape == (104, 3, 8)
        assert k.dtype == dtype and v.dtype == dtype
        assert not k.any() if dtype.itemsize > 1 else not k.view(torch.uint8).any()
        # a view of the storage, never a copy: the same object every time, same memory as k_buffer
        assert pool.get_key_buffer(layer_id) is k and pool.get_value_buffer(layer_id) is v
        assert k.data_ptr() == pool.k_buffer[layer_id - 5].data_ptr()
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == 2 * 104 * 3 * 16 * dtype.itemsize and v_bytes == 2 * 104 * 3 * 8 * dtype.itemsize


@pytest.mark.parametrize("layer_id", [-1, 0, 3, 7, 100])
def test_layer_ids_outside_the_rank_raise_and_never_wrap(layer_id):
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 1, 8, 3, DEVICE, start_layer=4, warmup=False)
    with pytest.raises(IndexError, match=rf"layer_id {layer_id} is outside this pool's layers \[4, 6\]"):
        pool.get_key_buffer(layer_id)
    k = torch.ones(1, 1, 8, device=DEVICE)
    with pytest.raises(IndexError, match=rf"layer_id {layer_id} is outside"):
        pool.set_kv_buffer(Layer(layer_id), torch.tensor([1], device=DEVICE), k, k)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(size=0), "size must be a positive int, got 0"),
        (dict(page_size=-1), "page_size must be a positive int, got -1"),
        (dict(dtype=torch.int8), "dtype must be one of"),
        (dict(head_num=0), "head_num must be a positive int, got 0"),
        (dict(head_dim=2.5), "head_dim must be a positive int, got 2.5"),
        (dict(layer_num=True), "layer_num must be a positive int, got True"),
        (dict(end_layer=9), r"end_layer must be start_layer \+ layer_num - 1 = 1"),
        (dict(start_layer=-2), "start_layer must be a non-negative int, got -2"),
        (dict(v_head_dim=0), "v_head_dim must be a positive int, got 0"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    args = dict(size=8, page_size=1, dtype=torch.float8_e4m3fn, head_num=1, head_dim=8, layer_num=2, device=DEVICE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MHATokenToKVPool(**args, warmup=False)


@pytest.mark.parametrize("mode", ["never", "auto", "always"])
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_pool_buffers_start_zeroed_and_getters_are_views(dtype, mode, monkeypatch):
    """Buffers start zeroed (docs/contract.md, "Pools"; warmup writes nothing visible but may touch
    slot 0 only); every getter returns the ``dtype`` view of the storage, not a copy."""
    skip_fused_without_interpreter(mode)
    monkeypatch.delenv("KVPOOL_FUSED", raising=False)
    pool = kvpool.MHATokenToKVPool(6, 2, dtype, 3, 5, 2, "cpu", v_head_dim=7, start_layer=2, fused=mode)
    for lid in (2, 3):
        k, v = pool.get_kv_buffer(lid)
        assert k.dtype == dtype and v.dtype == dtype
        assert tuple(k.shape) == (8, 3, 5) and tuple(v.shape) == (8, 3, 7)
        for b in (k, v):
            zero = torch.zeros_like(b.view(torch.uint8))
            assert_same_bytes(b.view(torch.uint8), zero, f"fresh pool layer {lid}")
        assert pool.get_key_buffer(lid).data_ptr() == k.data_ptr()
        assert pool.get_value_buffer(lid).data_ptr() == v.data_ptr()
        pool.get_key_buffer(lid).view(torch.uint8)[3].fill_(0x11)  # writes through the view
        assert (pool.get_kv_buffer(lid)[0].view(torch.uint8)[3] == 0x11).all(), "getter returned a copy"
    el = torch.empty(0, dtype=dtype).element_size()
    assert pool.get_kv_size_bytes() == (2 * 8 * 3 * 5 * el, 2 * 8 * 3 * 7 * el)


# --- hybrid linear-attention models ---------------------------------------------------------------

HYBRID_KV_ORDER = (
    "size", "dtype", "page_size", "head_num", "head_dim", "full_attention_layer_ids", "enable_kvcache_transpose",
    "device", "mamba_pool", "enable_memory_saver", "use_mla", "kv_lora_rank", "qk_rope_head_dim", "start_layer",
)  # fmt: skip


def test_hybrid_kv_pool_takes_sglangs_positional_order():
    params = list(inspect.signature(HybridLinearKVPool).parameters.values())
    assert tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD) == HYBRID_KV_ORDER
    assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} >= {"v_head_dim", "fused", "warmup", "validate"}
    pool = HybridLinearKVPool(
        size=8, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8, full_attention_layer_ids=[3],
        enable_kvcache_transpose=False, device=CPU, mamba_pool=None, enable_memory_saver=False,
    )  # fmt: skip
    assert pool.full_layer_nums == 1 and pool.start_layer == 0 and not pool.use_mla


def test_state_pools_take_sglangs_keywords():
    """SGLang builds these with keywords only; a Mamba2CacheParams-like object is read by attribute."""
    for cls, names in [
        (MambaPool, {"size", "spec_state_size", "cache_params", "device", "enable_memory_saver",
                     "speculative_num_draft_tokens"}),  # fmt: skip
        (HybridReqToTokenPool, {"size", "mamba_size", "mamba_spec_state_size", "max_context_len", "device",
                                "enable_memory_saver", "cache_params", "enable_mamba_extra_buffer",
                                "speculative_num_draft_tokens", "mamba_layer_ids", "enable_mamba_extra_buffer_lazy",
                                "enable_overlap_schedule", "start_layer"}),  # fmt: skip
    ]:
        params = inspect.signature(cls).parameters.values()
        assert all(p.kind == p.KEYWORD_ONLY for p in params)
        assert names <= {p.name for p in params}
    params = MambaCacheParams(MambaStateShape(conv=[(6, 3)], temporal=(1, 2, 2)), layers=[0, 1])
    table = HybridReqToTokenPool(
        size=2, mamba_size=4, mamba_spec_state_size=2, max_context_len=8, device=CPU, enable_memory_saver=False,
        cache_params=params, enable_mamba_extra_buffer=False, speculative_num_draft_tokens=2, mamba_layer_ids=[0, 1],
    )  # fmt: skip
    assert table.mamba_pool.spec_state_size == 2 and table.mamba_pool.mamba_cache.intermediate_ssm.shape[1] == 3


# --- the public API is documented ----------------------------------------------------------------


def _skipped(node: ast.AST) -> bool:
    """A property's setter or deleter, or a typing overload: documented by the definition it belongs to."""
    for d in getattr(node, "decorator_list", ()):
        if isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter"):
            return True
        if (isinstance(d, ast.Name) and d.id == "overload") or (isinstance(d, ast.Attribute) and d.attr == "overload"):
            return True
    return False


def undocumented(source: str, where: str) -> list[str]:
    """``where:line name`` of every public class, function and method in ``source`` without a docstring
    (methods of public classes at any depth; nothing inside a function body is public API)."""
    missing = []

    def walk(node: ast.AST, prefix: str) -> None:
        for n in ast.iter_child_nodes(node):
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or n.name.startswith("_"):
                continue
            if ast.get_docstring(n) is None and not _skipped(n):
                missing.append(f"{where}:{n.lineno} {prefix}{n.name}")
            if isinstance(n, ast.ClassDef):
                walk(n, f"{prefix}{n.name}.")

    walk(ast.parse(source), "")
    return missing


def test_the_docstring_check_finds_what_it_must():
    source = """
class Public:
    def method(self): pass
    @property
    def value(self):
        '''Documented.'''
    @value.setter
    def value(self, v): pass
    def _private(self): pass
    class Inner:
        def deep(self): pass
def function(): pass
@overload
def typed(x: int) -> int: ...
def documented():
    '''Documented.'''
    def local(): pass
class _Private:
    def method(self): pass
"""
    assert undocumented(source, "m.py") == [
        "m.py:2 Public", "m.py:3 Public.method", "m.py:10 Public.Inner", "m.py:11 Public.Inner.deep",
        "m.py:12 function",
    ]


def test_every_public_name_has_a_docstring():
    root = Path(kvpool.__file__).parent
    modules = sorted(p for p in root.rglob("*.py") if p.name == "__init__.py" or not p.name.startswith("_"))
    assert root / "pools" / "mha_pool.py" in modules  # the walk reached the package's files
    missing = [m for p in modules for m in undocumented(p.read_text(), str(p.relative_to(root.parent)))]
    assert not missing, f"{len(missing)} public names without a docstring:\n" + "\n".join(missing)
