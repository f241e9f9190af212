"""State pools. MambaPool: state buffers and their views, the slot allocator (examples and a state
machine), fork, clear, CPU copies, the speculative commit with track slots and the host tier (state
alone and with its KV), each against a plain-torch model of the bytes, on every path (the reference
path, the kernels through Triton's interpreter on CPU, the kernels on CUDA), and bad input.
HybridLinearKVPool, the KV pool over a hybrid model's full-attention layers: global layer ids, both
write paths, the verify write, moves, CPU copies and calibration, MLA inside, and its MambaPool."""

from __future__ import annotations

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.kernels.state_commit import launcher as SC
import kvpool.pools.mamba_pool as mamba_pool_module
import kvpool.pools.state_params as state_params_module
import kvpool.pools.state_slots as state_slots_module
from kvassert import DEVICE, Layer, assert_same_bytes, bits, poison_, poison_pool_
from kvpool import (
    HybridLinearKVPool,
    HybridPoolHost,
    IntegrityError,
    MambaCacheParams,
    MambaCpuCopy,
    MambaPool,
    MambaPoolHost,
    MambaStateDType,
    MambaStateShape,
    MLATokenToKVPool,
    quantize,
)
from kvpool.kernels.copy_rows import launcher as C
from kvpool.kernels.store_kv import writer as store_kv

META = torch.device("meta")
LAYERS = (1, 2, 5)  # global ids of the linear layers (full attention at 0, 3, 4)
K = 3  # draft steps
# Odd shapes on purpose: conv rows of 7 x 3 bf16 (42 bytes), SSM rows of 2 x 3 x 5 fp32.
SHAPE = MambaStateShape(conv=(7, 3), temporal=(2, 3, 5))
PARAMS = MambaCacheParams(SHAPE, LAYERS)


def test_docstring_examples_run():
    for module in (mamba_pool_module, state_params_module, state_slots_module):
        assert doctest.testmod(module).failed == 0


@pytest.fixture(
    params=["cpu-reference", "cpu-kernel", pytest.param("cuda-kernel", marks=pytest.mark.gpu)],
)
def device(request, monkeypatch):
    """The device a pool lives on, with the kernels forced onto CPU tables under the interpreter."""
    dev, path = request.param.split("-")
    if dev == "cpu" and path == "kernel":
        if not C.INTERPRETER:
            pytest.skip("kernels on CPU tensors need TRITON_INTERPRET=1")
        monkeypatch.setattr(C, "_kernel_on_cpu", True)
        monkeypatch.setattr(SC, "_kernel_on_cpu", True)
    return dev


def make_pool(device="cpu", size=9, spec=4, k=K, params=PARAMS, validate=False, seed=0):
    pool = MambaPool(
        size=size, spec_state_size=spec, cache_params=params, device=device, speculative_num_draft_tokens=k,
        validate=validate,
    )  # fmt: skip
    fill_random(pool, seed)
    return pool


def state_tensors(pool: MambaPool) -> list[torch.Tensor]:
    return [*pool.conv, pool.temporal]


def fill_random(pool: MambaPool, seed: int) -> None:
    """Random bytes everywhere (NaN patterns included), so every row is distinguishable."""
    g = torch.Generator().manual_seed(seed)
    scratch = [] if pool.intermediate_ssm is None else [*pool.intermediate_conv_window, pool.intermediate_ssm]
    for t in state_tensors(pool) + scratch:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g).to(raw.device))


def snapshot(pool: MambaPool) -> list[torch.Tensor]:
    return [t.view(torch.uint8).cpu().clone() for t in state_tensors(pool)]


def assert_states(pool: MambaPool, expected: list[torch.Tensor], what: str = "state") -> None:
    for t, e, name in zip(state_tensors(pool), expected, ["conv", "ssm"]):
        assert_same_bytes(t.view(torch.uint8).cpu(), e, f"{what}: {name}")


