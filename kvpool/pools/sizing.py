"""How many KV-cache slots (and, for hybrid models, state slots) fit in a memory budget: the
arithmetic a scheduler does at start-up.

An ``MHATokenToKVPool`` holds, per layer, a K buffer ``[size + page_size, head_num, head_dim]`` and a
V buffer ``[size + page_size, head_num, v_head_dim]``; an ``MLATokenToKVPool`` holds, per layer, one
latent buffer ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]``. Either takes
``(size + page_size) * bytes_per_token`` bytes, where ``bytes_per_token`` covers every buffer of every
layer. A hybrid model's ``MambaPool`` takes ``(size + 1) * bytes_per_slot`` bytes for its states and
``(spec_state_size + 1) * K * bytes_per_slot`` for speculative scratch; ``plan_hybrid_pools`` splits
one budget between the two kinds of pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.checks import non_negative_int, positive_int
from kvpool.kernels.formats import CACHE_DTYPES, store_dtype_for
from kvpool.kernels.store_fp4 import FP4_BLOCK, FP4_DTYPE
from kvpool.kernels.store_fp8_token import TOKEN_HEAD_DTYPES
from kvpool.pools.fp4_base import FP4_DTYPE_NAME
from kvpool.pools.mha_fp8_token_pool import check_kv_scale_mode
from kvpool.pools.nvfp4_scales import NVFP4
from kvpool.pools.state_params import MambaCacheParams


#: Element types the sizing takes: every pool dtype, FP4 included where torch has it, and the FP4
#: pools' names (``"fp4_e2m1"``: exponent scales; ``"nvfp4"``: two-level NVFP4).
SIZED_DTYPES: tuple[object, ...] = (
    CACHE_DTYPES + ((FP4_DTYPE,) if FP4_DTYPE is not None else ()) + (FP4_DTYPE_NAME, NVFP4)
)

#: Bytes of one per-token-head scale (float32, one per token, head and K or V).
TOKEN_HEAD_SCALE_BYTES = 4

#: Bytes of an NVFP4 pool's global scales per layer (one float32 for K, one for V).
NVFP4_GLOBAL_SCALE_BYTES = 8

GIB = 2**30


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one rank's KV cache, independent of how many slots it has.

    Parameters
    ----------
    head_num, head_dim : KV heads on this rank and the K head dim.
    layer_num : layers held by this rank.
    dtype : cache element type (FP8, the fnuz formats included, takes one byte per element;
        ``torch.float4_e2m1fn_x2`` or ``"fp4_e2m1"``, the FP4 pools' exponent-scale format, and
        ``"nvfp4"``, their two-level format (MHA only), half a byte per element and one scale byte
        per 16: 9/16 of a byte; NVFP4 adds 8 bytes of global scales per layer, not per token).
    v_head_dim : V head dim; None means ``head_dim``. 0 for an MLA geometry (no V buffer).
    kv_lora_rank : MLA only (build it with :meth:`mla`): the latent part of the row, whose width
        ``head_dim`` is ``kv_lora_rank + qk_rope_head_dim`` with ``head_num`` 1.
    kv_scale_mode : ``"static"`` (default) or ``"per_token_head"``: an
        ``MHATokenToKVPoolFP8PerTokenHead`` (FP8 e4m3fn or e5m2, MHA only), whose float32 scale
        per token and head adds 4 bytes per head for K and 4 for V.

    Examples
    --------
    >>> g = KVGeometry(head_num=8, head_dim=128, layer_num=32, dtype=torch.float8_e4m3fn)
    >>> g.bytes_per_token  # K and V, 32 layers, 8 heads x 128, one byte each
    65536
    >>> g.max_pool_size(2**30, page_size=16)
    16368
    >>> KVGeometry.mla(kv_lora_rank=512, qk_rope_head_dim=64, layer_num=61, dtype=torch.bfloat16).bytes_per_token
    70272
    >>> KVGeometry(8, 128, 32, "nvfp4").bytes_per_token  # 72 bytes per head for K and for V
    36864
    >>> KVGeometry(8, 128, 32, torch.float8_e4m3fn, kv_scale_mode="per_token_head").tokens_per_gib
    15887
    """

    head_num: int
    head_dim: int
    layer_num: int
    dtype: torch.dtype
    v_head_dim: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    kv_scale_mode: str = "static"

    def __post_init__(self) -> None:
        positive_int(self.head_num, "head_num")
        positive_int(self.head_dim, "head_dim")
        positive_int(self.layer_num, "layer_num")
        if not any(self.dtype is d or (isinstance(d, str) and self.dtype == d) for d in SIZED_DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(map(repr, SIZED_DTYPES))}, got {self.dtype!r}")
        if check_kv_scale_mode(self.kv_scale_mode) == "per_token_head":
            if self.dtype not in TOKEN_HEAD_DTYPES:
                raise ValueError(
                    f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2 with kv_scale_mode='per_token_head', "
                    f"got {self.dtype!r}"
                )
            if self.kv_lora_rank is not None:
                raise ValueError("kv_scale_mode must be 'static' for an MLA geometry (no per-token-head MLA pool), "
                                 "got 'per_token_head'")  # fmt: skip
        if self.dtype == NVFP4 and self.kv_lora_rank is not None:
            raise ValueError("dtype must not be 'nvfp4' for an MLA geometry (MLATokenToKVPoolFP4 stores exponent scales), "
                             "got 'nvfp4'")  # fmt: skip
        if self.is_fp4 and self.head_dim % FP4_BLOCK:
            raise ValueError(f"head_dim must be a multiple of {FP4_BLOCK} for FP4, got {self.head_dim}")
        if self.kv_lora_rank is not None:  # MLA: one latent row per token and layer, no V buffer
            positive_int(self.kv_lora_rank, "kv_lora_rank")
            if self.head_num != 1:
                raise ValueError(f"head_num must be 1 for an MLA geometry (one latent row), got {self.head_num}")
            if self.kv_lora_rank >= self.head_dim:
                raise ValueError(
                    f"kv_lora_rank must be less than head_dim = kv_lora_rank + qk_rope_head_dim = {self.head_dim}, "
                    f"got {self.kv_lora_rank}"
                )
            if self.v_head_dim not in (None, 0):
                raise ValueError(f"v_head_dim must be 0 for an MLA geometry (no V buffer), got {self.v_head_dim!r}")
            object.__setattr__(self, "v_head_dim", 0)
        elif self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        else:
            positive_int(self.v_head_dim, "v_head_dim")
            if self.is_fp4 and self.v_head_dim % FP4_BLOCK:
                raise ValueError(f"v_head_dim must be a multiple of {FP4_BLOCK} for FP4, got {self.v_head_dim}")

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int, dtype: torch.dtype) -> "KVGeometry":
        """The geometry of an ``MLATokenToKVPool``: one row of ``kv_lora_rank + qk_rope_head_dim``
        elements per token and layer (``head_num`` 1, ``head_dim`` the row, ``v_head_dim`` 0)."""
        positive_int(kv_lora_rank, "kv_lora_rank")
        positive_int(qk_rope_head_dim, "qk_rope_head_dim")
        return cls(1, kv_lora_rank + qk_rope_head_dim, layer_num, dtype, v_head_dim=0, kv_lora_rank=kv_lora_rank)

    @property
    def is_fp4(self) -> bool:
        """Whether the cache is FP4 (either format: 9/16 of a byte per element)."""
        return (FP4_DTYPE is not None and self.dtype is FP4_DTYPE) or self.dtype in (FP4_DTYPE_NAME, NVFP4)

    @property
    def is_mla(self) -> bool:
        """Whether this is an MLA geometry (one latent row per token, no V)."""
        return self.kv_lora_rank is not None

    @property
    def qk_rope_head_dim(self) -> Optional[int]:
        """The rotary part of an MLA row (None for MHA)."""
        return None if self.kv_lora_rank is None else self.head_dim - self.kv_lora_rank

    @property
    def bytes_per_token(self) -> int:
        """Bytes one slot takes across all layers, K and V together (MLA: the latent row), scales
        included: FP4 counts its scale bytes (72 bytes per head and token at head_dim 128, against
        128 for FP8), per-token-head FP8 its float32 scale per head for K and for V."""
        dims = self.head_dim + self.v_head_dim  # type: ignore[operator]
        if self.is_fp4:
            return self.layer_num * self.head_num * dims * (FP4_BLOCK // 2 + 1) // FP4_BLOCK
        per_head = dims * store_dtype_for(self.dtype).itemsize  # type: ignore[arg-type]
        if self.kv_scale_mode == "per_token_head":
            per_head += 2 * TOKEN_HEAD_SCALE_BYTES
        return self.layer_num * self.head_num * per_head

    @property
    def fixed_bytes(self) -> int:
        """Bytes the pool allocates whatever its size: an NVFP4 pool's global scales (8 per layer),
        else 0."""
        return self.layer_num * NVFP4_GLOBAL_SCALE_BYTES if self.dtype == NVFP4 else 0

    @property
    def tokens_per_gib(self) -> int:
        """Slots one GiB holds: ``2**30 // bytes_per_token`` (reserved rows and ``fixed_bytes``
        left out: the figure to compare formats by)."""
        return GIB // self.bytes_per_token

    def pool_bytes(self, size: int, page_size: int = 1) -> int:
        """Bytes a pool of this geometry built with ``(size, page_size)`` allocates: an
        ``MHATokenToKVPool`` (MLA: ``MLATokenToKVPool``), or the FP4 or per-token-head FP8 pool its
        ``dtype`` and ``kv_scale_mode`` name, every buffer included."""
        positive_int(size, "size")
        positive_int(page_size, "page_size")
        return (size + page_size) * self.bytes_per_token + self.fixed_bytes

    def max_pool_size(self, budget_bytes: int, page_size: int = 1) -> int:
        """The largest pool ``size`` whose buffers fit in ``budget_bytes`` (see ``max_pool_size``)."""
        if isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool) and budget_bytes >= 0:
            budget_bytes = max(budget_bytes - self.fixed_bytes, 0)
        return max_pool_size(budget_bytes, self.bytes_per_token, page_size)


