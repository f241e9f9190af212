"""``RadixKey`` and the byte form the radix tree compares keys in.

A key's token ids are encoded once into little-endian int64 bytes (16 bytes per element for EAGLE's
bigram keys, a pair of tokens each), so that the tree compares a whole node's worth of tokens with
one ``bytes.startswith`` (a ``memcmp``) instead of a Python loop per token. Node keys keep only those
bytes and decode their token ids on first access.

The child key a node is filed under in its parent's ``children`` is SGLang's: the first token (page
size 1), or the tuple of the first page's tokens, wrapped as ``(extra_key, that)`` when the key has
an ``extra_key``; keys of different ``extra_key`` therefore never share a node.
"""

from __future__ import annotations

import struct
import sys
from array import array
from itertools import chain
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

#: Bytes per key element: one int64 token, or a bigram's two.
TOKEN_BYTES = 8
BIGRAM_BYTES = 16
#: Matches shorter than this many key elements are found by comparing slices; longer ones with
#: numpy, whose fixed cost per call pays off only on long keys.
GALLOP_LIMIT = 32

_NATIVE_LITTLE = sys.byteorder == "little"


class RadixKey:
    """A token sequence and the namespace it lives in (SGLang's ``RadixKey``).

    Parameters
    ----------
    token_ids : sequence of int (a list, tuple, ``array('q')``, range or 1-D integer tensor); with
        ``is_bigram``, a sequence of ``(int, int)`` pairs (EAGLE's bigram keys).
    extra_key : any hashable (a LoRA id, a tenant's cache salt), or None. Keys whose ``extra_key``
        differ never share a prefix.
    is_bigram : the elements are already bigram pairs.

    The tree reads ``token_ids`` on the key's first use and keeps their encoding in the key, so the
    sequence must not be changed in place afterwards (assign a new one to ``token_ids`` instead).

    Examples
    --------
    >>> key = RadixKey([1, 2, 3, 4], extra_key="lora-7")
    >>> len(key), list(key[1:3]), key[1:3].extra_key
    (4, [2, 3], 'lora-7')
    """

    __slots__ = ("_token_ids", "extra_key", "is_bigram", "_enc")

    def __init__(self, token_ids: Sequence[Any], extra_key: Optional[Any] = None, is_bigram: bool = False) -> None:
        self._token_ids = token_ids
        self.extra_key = extra_key
        self.is_bigram = bool(is_bigram)
        self._enc: Optional[bytes] = None

    @classmethod
    def from_encoded(cls, enc: bytes, extra_key: Optional[Any], is_bigram: bool) -> "RadixKey":
        """A key over already-encoded elements (the tree's node keys); token ids decode lazily."""
        key = cls.__new__(cls)
        key._token_ids = None
        key.extra_key = extra_key
        key.is_bigram = is_bigram
        key._enc = enc
        return key

    @property
    def token_ids(self) -> Sequence[Any]:
        """The key's elements (a node key's are decoded from its bytes on first read); assigning a new
        sequence drops the kept encoding."""
        if self._token_ids is None:
            self._token_ids = decode(self._enc, self.is_bigram)  # type: ignore[arg-type]
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: Sequence[Any]) -> None:
        self._token_ids = value
        self._enc = None

    def __len__(self) -> int:
        if self._token_ids is None:
            return len(self._enc) // (BIGRAM_BYTES if self.is_bigram else TOKEN_BYTES)  # type: ignore[arg-type]
        return len(self._token_ids)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.token_ids)

    def __getitem__(self, idx: Union[int, slice]) -> "RadixKey":
        if isinstance(idx, slice):
            return RadixKey(self.token_ids[idx], self.extra_key, self.is_bigram)
        return RadixKey([self.token_ids[idx]], self.extra_key, self.is_bigram)

    def __repr__(self) -> str:
        preview = list(self.token_ids[:10])
        more = "..." if len(self) > 10 else ""
        return f"RadixKey(extra_key={self.extra_key!r}, token_ids={preview}{more})"


def encoded(key: RadixKey) -> bytes:
    """The key's elements as little-endian int64 bytes, computed once per key.

    Raises
    ------
    TypeError
        If ``token_ids`` is not a sequence of ints (of int pairs for a bigram key).
    """
    enc = key._enc
    if enc is None:
        enc = key._enc = encode(key._token_ids, key.is_bigram)
    return enc