def T(values, device="cpu", dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


# --- params -----------------------------------------------------------------------------------------


def test_qwen35_tp8_per_rank_shapes_and_bytes():
    shape = MambaStateShape.gated_delta_net(
        num_k_heads=16, num_v_heads=64, head_k_dim=128, head_v_dim=128, conv_kernel=4, tp_world_size=8
    )
    assert shape.conv == ((1536, 3),) and shape.temporal == (8, 128, 128)
    params = MambaCacheParams(shape, layers=[i for i in range(60) if (i + 1) % 4])
    assert params.num_layers == 45
    assert params.conv_bytes == 1536 * 3 * 2 and params.temporal_bytes == 8 * 128 * 128 * 4
    assert params.bytes_per_slot == params.mamba_cache_per_req == 24_007_680  # ~22.9 MiB
    assert params.speculative_bytes_per_request(16) == 16 * 24_007_680
    # SGLang's Mamba2 formulas: channels = intermediate + 2 * groups * state, split over ranks
    same = MambaStateShape.create(
        tp_world_size=8, intermediate_size=8192, n_groups=16, num_heads=64, head_dim=128, state_size=128, conv_kernel=4
    )
    assert same == shape


def test_groups_replicate_up_to_the_ranks():
    shape = MambaStateShape.create(
        tp_world_size=4, intermediate_size=256, n_groups=1, num_heads=8, head_dim=32, state_size=16, conv_kernel=4
    )
    assert shape.conv == (((256 + 2 * 4 * 16) // 4, 3),) and shape.temporal == (2, 32, 16)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: MambaStateShape(conv=(7,), temporal=(2, 3, 5)), ValueError, r"conv\[0\] must be a tuple of 2"),
        (lambda: MambaStateShape(conv=(7, 0), temporal=(2, 3, 5)), ValueError, r"conv\[0\]\[1\] must be a positive int, got 0"),
        (lambda: MambaStateShape(conv=[], temporal=(2, 3, 5)), ValueError, "non-empty list"),
        (lambda: MambaStateShape(conv=(7, 3), temporal=(2, 3)), ValueError, "temporal must be a tuple of 3"),
        (lambda: MambaStateDType(conv=torch.int8), ValueError, "conv must be a floating torch.dtype"),
        (lambda: MambaCacheParams(SHAPE, layers=[]), ValueError, "non-empty sequence"),
        (lambda: MambaCacheParams(SHAPE, layers=[2, 1]), ValueError, r"distinct and ascending, got \[2, 1\]"),
        (lambda: MambaCacheParams(SHAPE, layers=[-1]), ValueError, r"layers\[0\] must be a non-negative int"),
        (lambda: MambaCacheParams((7, 3), layers=[0]), TypeError, "shape must be a MambaStateShape"),
        (lambda: MambaStateShape.create(tp_world_size=3, intermediate_size=8, n_groups=2, num_heads=3, head_dim=2,
                                        state_size=2, conv_kernel=4), ValueError, r"n_groups \(2\)"),  # fmt: skip
        (lambda: MambaStateShape.create(tp_world_size=2, intermediate_size=8, n_groups=2, num_heads=3, head_dim=2,
                                        state_size=2, conv_kernel=4), ValueError, r"num_heads \(3\) must split"),  # fmt: skip
        (lambda: MambaStateShape.create(tp_world_size=1, intermediate_size=8, n_groups=2, num_heads=3, head_dim=2,
                                        state_size=2, conv_kernel=1), ValueError, "conv_kernel must be at least 2"),  # fmt: skip
        (lambda: MambaCacheParams.of(object()), TypeError, "SGLang's Mamba2CacheParams"),
    ],
    ids=["conv-ndim", "conv-zero", "conv-empty", "temporal-ndim", "dtype", "no-layers", "layers-order",
         "negative-layer", "shape-type", "groups", "heads", "kernel", "foreign"],  # fmt: skip
)
def test_params_reject_bad_values(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_sglang_style_params_are_read_by_attribute():
    class Shape:
        conv = [(7, 3)]
        temporal = (2, 3, 5)

    class DType:
        conv = torch.float16
        temporal = torch.bfloat16

    class Sglang:
        shape, dtype, layers = Shape(), DType(), [1, 2, 5]

    pool = MambaPool(size=4, spec_state_size=4, cache_params=Sglang(), device="cpu")
    assert pool.cache_params == MambaCacheParams(SHAPE, LAYERS, MambaStateDType(torch.float16, torch.bfloat16))
    assert pool.conv[0].dtype == torch.float16 and pool.temporal.dtype == torch.bfloat16


# --- buffers and views ------------------------------------------------------------------------------


def test_buffers_are_one_allocation_per_kind_with_per_layer_views(device):
    pool = MambaPool(size=9, spec_state_size=4, cache_params=PARAMS, device=device, speculative_num_draft_tokens=K)
    assert pool.conv[0].shape == (3, 10, 7, 3) and pool.conv[0].dtype == torch.bfloat16
    assert pool.temporal.shape == (3, 10, 2, 3, 5) and pool.temporal.dtype == torch.float32
    assert pool.intermediate_conv_window[0].shape == (3, 5, K, 7, 3)
    assert pool.intermediate_ssm.shape == (3, 5, K, 2, 3, 5)
    assert not any(t.any() for t in [*pool.conv, pool.temporal, pool.intermediate_ssm])  # zeroed
    for i, layer in enumerate(LAYERS):
        conv, ssm = pool.get_conv_state(layer), pool.get_ssm_state(layer)
        assert conv.shape == (10, 7, 3) and ssm.shape == (10, 2, 3, 5)
        assert conv.data_ptr() == pool.conv[0].data_ptr() + i * pool.conv[0].stride(0) * 2
        assert ssm.data_ptr() == pool.temporal.data_ptr() + i * pool.temporal.stride(0) * 4
        assert pool.get_intermediate_ssm_state(layer).data_ptr() == pool.intermediate_ssm[i].data_ptr()
        assert pool.get_intermediate_conv_window(layer).shape == (5, K, 7, 3)
        assert pool.layer_index(layer) == i
    assert pool.row_table.row_bytes == (42, 120) * 3 and pool.row_table.rows == 10
    assert pool.spec_row_table.row_bytes == (42, 120) * 3 and pool.spec_row_table.rows == 5 * K
    assert pool.row_table.buffers[2].data_ptr() == pool.get_conv_state(2).data_ptr()
    assert pool.available_size() == 9 and pool.num_mamba_layers == 3 and pool.layers == LAYERS


def test_sglang_views_of_the_same_tensors():
    pool = make_pool()
    assert pool.mamba_cache.conv[0] is pool.conv[0] and pool.mamba_cache.temporal is pool.temporal
    layer = pool.mamba2_layer_cache(1)  # dense index: the second linear layer, global id 2
    assert layer.temporal.data_ptr() == pool.get_ssm_state(2).data_ptr()
    assert layer.conv[0].data_ptr() == pool.get_conv_state(2).data_ptr()
    assert layer.intermediate_ssm.data_ptr() == pool.get_intermediate_ssm_state(2).data_ptr()
    spec = pool.get_speculative_mamba2_params_all_layers()
    assert spec.intermediate_ssm is pool.intermediate_ssm
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs[0] == pool.get_conv_state(1).data_ptr() and ptrs[3] == pool.get_ssm_state(1).data_ptr()
    assert lens[3] == 10 * 120 and items == [42] * 3 + [120] * 3
    assert pool.mem_usage * 2**30 == pool.mamba_cache.mem_usage_bytes()


def test_layer_ids_and_missing_scratch_raise():
    pool = MambaPool(size=4, cache_params=PARAMS, device="cpu")
    with pytest.raises(ValueError, match=r"layer_id 3 is not a linear-attention layer of this pool: its layers are \[1, 2, 5\]"):
        pool.get_ssm_state(3)
    with pytest.raises(TypeError, match="layer_id must be an int, got str"):
        pool.get_conv_state("1")
    with pytest.raises(IndexError, match="dense index in 0..2"):
        pool.mamba2_layer_cache(3)
    for call in (lambda: pool.get_intermediate_ssm_state(1), lambda: pool.get_speculative_mamba2_params_all_layers(),
                 lambda: pool.commit(T([1]), T([1]))):  # fmt: skip
        with pytest.raises(ValueError, match="needs speculative state"):
            call()
    assert pool.intermediate_ssm is None and pool.spec_row_table is None


def test_constructor_rejects_bad_arguments():
    for kwargs, match in [
        (dict(size=0), "size must be a positive int"),
        (dict(speculative_num_draft_tokens=0), "speculative_num_draft_tokens must be a positive int"),
        (dict(speculative_num_draft_tokens=2, spec_state_size=0), "spec_state_size must be a positive int"),
        (dict(enable_memory_saver=True), "enable_memory_saver must be False"),
    ]:
        with pytest.raises(ValueError, match=match):
            MambaPool(**{"size": 4, "cache_params": PARAMS, "device": "cpu", **kwargs})


# --- the slot allocator -----------------------------------------------------------------------------


def test_alloc_hands_out_one_to_size_never_slot_0(device):
    pool = MambaPool(size=5, cache_params=PARAMS, device=device)
    got = pool.alloc(3)
    assert got.dtype == torch.int64 and got.device.type == device and got.tolist() == [1, 2, 3]
    assert pool.alloc_slots(2) == [4, 5] and pool.available_size() == 0
    assert pool.alloc(1) is None and pool.alloc_slots(1) is None
    pool.free(got)  # a device tensor
    pool.free([4])
    pool.free(5)
    assert pool.alloc(5).tolist() == [1, 2, 3, 4, 5]  # first in, first out
    pool.check_integrity()
    pool.clear()
    assert pool.available_size() == 5 and pool.held_slots() == []


@pytest.mark.parametrize(
    "bad, match",
    [
        ([0], r"free_index\[0\] is slot 0, the padding slot"),
        ([2, 6], r"free_index\[1\] = 6 is out of range: slots are 1..5"),
        ([2, 2], r"free_index\[1\] = 2 is listed twice"),
        ([3], r"free_index\[0\] = 3 is not handed out \(a double free, or never allocated\)"),
        (torch.tensor([1.0]), "free_index must be an integer tensor, got torch.float32"),
        (torch.tensor([[1]]), r"free_index must be 0-D or 1-D, got shape \(1, 1\)"),
        (True, "free_index must be an int, a sequence of ints or an integer tensor, got True"),
        (["1"], "free_index must be an int"),
    ],
    ids=["slot-0", "out-of-range", "twice", "double-free", "float", "2-d", "bool", "str"],
)
def test_bad_frees_raise_and_free_nothing(bad, match):
    pool = MambaPool(size=5, cache_params=PARAMS, device="cpu")
    pool.alloc_slots(2)
    with pytest.raises(ValueError, match=match):
        pool.free(bad)
    assert pool.available_size() == 3 and pool.held_slots() == [1, 2]
    pool.check_integrity()


def test_alloc_rejects_bad_counts():
    pool = MambaPool(size=5, cache_params=PARAMS, device="cpu")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="need_size must be a non-negative int"):
            pool.alloc(bad)
    assert pool.alloc(0).tolist() == [] and pool.available_size() == 5


def test_check_integrity_reports_corruption():
    pool = MambaPool(size=5, cache_params=PARAMS, device="cpu")
    pool.alloc_slots(2)
    pool._slots._free.append(3)  # corrupt the bookkeeping on purpose: slot 3 listed free twice
    pool._slots._held[1] = False  # and slot 1 neither free nor held
    with pytest.raises(IntegrityError, match=r"1 slots listed free more than once.*1 slots neither free nor held"):
        pool.check_integrity()


class SlotMachine(RuleBasedStateMachine):
    """The slot allocator against a model: the free slots in order, and the held ones."""

    @initialize(size=st.integers(1, 12))
    def setup(self, size):
        self.pool = MambaPool(size=size, cache_params=PARAMS, device="cpu")
        self.free = list(range(1, size + 1))
        self.held: set[int] = set()

    @rule(n=st.integers(0, 14), as_tensor=st.booleans())
    def alloc(self, n, as_tensor):
        got = self.pool.alloc(n) if as_tensor else self.pool.alloc_slots(n)
        if n > len(self.free):
            assert got is None
            return
        slots = got.tolist() if as_tensor else got
        assert slots == self.free[:n]
        self.free, self.held = self.free[n:], self.held | set(slots)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), form=st.sampled_from(["list", "tensor", "int"]))
    def free_some(self, data, form):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=4, unique=True))
        arg = chosen[0] if form == "int" else (T(chosen, dtype=torch.int32) if form == "tensor" else chosen)
        self.pool.free(arg)
        chosen = chosen[:1] if form == "int" else chosen
        self.free += chosen
        self.held -= set(chosen)

    @rule(data=st.data())
    def bad_free(self, data):
        candidates = [0, -1, self.pool.size + 1] + [s for s in range(1, self.pool.size + 1) if s not in self.held]
        bad = data.draw(st.sampled_from(candidates))
        good = sorted(self.held)[:1]
        with pytest.raises(ValueError):
            self.pool.free(good + [bad])

    @precondition(lambda self: self.held)
    @rule()
    def free_twice_in_one_call(self):
        s = min(self.held)
        with pytest.raises(ValueError, match="listed twice"):
            self.pool.free([s, s])

    @rule()
    def clear(self):
        self.pool.clear()
        self.free, self.held = list(range(1, self.pool.size + 1)), set()

    @invariant()
    def matches_the_model(self):
        if hasattr(self, "pool"):
            assert self.pool.available_size() == len(self.free)
            assert self.pool.held_slots() == sorted(self.held)
            self.pool.check_integrity()


