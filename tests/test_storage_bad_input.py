"""Bad input to the storage tier raises a clear error naming the argument, the expected and the
actual value, and nothing is written or read: the directory, the host pages and the counters are
as they were.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvassert import directory_state, file_store, host_page_bytes, make_device_pool, make_host

from kvpool.storage import HiCacheFile, HiCacheStorageConfig, page_keys
from kvpool.storage.faults import FaultyStorage

GOOD = torch.zeros(8, dtype=torch.uint8)


@pytest.fixture
def store(tmp_path):
    s = file_store(tmp_path / "kv")
    assert s.set("present", GOOD)
    return s


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.set("", GOOD), "key must be a non-empty str, got ''"),
        (lambda s: s.set(7, GOOD), "key must be a non-empty str, got 7"),
        (lambda s: s.set("k", [1, 2]), "value must be a CPU tensor, got list"),
        (lambda s: s.set("k", None), "value must be a CPU tensor, got NoneType"),
        (lambda s: s.set("k", torch.zeros(8, device="meta")), "value must be a CPU tensor, got a tensor on meta"),
        (lambda s: s.set("k", GOOD, target_location=123), "value must be given as a tensor"),
        (lambda s: s.get("present", torch.zeros(16, dtype=torch.uint8)[::2]), "target_location must be a contiguous CPU tensor"),
        (lambda s: s.get("present", 0x1000, 8), "target_sizes must be None"),
        (lambda s: s.get("present", 0x1000), "target_location must be None or a CPU tensor"),
        (lambda s: s.get(None), "key must be a non-empty str, got None"),
        (lambda s: s.exists(b"present"), "key must be a non-empty str, got b'present'"),
        (lambda s: s.batch_get("present"), "keys must be a list of str, got str"),
        (lambda s: s.batch_get(["present", ""]), r"keys\[1\] must be a non-empty str, got ''"),
        (lambda s: s.batch_get(["present"], [None, None]), "target_locations must be None or a list of 1 entries"),
        (lambda s: s.batch_set(["a", "b"], [GOOD]), "values must be None or a list of 2 entries .* got 1 entries"),
        (lambda s: s.batch_set(["a", "b"], None), "values must be a list of CPU tensors"),
        (lambda s: s.batch_set(["a", "b"], [GOOD, "x"]), r"values\[1\] must be a CPU tensor, got str"),
        (lambda s: s.batch_exists(["present", 3]), r"keys\[1\] must be a non-empty str, got 3"),
    ],
)
def test_bad_tensor_calls_change_nothing(store, call, match):
    before, stats = directory_state(store.file_path), store.get_stats()
    with pytest.raises(ValueError, match=match):
        call(store)
    assert directory_state(store.file_path) == before and store.get_stats() == stats


@pytest.mark.parametrize(
    "indices, match",
    [
        (lambda a: a[:4], "host_indices must have 8 entries \\(4 host slots per key\\), got 4"),
        (lambda a: a.to(torch.float32), "host_indices must be int32 or int64, got torch.float32"),
        (lambda a: a + 1, r"host_indices must be whole host pages .*: page 0 is \[1, 2, 3, 4\]"),
        (lambda a: torch.cat((a[:4], a[:4] + 80)), r"host_indices must be whole host pages .* below 80\): page 1 is \[80"),
        (lambda a: a.reshape(2, 4), "host_indices must be 1-D"),
        (lambda a: a.tolist(), "host_indices must be a torch.Tensor, got list"),
    ],
)
@pytest.mark.parametrize("method", ["batch_get_v1", "batch_set_v1"])
def test_bad_host_indices_change_nothing(tmp_path, method, indices, match):
    host = make_host(make_device_pool())
    store = file_store(tmp_path / "kv", host)
    a = host.alloc(8)
    keys = page_keys(list(range(8)), 4)
    store.batch_set_v1(keys[:1], a[:4])
    before, pages, stats = directory_state(store.file_path), [host_page_bytes(host, s) for s in range(0, 80, 4)], store.get_stats()
    with pytest.raises((ValueError, TypeError), match=match):
        getattr(store, method)(keys, indices(a))
    assert directory_state(store.file_path) == before and store.get_stats() == stats
    assert all(torch.equal(x, y) for x, y in zip(pages, [host_page_bytes(host, s) for s in range(0, 80, 4)]))


def test_host_forms_need_a_registered_host_pool(tmp_path):
    store = file_store(tmp_path / "kv")
    with pytest.raises(RuntimeError, match="no host pool registered: call register_mem_pool_host"):
        store.batch_get_v1(page_keys([1, 2, 3, 4], 4), torch.arange(4))
    with pytest.raises(ValueError, match=r"mem_pool_host must be a kvpool host pool .* got object \(no .get_data_page\)"):
        store.register_mem_pool_host(object())
    assert store.mem_pool_host is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp_rank=2, tp_size=2), "tp_rank must be an int in 0..1, got 2"),
        (dict(tp_size=0), "tp_size must be an int >= 1, got 0"),
        (dict(pp_rank=-1), "pp_rank must be an int in 0..0, got -1"),
        (dict(is_mla_model=1), "is_mla_model must be a bool, got 1"),
        (dict(model_name=3), "model_name must be a str or None, got int"),
        (dict(extra_config=[1]), "extra_config must be a dict or None, got list"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HiCacheStorageConfig(**kwargs)


def test_bad_store_arguments_create_nothing(tmp_path):
    with pytest.raises(ValueError, match="max_bytes must be a positive int, got 0"):
        HiCacheFile(HiCacheStorageConfig(), str(tmp_path / "a"), max_bytes=0)
    with pytest.raises(ValueError, match="storage_config must be a HiCacheStorageConfig or None, got dict"):
        HiCacheFile({"tp_rank": 0}, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="file_path must be a non-empty path, got ''"):
        HiCacheFile(HiCacheStorageConfig(), "")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match="file_path must be a directory"):
        HiCacheFile(HiCacheStorageConfig(), str(tmp_path / "file"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(token_ids="abcd"), "token_ids must be a sequence of ints or of \\(int, int\\) bigrams, got str"),
        (dict(token_ids=[1, 2.0]), r"token_ids\[1\] must be an int64 token or an \(int, int\) bigram, got 2.0"),
        (dict(token_ids=[1, True]), r"token_ids\[1\] must be an int64 token .* got True"),
        (dict(token_ids=[1, 2**63]), r"token_ids\[1\] must be an int64 token .* got 9223372036854775808"),
        (dict(token_ids=torch.tensor([1.0, 2.0])), "token_ids must be an integer tensor, got torch.float32"),
        (dict(token_ids=torch.zeros(2, 3, dtype=torch.int64)), r"token_ids must be 1-D \(tokens\) or \[n, 2\] \(bigrams\), got shape \(2, 3\)"),
        (dict(token_ids=np.array([1, 2**64 - 1], dtype=np.uint64)), r"token_ids must hold int64 tokens, got 18446744073709551615 \(uint64\)"),
        (dict(token_ids=torch.tensor([2**63, 1], dtype=torch.uint64)), r"token_ids must hold int64 tokens, got 9223372036854775808"),
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(extra_key=object()), "extra_key must be None, bool, int, str, bytes or a tuple of these .* got object"),
        (dict(extra_key=["a"]), "extra_key must be None, bool, int, str, bytes or a tuple of these .* got list"),
        (dict(extra_key=("a", 2.5)), r"extra_key\[1\] must be None, bool, .* got float"),
        (dict(extra_key=2**64), "extra_key must be an int in the int64 range, got 18446744073709551616"),
        (dict(prior_key="abc"), r"prior_key must be a page key \(64 lowercase hex characters\) or None, got 'abc'"),
        (dict(prior_key="A" * 64), "prior_key must be a page key"),
    ],
)
def test_bad_page_key_arguments(kwargs, match):
    args = {**dict(token_ids=[1, 2, 3, 4], page_size=2), **kwargs}
    with pytest.raises(ValueError, match=match):
        page_keys(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fail_rate=1.5), "fail_rate must be a probability in \\[0, 1\\], got 1.5"),
        (dict(delay_s=-1), "delay_s must be a number of seconds >= 0, got -1"),
        (dict(fail_calls={"get_stats": {1}}), "fail_calls keys must be among get, batch_get"),
        (dict(short_calls={"get": {0}}), r"short_calls\['get'\] must be call numbers \(ints >= 1\), got \[0\]"),
    ],
)
def test_bad_fault_plans(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaultyStorage(file_store(tmp_path / "kv"), **kwargs)
    with pytest.raises(ValueError, match="storage must be a HiCacheStorage, got str"):
        FaultyStorage("dir")
