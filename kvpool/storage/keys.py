"""Page keys for the storage tier: the same tokens and ``extra_key`` give the same key in every
process, and a key never names another prefix (docs/contract.md, "Storage tier", "Keys").

A page's key is a SHA-256 digest (64 hex characters) chained from the key of the page before it:

    seed      = SHA-256(b"kvpool.storage.seed\\0")
    key[0]    = SHA-256(b"kvpool.storage.page\\0" || seed     || encode(extra_key) || page[0])
    key[i]    = SHA-256(b"kvpool.storage.page\\0" || key[i-1] || encode(extra_key) || page[i])

where ``key[i-1]`` and ``seed`` are the 32 raw digest bytes, ``encode(extra_key)`` is
:func:`encode_extra_key` (type-tagged, lengths in front), and ``page[i]`` is the page's element
kind (a byte: 1 tokens, 2 EAGLE bigrams), its element count (uint64) and its elements as int64
(two per bigram), all little-endian. Every field has a fixed width or a length in front, so two different
(extra_key, token prefix) pairs never encode to the same bytes; a key therefore stands for its
whole prefix and its ``extra_key``, not only its own page. Python's ``hash()`` (salted per
process) is never used.

A hybrid model's state snapshot after a page (the linear layers' state once the prefix through that
page is computed) has a key of its own, :func:`state_key`: a digest of another tag, the state pool's
geometry (:func:`state_geometry`) and the page's key, so it never equals a page key, another
prefix's state key, or the key of a state laid out differently (another model's layers, shapes or
dtypes).

Where a page is stored is a second digest, of the backend's namespace (model, ranks, page geometry:
:func:`key_namespace`) and the key: :func:`storage_name` / :func:`storage_digest`. File names and
store keys are that digest, never text a caller passed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Optional, Sequence

import numpy as np
import torch

from kvpool.checks import positive_int

_SEED_TAG = b"kvpool.storage.seed\x00"
_PAGE_TAG = b"kvpool.storage.page\x00"
_NAME_TAG = b"kvpool.storage.name\x00"
_STATE_TAG = b"kvpool.storage.state\x00"
_SEED = hashlib.sha256(_SEED_TAG).digest()
_INT64 = (-(1 << 63), (1 << 63) - 1)


def encode_extra_key(extra_key: object, name: str = "extra_key") -> bytes:
    """The unambiguous bytes of an ``extra_key``: None, bool, int (int64 range), str, bytes, or a
    tuple of these (nested), each with a type tag and, where it varies, a length.

    Raises
    ------
    ValueError
        Any other type (its ``hash()`` would differ between processes), or an int out of range.
    """
    if extra_key is None:
        return b"N"
    if isinstance(extra_key, bool):
        return b"B" + bytes([extra_key])
    if isinstance(extra_key, int):
        if not _INT64[0] <= extra_key <= _INT64[1]:
            raise ValueError(f"{name} must be an int in the int64 range, got {extra_key}")
        return b"I" + struct.pack("<q", extra_key)
    if isinstance(extra_key, str):
        raw = extra_key.encode("utf-8", "surrogatepass")
        return b"S" + struct.pack("<Q", len(raw)) + raw
    if isinstance(extra_key, (bytes, bytearray)):
        return b"Y" + struct.pack("<Q", len(extra_key)) + bytes(extra_key)
    if isinstance(extra_key, tuple):
        parts = [encode_extra_key(e, f"{name}[{i}]") for i, e in enumerate(extra_key)]
        return b"T" + struct.pack("<Q", len(parts)) + b"".join(parts)
    raise ValueError(
        f"{name} must be None, bool, int, str, bytes or a tuple of these (the same bytes in every process), "
        f"got {type(extra_key).__name__}"
    )


def token_array(token_ids: object) -> np.ndarray:
    """``token_ids`` (a sequence, tensor or NumPy array of int64 tokens or (int, int) bigrams) as a
    contiguous little-endian int64 array, ``[n]`` or ``[n, 2]``; ``ValueError`` naming the first bad
    entry otherwise."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
        arr = token_ids.detach().cpu().numpy()
    elif isinstance(token_ids, np.ndarray) and token_ids.dtype.kind in "iu":
        arr = token_ids
    elif isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ValueError(f"token_ids must be a sequence of ints or of (int, int) bigrams, got {type(token_ids).__name__}")
    else:
        try:
            arr = np.asarray(token_ids) if len(token_ids) else np.zeros(0, dtype=np.int64)
        except (ValueError, OverflowError):  # ragged pairs, ints past uint64
            arr = np.asarray(token_ids, dtype=object)
        if arr.dtype.kind == "u" and arr.size and arr.max() > _INT64[1]:
            arr = arr.astype(object)
        if arr.dtype.kind not in "iu" or any(type(t) is bool for t in token_ids):
            arr = np.asarray(token_ids, dtype=object)
            flat = arr.reshape(-1)
            for j, t in enumerate(flat):
                if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)) or not _INT64[0] <= t <= _INT64[1]:
                    # the first entry that is not an int64 (a bigram's pairs are checked flat)
                    at = j if arr.ndim == 1 else j // 2
                    raise ValueError(f"token_ids[{at}] must be an int64 token or an (int, int) bigram, got {token_ids[at]!r}")
            arr = flat.astype(np.int64).reshape(arr.shape)
    if arr.dtype.kind == "u" and arr.size and arr.max() > _INT64[1]:  # would wrap to a negative token
        raise ValueError(f"token_ids must hold int64 tokens, got {int(arr.max())} ({arr.dtype})")
    if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[1] != 2):
        raise ValueError(f"token_ids must be 1-D (tokens) or [n, 2] (bigrams), got shape {tuple(arr.shape)}")
    return np.ascontiguousarray(arr, dtype="<i8")