TestSlotMachine = SlotMachine.TestCase


# --- fork and clear ---------------------------------------------------------------------------------


FORKS = {
    "fork": ([3], [7]),
    "two-forks-of-one": ([3, 3], [6, 8]),
    "cycle": ([1, 2, 3], [2, 3, 1]),
    "chain": ([4, 5, 6], [5, 6, 7]),
    "padding-and-out-of-range": ([-1, 2, 10, 4], [5, -1, 6, 11]),
}


def expected_copy(before: list[torch.Tensor], src: list[int], dst: list[int], rows: int) -> list[torch.Tensor]:
    out = [b.clone() for b in before]
    for s, d in zip(src, dst):
        if 0 <= s < rows and 0 <= d < rows:
            for o, b in zip(out, before):
                o[:, d] = b[:, s]  # every source read from the state before the copy
    return out


@pytest.mark.parametrize("name", list(FORKS))
def test_copy_from_matches_the_model(device, name):
    pool = make_pool(device)
    src, dst = FORKS[name]
    expected = expected_copy(snapshot(pool), src, dst, pool.size + 1)
    pool.copy_from(T(src, device), T(dst, device, torch.int32))
    assert_states(pool, expected)


def test_fork_from_allocates_and_copies(device):
    pool = make_pool(device, size=3)
    src = pool.alloc(1)
    before = snapshot(pool)
    dst = pool.fork_from(src)
    assert dst.tolist() == [2]
    assert_states(pool, expected_copy(before, [1], [2], 4))
    pool.alloc(1)
    assert pool.fork_from(src) is None and pool.available_size() == 0