def encode(token_ids: Any, is_bigram: bool = False) -> bytes:
    """``token_ids`` as little-endian int64 bytes (pairs flattened for a bigram key)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != (2 if is_bigram else 1) or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise TypeError(
                f"key.token_ids must be a {'[N, 2]' if is_bigram else '1-D'} integer tensor, got "
                f"{token_ids.dtype} of shape {tuple(token_ids.shape)}"
            )
        return token_ids.to("cpu", torch.int64).numpy().astype("<i8", copy=False).tobytes()
    if not is_bigram and isinstance(token_ids, array) and token_ids.typecode == "q" and _NATIVE_LITTLE:
        return token_ids.tobytes()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"key.token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:
        if is_bigram:
            if any(len(pair) != 2 for pair in token_ids):
                raise ValueError
            enc = struct.pack(f"<{2 * len(token_ids)}q", *chain.from_iterable(token_ids))
        else:
            enc = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except (struct.error, TypeError, ValueError):
        raise TypeError(_bad_token_message(token_ids, is_bigram)) from None
    _refuse_bools(token_ids, enc, is_bigram)
    return enc


def _refuse_bools(token_ids: Sequence[Any], enc: bytes, is_bigram: bool) -> None:
    """``struct`` packs True and False as 1 and 0; a bool is not a token id. Only the entries packed as
    0 or 1 are looked at, so the check costs one vectorised pass."""
    flat = np.frombuffer(enc, dtype="<i8")
    suspects = np.flatnonzero((flat >> 1) == 0)
    for i in suspects.tolist():
        x = token_ids[i // 2][i % 2] if is_bigram else token_ids[i]
        if isinstance(x, (bool, np.bool_)):
            raise TypeError(_bad_token_message(token_ids, is_bigram))


def _bad_token_message(token_ids: Sequence[Any], is_bigram: bool) -> str:
    what = "(int, int) pairs" if is_bigram else "ints in the int64 range"
    for i, t in enumerate(token_ids):
        items = t if is_bigram and isinstance(t, (tuple, list)) and len(t) == 2 else (t,)
        for x in items:
            if is_bigram and len(items) != 2 or isinstance(x, (bool, np.bool_)) or not isinstance(x, int) or not -(2**63) <= x < 2**63:
                return f"key.token_ids must hold {what}, got {t!r} ({type(t).__name__}) at position {i}"
    return f"key.token_ids must hold {what}"


def decode(enc: bytes, is_bigram: bool) -> list[Any]:
    """The token ids of ``encode``'s bytes: a list of ints, or of ``(int, int)`` pairs."""
    flat = np.frombuffer(enc, dtype="<i8").tolist()
    if is_bigram:
        it = iter(flat)
        return list(zip(it, it))
    return flat


def to_bigram(enc: bytes) -> bytes:
    """EAGLE's bigram key of a plain key: element i is the pair (token i, token i + 1)."""
    t = np.frombuffer(enc, dtype="<i8")
    if t.size < 2:
        return b""
    return np.stack((t[:-1], t[1:]), axis=1).tobytes()


def child_key_fn(page_size: int, is_bigram: bool) -> Callable[[bytes, int, Any], Any]:
    """``f(enc, offset, extra_key)``: SGLang's child key (``get_child_key``) of the page of elements
    starting ``offset`` bytes into ``enc``."""
    flat = struct.Struct(f"<{page_size * (BIGRAM_BYTES if is_bigram else TOKEN_BYTES) // TOKEN_BYTES}q").unpack_from

    if not is_bigram and page_size == 1:

        def plain(enc: bytes, offset: int) -> Any:
            return flat(enc, offset)[0]

    elif not is_bigram or page_size == 1:
        plain = flat  # a page's tuple of tokens, or one bigram's pair

    else:

        def plain(enc: bytes, offset: int) -> Any:
            it = iter(flat(enc, offset))
            return tuple(zip(it, it))

    def child_key(enc: bytes, offset: int, extra_key: Any) -> Any:
        k = plain(enc, offset)
        return k if extra_key is None else (extra_key, k)

    return child_key


def common_prefix(a: bytes, a_off: int, b: bytes, limit: int, unit: int) -> int:
    """Bytes, a multiple of ``unit`` and at most ``limit``, that ``b`` shares with ``a`` from
    ``a_off`` on. ``unit`` is a page of elements; ``limit`` a multiple of it."""
    units = limit // unit
    lo = 0  # units known to match
    step = 1
    while lo < units and step <= GALLOP_LIMIT:
        k = min(lo + step, units)
        if a.startswith(b[lo * unit : k * unit], a_off + lo * unit):
            lo = k
            step <<= 1
        else:
            units = k - 1  # the mismatch is in unit k - 1 or earlier: search (lo, k - 1]
            break
    else:
        if lo >= units:
            return lo * unit
        # Long match: find the first differing int64 with numpy over the rest.
        start = lo * unit
        x = np.frombuffer(a, dtype="<i8", count=(limit - start) // 8, offset=a_off + start)
        y = np.frombuffer(b, dtype="<i8", count=(limit - start) // 8, offset=start)
        diff = x != y
        first = int(diff.argmax())
        if not diff[first]:
            return limit
        return start + (first * 8 // unit) * unit
    while lo < units:
        mid = (lo + units + 1) // 2
        if a.startswith(b[lo * unit : mid * unit], a_off + lo * unit):
            lo = mid
        else:
            units = mid - 1
    return lo * unit