def kv_bytes_per_token(
    head_num: int, head_dim: int, v_head_dim: Optional[int], layer_num: int, dtype: torch.dtype
) -> int:
    """Bytes one KV-cache slot takes across ``layer_num`` layers, K and V together.

    ``layer_num * head_num * (head_dim + v_head_dim) * element size`` (FP8: one byte). SGLang calls
    this the cell size.

    Examples
    --------
    >>> kv_bytes_per_token(8, 128, None, 32, torch.bfloat16)
    131072
    """
    return KVGeometry(head_num, head_dim, layer_num, dtype, v_head_dim).bytes_per_token


def mla_kv_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
    """Bytes one MLA KV-cache slot takes across ``layer_num`` layers: ``layer_num * (kv_lora_rank +
    qk_rope_head_dim) * element size`` (one latent row per layer, no V).

    Examples
    --------
    >>> mla_kv_bytes_per_token(512, 64, 61, torch.float8_e4m3fn)  # DeepSeek-V3, FP8
    35136
    """
    return KVGeometry.mla(kv_lora_rank, qk_rope_head_dim, layer_num, dtype).bytes_per_token


def max_pool_size(budget_bytes: int, bytes_per_token: int, page_size: int = 1) -> int:
    """The largest ``size`` such that a pool of ``size + page_size`` rows fits in ``budget_bytes``.

    With ``page_size > 1`` the size is rounded down to whole pages, so a
    ``PagedTokenToKVPoolAllocator(size, page_size)`` uses every slot.

    Parameters
    ----------
    budget_bytes : memory set aside for the KV cache (non-negative int).
    bytes_per_token : from ``kv_bytes_per_token`` or ``KVGeometry.bytes_per_token``.
    page_size : the pool's page size.

    Returns
    -------
    int, at least ``page_size``.

    Raises
    ------
    ValueError
        If the budget cannot hold the ``page_size`` reserved rows plus one page.

    Examples
    --------
    >>> max_pool_size(10_000, bytes_per_token=100, page_size=16)
    80
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    positive_int(bytes_per_token, "bytes_per_token")
    positive_int(page_size, "page_size")
    rows = budget_bytes // bytes_per_token
    size = (rows - page_size) // page_size * page_size
    if size < page_size:
        need = 2 * page_size * bytes_per_token
        raise ValueError(
            f"budget_bytes must be at least {need} (the reserved page and one more of {page_size} slots "
            f"at {bytes_per_token} B each), got {budget_bytes}"
        )
    return size


@dataclass(frozen=True)
class HybridSizing:
    """How one rank's memory budget splits for a hybrid linear-attention model: KV slots for the
    full-attention layers, state slots for the linear layers, and speculative scratch.

    Attributes
    ----------
    kv_size : ``size`` of the ``HybridLinearKVPool`` (KV slots, whole pages).
    mamba_size : ``size`` of the ``MambaPool`` (state slots: one per request plus its track slots).
    spec_state_size : batch positions of speculative scratch (0 without speculative decoding).
    max_running_requests : requests whose states (and scratch) fit at once.
    kv_bytes, state_bytes, spec_bytes : bytes the pools allocate for each part, padding rows
        included (the KV pool's reserved page, the state pool's slot 0, the scratch's extra row).
    """

    kv_size: int
    mamba_size: int
    spec_state_size: int
    max_running_requests: int
    kv_bytes: int
    state_bytes: int
    spec_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes of all three parts: ``kv_bytes + state_bytes + spec_bytes``."""
        return self.kv_bytes + self.state_bytes + self.spec_bytes

    @property
    def tokens_per_request(self) -> int:
        """KV slots per request when all ``max_running_requests`` run at once."""
        return self.kv_size // self.max_running_requests


def plan_hybrid_pools(
    budget_bytes: int,
    kv_bytes_per_token: int,
    state: object,
    *,
    page_size: int = 1,
    max_running_requests: Optional[int] = None,
    tokens_per_request: Optional[int] = None,
    speculative_num_draft_tokens: Optional[int] = None,
    track_slots_per_request: int = 0,
) -> HybridSizing:
    """Split ``budget_bytes`` between KV slots and state slots (plus speculative scratch).

    A request needs one state slot plus ``track_slots_per_request`` (SGLang's ``extra_buffer``
    keeps 2 without speculative decoding, 1 with it) and, with ``speculative_num_draft_tokens = K``,
    a scratch row of ``K`` states per batch position. Give exactly one of:

    * ``max_running_requests``: the states and scratch of that many requests are set aside first,
      and everything left goes to KV slots;
    * ``tokens_per_request``: the most requests that fit when each also holds that many KV slots;
      what is left over after them goes to KV slots too.

    Parameters
    ----------
    budget_bytes : memory for the pools (non-negative int); the bytes a KV pool allocates whatever
        its size (``KVGeometry.fixed_bytes``: an NVFP4 part's global scales) come off it first, by
        the caller.
    kv_bytes_per_token : bytes of one KV slot over the full-attention layers (``KVGeometry``).
    state : a ``MambaCacheParams`` (or SGLang's ``Mamba2CacheParams``): bytes of one state slot.
    page_size : the KV pool's page size.

    Returns
    -------
    HybridSizing, whose sizes build pools that fit in ``budget_bytes``.

    Raises
    ------
    ValueError
        If not even one request (with one page of KV) fits, naming the bytes needed.

    Examples
    --------
    >>> from kvpool.pools.state_params import MambaCacheParams, MambaStateShape
    >>> gdn = MambaCacheParams(MambaStateShape(conv=(1536, 3), temporal=(8, 128, 128)), layers=range(45))
    >>> s = plan_hybrid_pools(64 * 2**30, 7680, gdn, page_size=64, max_running_requests=64,
    ...                       speculative_num_draft_tokens=16, track_slots_per_request=1)
    >>> s.mamba_size, s.spec_state_size, s.kv_size, s.tokens_per_request
    (128, 64, 5293440, 82710)
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    positive_int(kv_bytes_per_token, "kv_bytes_per_token")
    positive_int(page_size, "page_size")
    slot_bytes = MambaCacheParams.of(state).bytes_per_slot
    non_negative_int(track_slots_per_request, "track_slots_per_request")
    k = 0
    if speculative_num_draft_tokens is not None:
        k = positive_int(speculative_num_draft_tokens, "speculative_num_draft_tokens")
    if (max_running_requests is None) == (tokens_per_request is None):
        raise ValueError("give exactly one of max_running_requests and tokens_per_request")
    slots = 1 + track_slots_per_request
    # Fixed costs: the KV pool's reserved page plus one page, the state pool's slot 0, the scratch's extra row.
    fixed = 2 * page_size * kv_bytes_per_token + slot_bytes + k * slot_bytes
    per_request_state = (slots + k) * slot_bytes
    if max_running_requests is not None:
        requests = positive_int(max_running_requests, "max_running_requests")
    else:
        tokens = positive_int(tokens_per_request, "tokens_per_request")
        requests = (budget_bytes - fixed) // (per_request_state + tokens * kv_bytes_per_token)
    need = fixed + max(requests, 1) * per_request_state
    if requests < 1 or budget_bytes < need:
        one = fixed + per_request_state + (0 if tokens_per_request is None else tokens_per_request * kv_bytes_per_token)
        raise ValueError(
            f"budget_bytes must be at least {max(need, one)} for one page of KV and the states of "
            f"{max(requests, 1)} request(s) at {per_request_state} B each, got {budget_bytes}"
        )
    mamba_size = requests * slots
    state_bytes = (mamba_size + 1) * slot_bytes
    spec_bytes = (requests + 1) * k * slot_bytes
    kv_size = max_pool_size(budget_bytes - state_bytes - spec_bytes, kv_bytes_per_token, page_size)
    return HybridSizing(
        kv_size, mamba_size, requests if k else 0, requests, (kv_size + page_size) * kv_bytes_per_token,
        state_bytes, spec_bytes,
    )  # fmt: skip


@dataclass(frozen=True)
class SWASizing:
    """How one rank's memory budget splits for a model with sliding-window layers (an
    ``SWAKVPool``), and for the draft model of speculative decoding beside it.

    Attributes
    ----------
    size : slots of the full-attention part (``SWAKVPool``'s ``size``): the tokens that can be held.
    size_swa : slots of the sliding-window part (``size_swa``), ``swa_full_tokens_ratio`` of ``size``
        rounded down to whole pages (at least one page).
    draft_size : slots of the draft model's pool (0 without one): ``size``, the full part's count
        after the split, since a draft pool holds every token its target holds.
    full_bytes, swa_bytes, draft_bytes : bytes each pool allocates, its reserved page and fixed bytes
        (``KVGeometry.fixed_bytes``) included.
    """

    size: int
    size_swa: int
    draft_size: int
    full_bytes: int
    swa_bytes: int
    draft_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes of all the pools: ``full_bytes + swa_bytes + draft_bytes``."""
        return self.full_bytes + self.swa_bytes + self.draft_bytes


def plan_swa_pools(
    budget_bytes: int,
    full: KVGeometry,
    swa: KVGeometry,
    swa_full_tokens_ratio: float,
    *,
    page_size: int = 1,
    draft: Optional[KVGeometry] = None,
) -> SWASizing:
    """Split ``budget_bytes`` between the full-attention and sliding-window parts of an
    ``SWAKVPool`` so that the SWA part holds ``swa_full_tokens_ratio`` as many tokens as the full
    part (SGLang's ``--swa-full-tokens-ratio``, 0.8 by default there), and the pool of a draft model
    (``draft``) as many as the full part.

    The largest page-aligned ``size`` is taken whose pools fit exactly: ``(size + page_size)`` rows of
    ``full`` (and of ``draft``) plus ``(size_swa + page_size)`` rows of ``swa``, with ``size_swa =
    floor(size * ratio)`` rounded down to pages and at least one page. SGLang solves the same split
    from its token count without the reserved pages and sizes a draft pool before it.

    Parameters
    ----------
    budget_bytes : memory for the pools (non-negative int).
    full, swa : the geometries of the full-attention layers and of the sliding-window layers
        (``layer_num`` of each kind; the SWA layers may have their own head count and dims).
    swa_full_tokens_ratio : SWA tokens per full token, in (0, 1].
    page_size : the pools' page size.
    draft : the draft model's geometry (its layers' KV), or None.

    Returns
    -------
    SWASizing, whose sizes build pools that fit in ``budget_bytes``.

    Raises
    ------
    ValueError
        For a ratio outside (0, 1], or a budget that does not hold one page in each pool.

    Examples
    --------
    >>> bf16 = torch.bfloat16  # gpt-oss-120b's 18 full and 18 sliding layers, 8 KV heads x 64
    >>> s = plan_swa_pools(2**30, KVGeometry(8, 64, 18, bf16), KVGeometry(8, 64, 18, bf16), 0.5, page_size=64)
    >>> s.size, s.size_swa, s.total_bytes <= 2**30
    (19328, 9664, True)
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    if isinstance(swa_full_tokens_ratio, bool) or not isinstance(swa_full_tokens_ratio, (int, float)) or not (
        0 < swa_full_tokens_ratio <= 1
    ):
        raise ValueError(f"swa_full_tokens_ratio must be a number in (0, 1], got {swa_full_tokens_ratio!r}")
    for g, name in ((full, "full"), (swa, "swa"), (draft, "draft")):
        if not (g is None and name == "draft") and not isinstance(g, KVGeometry):
            raise ValueError(f"{name} must be a KVGeometry, got {type(g).__name__}")
    p = positive_int(page_size, "page_size")
    f = full.bytes_per_token + (draft.bytes_per_token if draft is not None else 0)
    s = swa.bytes_per_token

    def swa_size(size: int) -> int:
        return max(int(size * swa_full_tokens_ratio) // p * p, p)

    # What the pools allocate whatever their sizes (NVFP4's global scales) comes off the top.
    fixed = full.fixed_bytes + swa.fixed_bytes + (draft.fixed_bytes if draft is not None else 0)

    def fits(size: int) -> bool:
        return (size + p) * f + (swa_size(size) + p) * s + fixed <= budget_bytes

    # The exact split of the budget, then down by pages until the rounded sizes fit.
    size = max(int((budget_bytes - fixed - p * (f + s)) / (f + swa_full_tokens_ratio * s)) // p * p, p)
    while size > p and not fits(size):
        size -= p
    while fits(size + p):  # the SWA part's rounding down may leave room for more
        size += p
    if not fits(size):
        raise ValueError(
            f"budget_bytes must be at least {2 * p * (f + s) + fixed} (a reserved page and one more in each pool), "
            f"got {budget_bytes}"
        )
    size_swa = swa_size(size)
    draft_size = size if draft is not None else 0
    return SWASizing(
        size, size_swa, draft_size, full.pool_bytes(size, p), swa.pool_bytes(size_swa, p),
        draft.pool_bytes(size, p) if draft is not None else 0,
    )  # fmt: skip