def test_clear_slots_zeroes_only_the_named_slots(device):
    pool = make_pool(device)
    before = snapshot(pool)
    pool.clear_slots(T([2, -1, 7, 12], device, torch.int32))  # padding and out of range write nothing
    for b in before:
        b[:, [2, 7]] = 0
    assert_states(pool, before)


def test_copies_validate_names_the_slot():
    pool = make_pool(validate=True)
    before = snapshot(pool)
    with pytest.raises(IndexError, match=r"dst_index\[1\] = 10 is out of range"):
        pool.copy_from(T([1, 2]), T([3, 10]))
    with pytest.raises(IndexError, match=r"indices\[0\] = 11 is out of range: slots are 0..9"):
        pool.clear_slots(T([11]))
    assert_states(pool, before, "nothing written")


# --- CPU copies -------------------------------------------------------------------------------------


def test_cpu_copy_round_trip_is_exact(device):
    pool = make_pool(device)
    copy = pool.get_cpu_copy(T([4, 1, 9], device))
    assert isinstance(copy, MambaCpuCopy) and len(copy) == 3 and copy.layers == LAYERS
    assert copy.conv[0].shape == (3, 3, 7, 3) and copy.temporal.shape == (3, 3, 2, 3, 5)
    assert copy.temporal.device.type == "cpu" and copy.temporal.is_pinned() == (device == "cuda")
    before = snapshot(pool)
    assert_same_bytes(copy.temporal.view(torch.uint8), before[1][:, [4, 1, 9]], "get_cpu_copy")
    pool.load_cpu_copy(copy, T([2, 3, -1], device))  # the last row is padding
    for b in before:
        b[:, [2, 3]] = b[:, [4, 1]]
    assert_states(pool, before)
    empty = pool.get_cpu_copy(T([], device))
    assert len(empty) == 0
    pool.load_cpu_copy(empty, T([], device))


@pytest.mark.parametrize("bad", [[10], [-1]], ids=["past-the-end", "negative"])
def test_get_cpu_copy_checks_every_index(bad):
    pool = make_pool()
    with pytest.raises(IndexError, match=r"indices\[0\] = -?\d+ is out of range: slots are 0..9"):
        pool.get_cpu_copy(T(bad))


def _bad_copy(case: str) -> tuple[object, str]:
    pool = make_pool()
    copy = pool.get_cpu_copy(T([1, 2]))
    other = MambaPool(size=4, cache_params=MambaCacheParams(SHAPE, (1, 2)), device="cpu").get_cpu_copy(T([1, 2]))
    cases = {
        "type": ((copy.temporal,), "mamba_cache_cpu must be a MambaCpuCopy"),
        "layers": (other, r"must hold layers \[1, 2, 5\], got \[1, 2\]"),
        "length": (pool.get_cpu_copy(T([1])), r"mamba_cache_cpu.conv\[0\] must have shape \(3, 2, 7, 3\)"),
        "dtype": (MambaCpuCopy(copy.conv, copy.temporal.view(torch.int32), LAYERS), "mamba_cache_cpu.temporal must be torch.float32"),
        "convs": (MambaCpuCopy((), copy.temporal, LAYERS), "must hold 1 convolution states per layer, got 0"),
        "device": (MambaCpuCopy(copy.conv, copy.temporal.to(META), LAYERS), "mamba_cache_cpu.temporal must be in host memory"),
    }
    return cases[case]


@pytest.mark.parametrize("case", ["type", "layers", "length", "dtype", "convs", "device"])
def test_load_cpu_copy_rejects_a_mismatched_copy(case):
    pool = make_pool()
    bad, match = _bad_copy(case)
    before = snapshot(pool)
    with pytest.raises((TypeError, ValueError), match=match):
        pool.load_cpu_copy(bad, T([3, 4]))
    assert_states(pool, before, "nothing written")


# --- the speculative commit -------------------------------------------------------------------------