def check_key_digest(key: object, name: str) -> bytes:
    """The 32 digest bytes of a page key (64 lowercase hex characters), else ValueError naming ``name``."""
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"{name} must be a page key (64 lowercase hex characters) or None, got {key!r}")
    return bytes.fromhex(key)


def page_keys(
    token_ids: object, page_size: int, extra_key: Optional[Any] = None, prior_key: Optional[str] = None
) -> list[str]:
    """The keys of the whole pages of ``token_ids`` (a trailing partial page has none).

    Parameters
    ----------
    token_ids : a sequence (or 1-D integer tensor or NumPy array) of int64 tokens, or of (int, int)
        bigrams (EAGLE's keys; an ``[n, 2]`` tensor or array).
    page_size : tokens per page (>= 1).
    extra_key : the radix key's namespace (a LoRA id, a tenant's salt): see :func:`encode_extra_key`.
    prior_key : the key of the page before ``token_ids[0]`` (to continue a chain), or None when
        ``token_ids`` starts the sequence.

    Returns
    -------
    list of str : 64 hex characters each, ``len(token_ids) // page_size`` of them.

    Raises
    ------
    ValueError
        Bad ``token_ids``, ``page_size``, ``extra_key`` or ``prior_key``, naming it.

    Examples
    --------
    >>> a = page_keys([1, 2, 3, 4, 5], 2)             # two keys: pages [1, 2] and [3, 4]
    >>> page_keys([3, 4], 2, prior_key=a[0]) == a[1:]
    True
    """
    page_size = positive_int(page_size, "page_size")
    elements = token_array(token_ids)
    extra = encode_extra_key(extra_key)
    prev = _SEED if prior_key is None else check_key_digest(prior_key, "prior_key")
    kind = b"\x01" if elements.ndim == 1 else b"\x02"
    count = struct.pack("<Q", page_size)
    keys = []
    for start in range(0, elements.shape[0] - page_size + 1, page_size):
        page = kind + count + elements[start : start + page_size].tobytes()
        prev = hashlib.sha256(_PAGE_TAG + prev + extra + page).digest()
        keys.append(prev.hex())
    return keys


