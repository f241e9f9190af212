"""Page keys name exactly one (extra_key, token prefix): they match the documented SHA-256 chain
(computed here from the contract's byte layout, not by kvpool), are the same in another process,
continue a chain from any page, differ whenever the prefix, a page boundary or the ``extra_key``
differs, and the namespace a page is stored under separates models, ranks and page geometries.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from kvassert import make_device_pool, make_host

from kvpool.storage import HiCacheStorageConfig, key_namespace, page_keys, storage_digest

REPO = Path(__file__).resolve().parents[1]


def oracle_keys(tokens, page_size, extra=b"N", bigram=False):
    """The contract's chain, spelled with hashlib and struct (``extra`` is the encoded extra_key)."""
    prev = hashlib.sha256(b"kvpool.storage.seed\x00").digest()
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        flat = [x for pair in page for x in pair] if bigram else page
        body = (b"\x02" if bigram else b"\x01") + struct.pack("<Q", page_size) + struct.pack(f"<{len(flat)}q", *flat)
        prev = hashlib.sha256(b"kvpool.storage.page\x00" + prev + extra + body).digest()
        keys.append(prev.hex())
    return keys


def test_keys_follow_the_documented_chain():
    tokens = [0, 1, -1, 2**63 - 1, -(2**63), 151_643, 7]
    assert page_keys(tokens, 2) == oracle_keys(tokens, 2)  # the trailing 7 is a partial page: no key
    assert len(page_keys(tokens, 2)) == 3 and page_keys(tokens[:1], 2) == []
    assert page_keys(tokens, 3, extra_key="lora-7") == oracle_keys(tokens, 3, b"S" + struct.pack("<Q", 6) + b"lora-7")
    assert page_keys(tokens, 1, extra_key=5) == oracle_keys(tokens, 1, b"I" + struct.pack("<q", 5))
    pairs = [(1, 2), (3, 4), (5, 6)]
    assert page_keys(pairs, 1) == oracle_keys(pairs, 1, bigram=True)


def test_every_form_of_the_same_tokens_gives_the_same_keys():
    tokens = list(range(1000, 1016))
    want = page_keys(tokens, 4)
    for form in (tuple(tokens), torch.tensor(tokens), torch.tensor(tokens, dtype=torch.int32), range(1000, 1016)):
        assert page_keys(form, 4) == want, type(form).__name__
    assert page_keys(torch.tensor([[1, 2], [3, 4]]), 2) == page_keys([(1, 2), (3, 4)], 2)


def test_keys_are_the_same_in_another_process():
    code = "import sys; from kvpool.storage import page_keys; print(' '.join(page_keys(list(range(64)), 16, extra_key=('t', 3))))"
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True).stdout.split()[0])
    assert outs == {page_keys(list(range(64)), 16, extra_key=("t", 3))[0]}


def test_a_chain_continues_from_any_page():
    tokens = list(range(40))
    keys = page_keys(tokens, 8, extra_key="x")
    for i in range(1, 5):
        assert page_keys(tokens[8 * i :], 8, extra_key="x", prior_key=keys[i - 1]) == keys[i:]


def test_a_key_stands_for_its_whole_prefix():
    # The same page of tokens after different prefixes, or at another page boundary, is another key.
    a = page_keys([1, 2, 9, 9], 2)
    b = page_keys([3, 4, 9, 9], 2)
    assert a[1] != b[1]
    assert page_keys([1, 2, 3, 4], 4)[0] not in page_keys([1, 2, 3, 4], 2)
    assert page_keys([1, 2], 1)[1] != page_keys([2], 1)[0]
    # A bigram page is not the page of its flattened tokens.
    assert page_keys([(1, 2)], 1) != page_keys([1, 2], 2)


@pytest.mark.parametrize(
    "x, y",
    [(None, ""), ("ab", b"ab"), ("1", 1), (1, True), (("a", "b"), ("ab",)), (("a", ("b",)), (("a", "b"),)), ("ab", ("ab",)), (0, False)],
)
def test_extra_keys_of_different_values_never_meet(x, y):
    tokens = list(range(8))
    assert not set(page_keys(tokens, 4, extra_key=x)) & set(page_keys(tokens, 4, extra_key=y))


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.text(max_size=3), st.integers(-3, 3)),
            st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 3), min_size=1, max_size=6),
        ),
        min_size=2,
        max_size=6,
    ),
    st.integers(1, 3),
)
def test_distinct_prefixes_get_distinct_keys(cases, page_size):
    seen: dict[str, tuple] = {}
    for extra, tokens in cases:
        for i, key in enumerate(page_keys(tokens, page_size, extra_key=extra)):
            prefix = (type(extra).__name__, extra, tuple(tokens[: (i + 1) * page_size]))
            assert seen.setdefault(key, prefix) == prefix


def test_the_namespace_separates_models_ranks_and_geometry():
    base = HiCacheStorageConfig(tp_rank=0, tp_size=2, model_name="m")
    spaces = {
        key_namespace(base),
        key_namespace(HiCacheStorageConfig(tp_rank=1, tp_size=2, model_name="m")),
        key_namespace(HiCacheStorageConfig(tp_rank=0, tp_size=2, model_name="n")),
        key_namespace(HiCacheStorageConfig(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2, model_name="m")),
        key_namespace(HiCacheStorageConfig(tp_rank=0, tp_size=2, model_name="m", is_page_first_layout=True)),
        key_namespace(base, make_host(make_device_pool(), "layer_first")),
        key_namespace(base, make_host(make_device_pool(), "page_first")),
        key_namespace(base, make_host(make_device_pool(dtype=torch.bfloat16), "layer_first")),
        key_namespace(base, make_host(make_device_pool(page_size=8), "layer_first", page_size=8)),
    }
    assert len(spaces) == 9
    # An MLA model's pages are the same on every tensor-parallel rank.
    assert key_namespace(HiCacheStorageConfig(0, 2, is_mla_model=True)) == key_namespace(HiCacheStorageConfig(1, 2, is_mla_model=True))
    key = page_keys([1, 2], 2)[0]
    digests = {storage_digest(ns, key) for ns in spaces}
    assert len(digests) == 9 and all(len(d) == 64 and int(d, 16) >= 0 for d in digests)