def expected_commit(pool: MambaPool, before: list[torch.Tensor], sets: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Request ``i`` with ``1 <= steps[i] <= K`` gets scratch ``[i, steps[i] - 1]`` in slot ``slots[i]``."""
    scratch = [t.view(torch.uint8).cpu() for t in (*pool.intermediate_conv_window, pool.intermediate_ssm)]
    out = [b.clone() for b in before]
    k = pool.speculative_num_draft_tokens
    for slots, steps in sets:
        for i, (d, s) in enumerate(zip(slots, steps)):
            if 1 <= s <= k and 0 <= d <= pool.size:
                for o, sc in zip(out, scratch):
                    o[:, d] = sc[:, i, s - 1]
    return out


COMMITS = {
    "accepted-mixed": ([3, 1, 5, 8], [2, 0, 3, 1]),
    "all-rejected": ([3, 1], [0, 0]),
    "all-accepted": ([1, 2, 3, 4, 5], [3, 3, 3, 3, 3]),
    "padding-slot-0-and-negative": ([0, -1, 6], [1, 2, 2]),
    "steps-outside-0-K-skipped": ([2, 4, 6], [-1, 4, 100]),
    "slots-past-the-end-skipped": ([10, 99, 7], [1, 1, 1]),
}


@pytest.mark.parametrize("name", list(COMMITS))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_commit_matches_the_model(device, name, index_dtype):
    pool = make_pool(device)
    slots, steps = COMMITS[name]
    expected = expected_commit(pool, snapshot(pool), [(slots, steps)])
    pool.commit(T(slots, device, index_dtype), T(steps, device, index_dtype))
    assert_states(pool, expected)


def test_commit_with_track_slots_in_the_same_call(device):
    pool = make_pool(device)
    slots, steps = [3, 1, 5, 8], [2, 0, 3, 1]
    track, track_steps = [2, 4, 6, 9], [1, 0, 2, 7]  # request 1 crossed no track point; 3's step is out of range
    expected = expected_commit(pool, snapshot(pool), [(slots, steps), (track, track_steps)])
    pool.commit(T(slots, device), T(steps, device), T(track, device, torch.int32), T(track_steps, device))
    assert_states(pool, expected)


def test_commit_reads_the_steps_when_it_runs(device):
    """The step counts are device data: changing them after the call was queued but before it runs
    is what a CUDA graph replay sees; here, the same tensors reused for a second commit."""
    pool = make_pool(device)
    slots, steps = T([1, 2], device), T([1, 1], device)
    pool.commit(slots, steps)
    steps.copy_(T([0, 3], device))
    before = snapshot(pool)
    pool.commit(slots, steps)
    assert_states(pool, expected_commit(pool, before, [([1, 2], [0, 3])]))


@given(
    requests=st.lists(st.tuples(st.integers(-1, 10), st.integers(-1, K + 1)), min_size=0, max_size=5),
    track=st.booleans(),
    data=st.data(),
)
@settings(max_examples=40)
def test_commit_property_on_the_reference_path(requests, track, data):
    pool = make_pool(seed=len(requests))
    slots, steps = [r[0] for r in requests], [r[1] for r in requests]
    sets = [(slots, steps)]
    args = [T(slots), T(steps)]
    if track:
        tr = data.draw(st.lists(st.integers(-1, 10), min_size=len(slots), max_size=len(slots)))
        ts = data.draw(st.lists(st.integers(-1, K + 1), min_size=len(slots), max_size=len(slots)))
        sets.append((tr, ts))
        args += [T(tr), T(ts)]
    # distinct destinations only: a slot named twice gets one of its sources (unspecified which)
    named = [d for s, st_ in sets for d, x in zip(s, st_) if 1 <= x <= K and 0 <= d <= pool.size]
    if len(named) != len(set(named)):
        return
    expected = expected_commit(pool, snapshot(pool), sets)
    pool.commit(*args)
    assert_states(pool, expected)


def test_commit_kernel_equals_the_reference_bit_for_bit(device):
    """The same commit on two copies of one pool: through ``MambaPool.commit`` (the kernel on CUDA and
    under the interpreter flag) and through the reference function directly."""
    a, b = make_pool(device, seed=7), make_pool(device, seed=7)
    for t in state_tensors(a):
        poison_(t[:, 0])  # NaN bytes in the padding slot: copies must keep any bit pattern
    for t in state_tensors(b):
        poison_(t[:, 0])
    args = (T([0, 4, 2, 9], device), T([3, 1, 0, 2], device), T([6, 7, 8, 5], device), T([1, 3, 2, 0], device))
    a.commit(*args)
    SC.commit_rows_reference(b.row_table, b.spec_row_table, K, *args)
    for x, y in zip(state_tensors(a), state_tensors(b)):
        assert_same_bytes(x.view(torch.uint8), y.view(torch.uint8), "kernel vs reference")


@pytest.mark.gpu
def test_commit_on_cuda_with_large_rows_and_a_captured_graph():
    """Rows of 512 KiB (Qwen3.5's SSM state at TP8 is 8 x 128 x 128 fp32) through the kernel, and a
    CUDA graph that replays with new step counts."""
    params = MambaCacheParams(MambaStateShape(conv=(1536, 3), temporal=(8, 128, 128)), layers=(0, 1))
    pool = make_pool("cuda", size=6, spec=3, k=4, params=params, seed=3)
    slots, steps = T([2, 5, 1], "cuda"), T([4, 0, 2], "cuda")
    pool.commit(slots, steps)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.commit(slots, steps)
    steps.copy_(T([1, 3, 0], "cuda"))
    before = snapshot(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert_states(pool, expected_commit(pool, before, [([2, 5, 1], [1, 3, 0])]))


def test_commit_validate_rejects_steps_and_slots_and_writes_nothing():
    pool = make_pool(validate=True)
    before = snapshot(pool)
    cases = [
        ((T([1, 2]), T([1, 4])), ValueError, r"accepted_steps\[1\] = 4 must be a step count in 0..3"),
        ((T([1, 2]), T([-1, 0])), ValueError, r"accepted_steps\[0\] = -1 must be a step count in 0..3"),
        ((T([1, 10]), T([1, 1])), IndexError, r"slots\[1\] = 10 is out of range: slots are 0..9"),
        ((T([1]), T([1]), T([3]), T([9])), ValueError, r"track_steps\[0\] = 9 must be a step count"),
        ((T([1]), T([1]), T([30]), T([1])), IndexError, r"track_slots\[0\] = 30 is out of range"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            pool.commit(*args)
    assert_states(pool, before, "nothing written")
    pool.commit(T([1, -1]), T([3, 0]))  # in range: passes


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.tensor([1.0]), T([1])), ValueError, "slots must be int32 or int64, got torch.float32"),
        ((T([1]), T([[1]])), ValueError, r"accepted_steps must be 1-D \[bs\], got shape \(1, 1\)"),
        ((T([1, 2]), T([1])), ValueError, r"accepted_steps must have as many entries as slots \(2\), got 1"),
        ((T([1]), T([1]).to(META)), ValueError, "accepted_steps must be on cpu, got meta"),
        (([1], T([1])), TypeError, "slots must be a torch.Tensor, got list"),
        ((T([1] * 6), T([1] * 6)), ValueError, r"slots must have at most spec_state_size \+ 1 = 5 entries"),
        ((T([1]), T([1]), T([2]), None), ValueError, "track_slots and track_steps must be given together"),
        ((T([1]), T([1]), T([2, 3]), T([1, 1])), ValueError, r"track_slots must have as many entries as slots \(1\)"),
        ((T([1]), T([1]), T([2]), torch.tensor([1.5])), ValueError, "track_steps must be int32 or int64"),
    ],
    ids=["float-slots", "2-d-steps", "lengths", "device", "list", "too-many", "track-alone", "track-length", "track-dtype"],
)
def test_commit_rejects_bad_input_before_writing(args, exc, match):
    pool = make_pool()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        pool.commit(*args)
    assert_states(pool, before, "nothing written")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda p: p.copy_from(T([1]), torch.tensor([2.0])), ValueError, "dst_index must be int32 or int64, got torch.float32"),
        (lambda p: p.copy_from(T([1, 2]), T([3])), ValueError, r"src_index must have as many entries as dst_index"),
        (lambda p: p.copy_from(T([1]).to(META), T([3])), ValueError, "src_index must be on cpu, got meta"),
        (lambda p: p.clear_slots(T([[1]])), ValueError, r"indices must be 1-D \[n\], got shape \(1, 1\)"),
        (lambda p: p.clear_slots([1]), TypeError, "indices must be a torch.Tensor, got list"),
        (lambda p: p.get_cpu_copy(T([1], dtype=torch.int16)), ValueError, "indices must be int32 or int64, got torch.int16"),
        (lambda p: p.load_cpu_copy(p.get_cpu_copy(T([1])), T([1]).to(META)), ValueError, "indices must be on cpu, got meta"),
    ],
    ids=["copy-dtype", "copy-lengths", "copy-device", "clear-2d", "clear-list", "cpu-copy-dtype", "load-device"],
)
def test_slot_operations_reject_bad_input_before_writing(call, exc, match):
    pool = make_pool()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        call(pool)
    assert_states(pool, before, "nothing written")


# --- the host tier: state slots parked in host memory, alone and with their KV ---------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_host_round_trip_is_exact(device, layout, io_backend):
    pool = make_pool(device)
    host = MambaPoolHost(pool, 2.0, 0, layout=layout)
    assert host.size == 18 and host.page_size == 1 and host.get_size_per_token() == PARAMS.bytes_per_slot
    h = host.alloc(3)
    assert h.tolist() == [0, 1, 2] and host.available_size() == 15
    before = snapshot(pool)
    event = host.backup_from_device_all_layer(pool, h, T([4, 9, -1], device), io_backend)
    assert (event is None) == (device == "cpu")
    host.wait_for_backups()
    if event is not None:
        event.synchronize()  # the host reads the pinned rows next: a stream wait does not cover it
    lead = (slice(None), slice(0, 2)) if layout == "layer_first" else (slice(0, 2), slice(None))
    got = host.temporal[lead]
    got = got if layout == "layer_first" else got.transpose(0, 1)
    assert_same_bytes(got.contiguous().view(torch.uint8), before[1][:, [4, 9]], "host rows")
    pool.clear_slots(T([4, 9], device))
    host.load_to_device_all_layer(pool, h[:2], T([9, 4], device), io_backend)  # swapped on the way back
    host.wait_for_loads()
    expected = [b.clone() for b in before]
    for e, b in zip(expected, before):
        e[:, [9, 4]] = b[:, [4, 9]]
    assert_states(pool, expected)
    assert host.free(h) == 3 and host.available_size() == 18


def test_host_backup_padding_keeps_the_host_row():
    pool = make_pool()
    host = MambaPoolHost(pool, 1.0, 0)
    h = host.alloc(2)
    host.backup_from_device_all_layer(pool, h, T([1, 2]))
    kept = host.temporal[:, 1].clone()
    host.backup_from_device_all_layer(pool, h, T([3, -1]))
    assert torch.equal(host.temporal[:, 1].view(torch.int32), kept.view(torch.int32))
    before = snapshot(pool)
    host.load_to_device_all_layer(pool, h, T([-1, 5]))
    for b in before:
        b[:, 5] = b[:, 2]
    assert_states(pool, before)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2]), "copy"), ValueError, "io_backend must be one of kernel, direct"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1])), ValueError, "device_indices must have as many entries as host_indices"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 10])), IndexError, r"device_indices\[1\] = 10 is out of range"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, T([0, 0]), T([1, 2])), ValueError, "must name each page once"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, T([0, 40]), T([1, 2])), IndexError, r"host_indices\[1\] = 40 is out of range"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2]).to(META)), ValueError, "device_indices must be on cpu"),
        (lambda h, p, s: h.load_to_device_all_layer(p, s, T([1.0, 2.0], dtype=torch.float32)), ValueError, "device_indices must be int32 or int64"),
        (lambda h, p, s: h.backup_from_device_all_layer(make_pool(params=MambaCacheParams(SHAPE, (1, 2))), s, T([1, 2])),
         ValueError, "device_pool must have the cache_params"),
        (lambda h, p, s: h.backup_from_device_all_layer(object(), s, T([1, 2])), TypeError, "device_pool must be a MambaPool"),
    ],
    ids=["backend", "lengths", "device-range", "host-twice", "host-range", "device", "dtype", "geometry", "type"],
)
def test_host_transfers_reject_bad_input_before_copying(call, exc, match):
    pool = make_pool(size=9)
    host = MambaPoolHost(pool, 2.0, 0)
    h = host.alloc(2)
    host_before = host.temporal.clone()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        call(host, pool, h)
    assert torch.equal(host.temporal.view(torch.int32), host_before.view(torch.int32)) and host.free(h) == 2
    assert_states(pool, before, "nothing written")


def test_host_sizes_and_construction_errors():
    pool = make_pool()
    assert MambaPoolHost(pool, 1.0, 1e-6).size == int(1e3 // PARAMS.bytes_per_slot)
    two_convs = MambaPool(size=4, cache_params=MambaCacheParams(MambaStateShape(conv=[(7, 3), (4, 3)], temporal=(2, 3, 5)), LAYERS), device="cpu")
    host = MambaPoolHost(two_convs, 1.0, 0)
    assert [c.shape for c in host.conv] == [(3, 4, 7, 3), (3, 4, 4, 3)]
    with pytest.raises(ValueError, match=r"io_backend must be one of kernel \('direct' needs one convolution per layer\)"):
        host.backup_from_device_all_layer(two_convs, host.alloc(1), T([1]), "direct")
    for args, kwargs, exc, match in [
        ((object(), 1.0, 0), {}, TypeError, "device_pool must be a MambaPool"),
        ((pool, 0, 0), {}, ValueError, "host_to_device_ratio must be a positive number"),
        ((pool, 1.0, 1e-9), {}, ValueError, "at least one slot"),
        ((pool, 1.0, 0), dict(layout="page_first_direct"), ValueError, "layout must be one of layer_first, page_first"),
        ((pool, 1.0, 0), dict(allocator_type="mooncake"), ValueError, "allocator_type must be 'default'"),
        ((pool, 1.0, 0), dict(device="cuda"), ValueError, "device must be cpu"),
    ]:
        with pytest.raises(exc, match=match):
            MambaPoolHost(*args, **kwargs)


def _hybrid_pools(device):
    mamba = make_pool(device)
    kv = HybridLinearKVPool(32, torch.float8_e4m3fn, 4, 2, 16, [0, 3, 4], False, device, mamba, warmup=False)
    g = torch.Generator().manual_seed(5)
    for buf in kv.full_kv_pool.k_buffer + kv.full_kv_pool.v_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g).to(buf.device))
    return kv, mamba


def test_hybrid_host_parks_and_reloads_kv_with_state(device):
    kv, mamba = _hybrid_pools(device)
    host = HybridPoolHost(kv, 2.0, 0, 4, "page_first")
    assert host.kv_host.size == 64 and host.state_host.size == 18
    kv_h, state_h = host.kv_host.alloc(8), host.state_host.alloc(1)
    kv_slots, state_slot = torch.arange(8, 16, device=device), T([3], device)
    k_before = [b[8:16].clone() for b in kv.full_kv_pool.k_buffer]
    state_before = snapshot(mamba)
    host.backup(kv_h, kv_slots, state_h, state_slot)
    host.wait_for_backups()
    for b in kv.full_kv_pool.k_buffer:
        b[8:16] = 0  # the request's slots reused by another request
    mamba.clear_slots(state_slot)
    new_kv, new_state = torch.arange(20, 28, device=device), T([7], device)
    host.load(kv_h, new_kv, state_h, new_state)
    host.wait_for_loads()
    for b, before in zip(kv.full_kv_pool.k_buffer, k_before):
        assert_same_bytes(b[20:28], before, "KV reloaded")
    expected = [s.clone() for s in state_before]
    for e, b in zip(expected, state_before):
        e[:, 3] = 0  # cleared for its new owner
        e[:, 7] = b[:, 3]  # the parked state, reloaded into another slot
    assert_states(mamba, expected)


def test_hybrid_host_checks_both_halves_before_copying():
    kv, mamba = _hybrid_pools("cpu")
    host = HybridPoolHost(kv, 2.0, 0, 4, "layer_first")
    kv_h, state_h = host.kv_host.alloc(4), host.state_host.alloc(1)
    kv_host_before = host.kv_host.k_buffer.clone()
    with pytest.raises(IndexError, match=r"device_indices\[0\] = 99 is out of range"):
        host.backup(kv_h, torch.arange(4, 8), state_h, T([99]))  # the state half is bad: no KV copied either
    assert torch.equal(host.kv_host.k_buffer, kv_host_before)
    with pytest.raises(ValueError, match="device_pool must have a mamba_pool"):

        HybridPoolHost(HybridLinearKVPool(8, torch.bfloat16, 1, 1, 8, [0], False, "cpu", None, warmup=False), 1.0, 0, 1, "layer_first")


def test_the_commit_kernels_launch_cache_is_built_like_the_others():
    """Its arguments are what ``DirectLaunches`` takes (a wrong one fails only where direct launches
    run, on a GPU, at the first ``remember``)."""
    from kvpool.kernels.copy_rows import launcher as copy_rows
    from kvpool.kernels.state_commit import launcher as state_commit

    for cache in (state_commit.LAUNCHES, copy_rows.LAUNCHES):
        assert isinstance(cache.limit, int) and cache.limit > 0
        assert isinstance(cache.enabled, bool) and isinstance(cache.what, str)


# --- HybridLinearKVPool: the KV pool over a hybrid model's full-attention layers, by global layer id --

FULL = [3, 7, 11]  # every 4th layer, as Qwen3.5's


def hybrid_pool(dtype=torch.bfloat16, head_dim=16, **kwargs):
    return HybridLinearKVPool(40, dtype, 2, 2, head_dim, FULL, False, DEVICE, None, warmup=False, **kwargs)


def test_hybrid_pool_maps_global_ids_to_dense_layers():
    pool = hybrid_pool(v_head_dim=8)
    assert pool.full_attention_layer_id_mapping == {3: 0, 7: 1, 11: 2} and pool.full_kv_pool.layer_num == 3
    assert (pool.size, pool.page_size, pool.head_num, pool.head_dim, pool.v_head_dim) == (40, 2, 2, 16, 8)
    for layer_id, dense in zip(FULL, range(3)):
        k, v = pool.get_kv_buffer(layer_id)
        assert k.data_ptr() == pool.full_kv_pool.k_buffer[dense].data_ptr() and v.shape == (42, 2, 8)
        assert pool.get_key_buffer(layer_id) is k and pool.get_value_buffer(layer_id) is v
        assert pool.dense_layer_id(layer_id) == dense
    assert pool.get_kv_size_bytes() == pool.full_kv_pool.get_kv_size_bytes() and pool.get_v_head_dim() == 8


@pytest.mark.parametrize("layer_id", [0, 4, 10, 12, -1])
def test_hybrid_pool_refuses_linear_layer_ids_naming_the_full_layers(layer_id):
    pool = hybrid_pool()
    message = rf"layer_id {layer_id} is not a full-attention layer of this pool: its full-attention layers are \[3, 7, 11\]"
    x = torch.ones(1, 2, 16, device=DEVICE)
    before = [b.clone() for b in pool.full_kv_pool.k_buffer]
    for call in (lambda: pool.get_key_buffer(layer_id), lambda: pool.get_kv_buffer(layer_id),
                 lambda: pool.set_kv_buffer(Layer(layer_id), torch.tensor([1], device=DEVICE), x, x),
                 lambda: pool.set_kv_buffer(None, torch.tensor([1], device=DEVICE), x, x, layer_id_override=layer_id)):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, pool.full_kv_pool.k_buffer)), "nothing written"
    with pytest.raises(TypeError, match="layer_id must be an int, got str"):
        pool.get_value_buffer("3")
    with pytest.raises(TypeError, match="layer_id_override"):
        pool.set_kv_buffer(None, torch.tensor([1], device=DEVICE), x, x)


@pytest.mark.parametrize("head_dim", [256, 96], ids=["d256", "d96"])
def test_hybrid_pool_fp8_fused_write_equals_the_reference(head_dim):
    """Qwen3.5's full attention: FP8 cache, head_dim 256, through the fused kernel (the interpreter on
    CPU) against the reference path on the same global layer, bit for bit."""
    if DEVICE == "cpu" and not store_kv.INTERPRETER:
        pytest.skip("the kernel cannot run here")
    fused = hybrid_pool(torch.float8_e4m3fn, head_dim, fused="always")
    ref = hybrid_pool(torch.float8_e4m3fn, head_dim, fused="never")
    for pool in (fused, ref):
        poison_pool_(pool.full_kv_pool)
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(5, 2, head_dim, generator=g) * 300).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(5, 2, head_dim, generator=g).to(DEVICE)
    loc = torch.tensor([2, 9, -1, 41, 17], device=DEVICE)
    scale = torch.tensor([0.37], device=DEVICE)
    for pool in (fused, ref):
        pool.set_kv_buffer(Layer(7), loc, k, v, scale, 0.5)
    assert fused.stats.fused_calls == 1 and ref.stats.reference_calls == 1
    for layer_id in FULL:
        for a, b in zip(fused.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
            assert_same_bytes(a, b, f"layer {layer_id}")
    assert_same_bytes(ref.get_key_buffer(7)[9:10], quantize(k[1:2], torch.float8_e4m3fn, 0.37), "slot 9")
    assert (bits(ref.get_key_buffer(3)) == 0xFF).all(), "other layers untouched"


def test_hybrid_pool_verify_write_moves_cpu_copies_and_calibration():
    pool = hybrid_pool(torch.float8_e4m3fn, fused="never")
    k = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    loc_2d = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    pool.observe_amax(True)
    pool.set_kv_buffer_prefix_valid(Layer(11), loc_2d, torch.tensor([1, 2], device=DEVICE), k, k)
    kbuf = pool.get_key_buffer(11)
    assert_same_bytes(kbuf[[1, 3, 4]], quantize(k[[0, 2, 3]], torch.float8_e4m3fn), "committed")
    assert not bits(kbuf[2]).any(), "uncommitted token (0, 1) writes nothing"
    pool.move_kv_cache(torch.tensor([5], device=DEVICE), torch.tensor([3], device=DEVICE))
    assert_same_bytes(kbuf[5], kbuf[3], "moved")
    copy = pool.get_cpu_copy(torch.tensor([1, 5], device=DEVICE))
    pool.load_cpu_copy(copy, torch.tensor([20, 21], device=DEVICE))
    assert_same_bytes(kbuf[[20, 21]], kbuf[[1, 5]], "cpu copy")
    scales = pool.calibrated_scales()
    assert list(scales) == FULL and float(scales[11][0]) == pytest.approx(float(k[[0, 2, 3]].abs().max()) / 448, rel=1e-6)
    assert pool.kv_amax.shape == (3, 2, 2)


def test_hybrid_pool_with_mla_inside():
    pool = HybridLinearKVPool(16, torch.bfloat16, 1, 0, 0, [1, 5], False, DEVICE, None, False, True, 8, 4, warmup=False)
    assert isinstance(pool.full_kv_pool, MLATokenToKVPool) and (pool.kv_lora_rank, pool.qk_rope_head_dim) == (8, 4)
    nope, rope = torch.randn(2, 1, 8, device=DEVICE), torch.randn(2, 1, 4, device=DEVICE)
    loc = torch.tensor([3, 6], device=DEVICE)
    pool.set_mla_kv_buffer(Layer(5), loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(5), loc)
    assert torch.equal(got_nope, nope.to(torch.bfloat16)) and torch.equal(got_rope, rope.to(torch.bfloat16))
    assert not pool.get_key_buffer(1).any()
    with pytest.raises(ValueError, match="not a full-attention layer"):
        pool.get_mla_kv_buffer(Layer(2), loc)
    with pytest.raises(ValueError, match="set_kv_buffer_prefix_valid needs an MHA pool inside"):
        pool.set_kv_buffer_prefix_valid(Layer(1), loc[None], loc[:1], nope, nope)
    with pytest.raises(ValueError, match="set_mla_kv_buffer needs use_mla=True"):
        hybrid_pool().set_mla_kv_buffer(Layer(3), loc, nope, rope)


def test_hybrid_pool_keeps_its_mamba_pool_and_checks_the_layers():
    mamba = MambaPool(size=4, cache_params=MambaCacheParams(MambaStateShape((6, 3), (1, 2, 2)), [0, 1, 2, 4]), device=DEVICE)
    pool = HybridLinearKVPool(16, torch.bfloat16, 1, 1, 8, [3, 7], False, DEVICE, mamba, warmup=False)
    assert pool.mamba_pool is mamba and pool.get_state_buf_infos() == mamba.get_contiguous_buf_infos()
    args = (16, torch.bfloat16, 1, 1, 8)
    for full, transpose, m, exc, match in [
        ([3, 4], False, mamba, ValueError, r"must not include the mamba_pool's linear layers, got \[4\] in both"),
        ([3, 3], False, None, ValueError, r"full_attention_layer_ids must be distinct, got \[3, 3\]"),
        ([], False, None, ValueError, "must name at least one layer"),
        ([-1], False, None, ValueError, r"full_attention_layer_ids\[0\] must be a non-negative int"),
        (3, False, None, TypeError, "full_attention_layer_ids must be a sequence of ints, got int"),
        ([3], True, None, ValueError, "enable_kvcache_transpose must be False"),
        ([3], False, object(), TypeError, "mamba_pool must be a MambaPool or None, got object"),
    ]:
        with pytest.raises(exc, match=match):
            HybridLinearKVPool(*args, full, transpose, DEVICE, m, warmup=False)
    with pytest.raises(ValueError, match="get_state_buf_infos needs a mamba_pool"):
        hybrid_pool().get_state_buf_infos()