def key_namespace(config: Any, host_pool: Any = None) -> str:
    """The namespace a backend stores pages under: the model, the ranks whose pages differ, and (with
    ``host_pool``) the page geometry, as canonical JSON (sorted keys, no spaces).

    ``config`` is a :class:`~kvpool.storage.base.HiCacheStorageConfig`. An MLA model's pages are the
    same on every tensor-parallel rank, so its ``tp_rank`` / ``tp_size`` are left out; the pipeline
    stage is kept (each holds its own layers). The geometry names the element and storage dtypes,
    page size, layers (count and first id), heads, head dims and layout, so a page is only ever read
    back into a host pool that lays its bytes out the same way. For a pool whose rows carry scales
    beside their codes it also names the stored format (``"torch.float4_e2m1fn_x2/nvfp4"``, ...,
    ``"torch.float8_e4m3fn/fp8_per_token_head"``), each part's name and row shape, and an NVFP4
    pool's per-layer global scales: an FP8 page is never read into an FP4 pool, nor an NVFP4 page
    into a pool that reads its codes under other global scales. A static-scale FP8 pool does not
    know the scales its writes were given: a caller names them in ``extra_config["kv_scales"]``
    (any JSON value), and they become part of the namespace.
    """
    fields: dict[str, Any] = {
        "format": 1,
        "model": config.model_name,
        "pp": [config.pp_rank, config.pp_size],
        "mla": config.is_mla_model,
        "page_first": config.is_page_first_layout,
    }
    if not config.is_mla_model:
        fields["tp"] = [config.tp_rank, config.tp_size]
    if host_pool is not None:
        fields["geometry"] = {
            "dtype": str(host_pool.dtype),
            "store_dtype": str(host_pool.store_dtype),
            "page_size": host_pool.page_size,
            "layers": [host_pool.start_layer, host_pool.layer_num],
            "heads": host_pool.head_num,
            "head_dims": [host_pool.head_dim, host_pool.v_head_dim],
            "layout": host_pool.layout,
            "page_bytes": list(host_pool.page_bytes),
        }
        parts = getattr(host_pool, "parts", None)
        if parts is not None and not parts.kv_only:
            fields["geometry"]["format"] = parts.fmt
            fields["geometry"]["parts"] = [[n, list(r), str(d)] for n, r, d in zip(parts.names, parts.rows, parts.dtypes)]
        if getattr(host_pool, "global_scales", ()):
            fields["geometry"]["global_scales"] = [list(kv) for kv in host_pool.global_scales]
    if config.extra_config and "kv_scales" in config.extra_config:
        fields["kv_scales"] = config.extra_config["kv_scales"]
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def storage_name(namespace: str, key: str) -> bytes:
    """The bytes a stored page belongs to: a tag, then the namespace and the key, each UTF-8 with its
    length (uint32, little-endian) in front. A backend keeps them with the page (inside its
    checksum) and compares them on every read."""
    ns, k = namespace.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass")
    return _NAME_TAG + struct.pack("<I", len(ns)) + ns + struct.pack("<I", len(k)) + k


def storage_digest(namespace: str, key: str) -> str:
    """Where a page is stored: SHA-256 of :func:`storage_name`, 64 hex characters (a file name, a
    store key). Never built from the caller's text itself."""
    return hashlib.sha256(storage_name(namespace, key)).hexdigest()


def state_geometry(state_host: Any) -> str:
    """What a state snapshot's bytes mean, as canonical JSON: the state pool's layers, the shapes and
    dtypes of its convolution windows and SSM state, and the bytes of one slot. ``state_host`` is a
    ``kvpool.host.MambaPoolHost`` (its ``device_pool.cache_params`` and ``slot_bytes``)."""
    params = state_host.device_pool.cache_params
    fields = {
        "format": 1,
        "layers": list(params.layers),
        "conv": [list(s) for s in params.shape.conv],
        "temporal": list(params.shape.temporal),
        "dtypes": [str(params.dtype.conv), str(params.dtype.temporal)],
        "slot_bytes": state_host.slot_bytes,
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def state_key(page_key: str, geometry: str) -> str:
    """The key of the state snapshot after the page ``page_key`` (its whole prefix) in a state pool
    of ``geometry`` (:func:`state_geometry`): SHA-256 of a tag, the geometry (UTF-8, its length as
    uint32 little-endian in front) and the page key's 32 digest bytes, as 64 hex characters.

    Raises
    ------
    ValueError
        ``page_key`` not a page key, ``geometry`` not a str.
    """
    digest = check_key_digest(page_key, "page_key")
    if not isinstance(geometry, str):
        raise ValueError(f"geometry must be a str (state_geometry's JSON), got {type(geometry).__name__}")
    g = geometry.encode("utf-8", "surrogatepass")
    return hashlib.sha256(_STATE_TAG + struct.pack("<I", len(g)) + g + digest).hexdigest()
