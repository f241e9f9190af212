"""A request's linear-attention state between ranks: which part of a ``MambaPool`` slot a rank holds,
how the two ranks compare their state geometry, and the byte bands of a slot that travel.

A linear-attention layer's slot holds convolution windows ``[conv_dim, conv_kernel - 1]`` and an SSM
state ``[v_heads, v_head_dim, k_head_dim]``. Under tensor parallelism each rank holds a contiguous
range of the model's value heads (the SSM state's first dimension) and of its key heads, and each
convolution's channels are bands of heads: a Gated DeltaNet convolution runs over the query, key and
value channels (``conv_bands="kkv"``: ``k_heads * k_head_dim`` query channels, as many key channels,
``v_heads * v_head_dim`` value channels), a Mamba2 convolution over x, B and C (``"vkk"``). Every
channel keeps its ``conv_kernel - 1`` columns together, so a range of heads is one contiguous byte
range of each band. A transfer moves, for every linear layer, the heads both ranks hold: one byte
band per convolution band and one of the SSM state, in that order, layer after layer.

docs/contract.md, "KV transfer between ranks", has the rules users rely on.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from kvpool.checks import non_negative_int, positive_int

if TYPE_CHECKING:
    from kvpool.pools.mamba_pool import MambaPool

#: Convolution band layouts of the common layers: one string per convolution of a layer, one letter
#: per band of channels, ``k`` (key heads x k_head_dim channels) or ``v`` (value heads x v_head_dim).
GATED_DELTA_NET = ("kkv",)
MAMBA2 = ("vkk",)
#: Convolutions per layer a header describes.
MAX_CONVS = 4
#: Letters and separators of ``conv_bands`` a header carries (two bits each in one int64).
MAX_BAND_DIGITS = 31
#: Element types of state buffers on the wire (codes are positions + 1).
STATE_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip


def _bands(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"conv_bands must be a non-empty sequence of strings of 'k' and 'v', got {value!r}")
    for i, b in enumerate(value):
        if not isinstance(b, str) or not b or set(b) - {"k", "v"}:
            raise ValueError(f"conv_bands[{i}] must be a non-empty string of 'k' and 'v' letters, got {b!r}")
    if "k" not in "".join(value):
        raise ValueError(f"conv_bands must name at least one band of key heads ('k'), got {tuple(value)}")
    if len(value) > MAX_CONVS or sum(map(len, value)) + len(value) - 1 > MAX_BAND_DIGITS:
        raise ValueError(f"conv_bands must describe at most {MAX_CONVS} convolutions of a few bands, got {tuple(value)}")
    return tuple(value)


@dataclass(frozen=True)
class StateShard:
    """The part of a linear-attention layer's heads a rank's ``MambaPool`` holds.

    Parameters
    ----------
    v_head_start, total_v_heads : the pool's SSM state holds value heads ``[v_head_start,
        v_head_start + v_heads)`` of a model with ``total_v_heads``.
    k_head_start, total_k_heads : the key heads its convolution's ``k`` bands hold, likewise.
    conv_bands : per convolution, its channel bands in order (``GATED_DELTA_NET`` = ``("kkv",)``,
        ``MAMBA2`` = ``("vkk",)``).

    Examples
    --------
    >>> StateShard.tp(1, 2, num_v_heads=64, num_k_heads=16)
    StateShard(v_head_start=32, total_v_heads=64, k_head_start=8, total_k_heads=16, conv_bands=('kkv',))
    """

    v_head_start: int
    total_v_heads: int
    k_head_start: int
    total_k_heads: int
    conv_bands: tuple[str, ...] = GATED_DELTA_NET

    def __post_init__(self) -> None:
        non_negative_int(self.v_head_start, "v_head_start")
        positive_int(self.total_v_heads, "total_v_heads")
        non_negative_int(self.k_head_start, "k_head_start")
        positive_int(self.total_k_heads, "total_k_heads")
        object.__setattr__(self, "conv_bands", _bands(self.conv_bands))

    @classmethod
    def tp(
        cls, tp_rank: int, tp_size: int, *, num_v_heads: int, num_k_heads: int,
        conv_bands: Sequence[str] = GATED_DELTA_NET,
    ) -> "StateShard":  # fmt: skip
        """Rank ``tp_rank`` of ``tp_size`` with SGLang's split: ``num_v_heads / tp_size`` value heads
        each, and the key heads they use (value head ``j`` uses key head ``j * num_k_heads //
        num_v_heads``; with fewer key heads than ranks each rank holds the one its heads use)."""
        size = positive_int(tp_size, "tp_size")
        rank = non_negative_int(tp_rank, "tp_rank")
        nv, nk = positive_int(num_v_heads, "num_v_heads"), positive_int(num_k_heads, "num_k_heads")
        if rank >= size:
            raise ValueError(f"tp_rank must be below tp_size ({size}), got {rank}")
        if nv % size or nv % nk:
            raise ValueError(
                f"num_v_heads ({nv}) must split evenly over tp_size ({size}) and be a multiple of num_k_heads ({nk})"
            )
        if nk % size and size % nk:
            raise ValueError(f"num_k_heads ({nk}) must split evenly over or be replicated across tp_size ({size})")
        v_start = rank * (nv // size)
        return cls(v_start, nv, v_start * nk // nv, nk, tuple(conv_bands))


@dataclass(frozen=True)
class StateSide:
    """One rank's state geometry as its header describes it (a ``MambaPool`` and its shard)."""

    layers: tuple[int, ...]
    conv: tuple[tuple[int, int], ...]  # (channels, columns) of each convolution
    v_heads: int
    v_head_dim: int
    k_head_dim: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    bands: Optional[tuple[str, ...]]  # None: whole rows, no re-sharding
    v_head_start: int
    total_v_heads: int
    k_head_start: int
    k_heads: int
    total_k_heads: int

    @classmethod
    def of(cls, mamba: "MambaPool", shard: Optional[StateShard]) -> "StateSide":
        """``mamba``'s geometry with ``shard`` (None: the whole state, moved only between equal pools).

        Raises ``ValueError`` if the pool's shapes cannot be the shard's bands, or its dtypes are
        not ones a header carries."""
        params = mamba.cache_params
        conv, (vh, dv, dk) = params.shape.conv, params.shape.temporal
        for name, dtype in (("conv", params.dtype.conv), ("temporal", params.dtype.temporal)):
            if dtype not in STATE_DTYPES:
                raise ValueError(f"the state pool's {name} dtype must be one of {list(STATE_DTYPES)} to travel, got {dtype}")
        if len(conv) > MAX_CONVS:
            raise ValueError(f"the state pool must have at most {MAX_CONVS} convolutions per layer to travel, got {len(conv)}")
        common = dict(layers=params.layers, conv=conv, v_heads=vh, v_head_dim=dv, k_head_dim=dk,
                      conv_dtype=params.dtype.conv, ssm_dtype=params.dtype.temporal)  # fmt: skip
        if shard is None:
            return cls(**common, bands=None, v_head_start=0, total_v_heads=vh, k_head_start=0, k_heads=0, total_k_heads=0)
        if not isinstance(shard, StateShard):
            raise TypeError(f"state_shard must be a StateShard or None, got {type(shard).__name__}")
        if len(shard.conv_bands) != len(conv):
            raise ValueError(
                f"state_shard.conv_bands must describe each of the pool's {len(conv)} convolutions, got {shard.conv_bands}"
            )
        k_heads: Optional[int] = None
        for c, (bands, (channels, _)) in enumerate(zip(shard.conv_bands, conv)):
            nk, nv = bands.count("k"), bands.count("v")
            left = channels - nv * vh * dv  # the key bands' channels
            if nk == 0:
                ok = left == 0
            else:
                ok = left > 0 and left % (nk * dk) == 0 and k_heads in (None, left // (nk * dk))
                k_heads = left // (nk * dk) if ok else k_heads
            if not ok:
                raise ValueError(
                    f"the state pool's convolution {c} has {channels} channels, which bands {bands!r} of "
                    f"{vh} value heads x {dv} and whole key heads x {dk} cannot make"
                )
        assert k_heads is not None  # StateShard requires a 'k' band
        if shard.v_head_start + vh > shard.total_v_heads:
            raise ValueError(
                f"the state pool's value heads [{shard.v_head_start}, {shard.v_head_start + vh}) must lie within "
                f"total_v_heads={shard.total_v_heads}"
            )
        if shard.k_head_start + k_heads > shard.total_k_heads:
            raise ValueError(
                f"the state pool's key heads [{shard.k_head_start}, {shard.k_head_start + k_heads}) must lie within "
                f"total_k_heads={shard.total_k_heads}"
            )
        return cls(**common, bands=shard.conv_bands, v_head_start=shard.v_head_start, total_v_heads=shard.total_v_heads,
                   k_head_start=shard.k_head_start, k_heads=k_heads, total_k_heads=shard.total_k_heads)  # fmt: skip

    @classmethod
    def from_header(cls, h: object) -> "StateSide":
        """The peer's geometry from its header's state fields (``layers`` holds only the first and
        last id: the header carries a checksum of the rest)."""
        return cls(
            layers=(h.st_layer_first, h.st_layer_last), conv=tuple(_convs(h)), v_heads=h.st_v_heads,  # type: ignore[attr-defined]
            v_head_dim=h.st_v_head_dim, k_head_dim=h.st_k_head_dim,  # type: ignore[attr-defined]
            conv_dtype=STATE_DTYPES[h.st_conv_dtype - 1], ssm_dtype=STATE_DTYPES[h.st_ssm_dtype - 1],  # type: ignore[attr-defined]
            bands=decode_bands(h.st_bands), v_head_start=h.st_v_start, total_v_heads=h.st_total_v,  # type: ignore[attr-defined]
            k_head_start=h.st_k_start, k_heads=h.st_k_heads, total_k_heads=h.st_total_k,  # type: ignore[attr-defined]
        )  # fmt: skip

    def fields(self) -> dict[str, int]:
        """The header's state fields for this side."""
        convs = list(self.conv) + [(0, 0)] * (MAX_CONVS - len(self.conv))
        out = dict(
            state_pool=1, st_layer_count=len(self.layers), st_layer_first=self.layers[0],
            st_layer_last=self.layers[-1], st_layer_crc=ids_crc(self.layers), st_conv_count=len(self.conv),
            st_conv_dtype=STATE_DTYPES.index(self.conv_dtype) + 1, st_ssm_dtype=STATE_DTYPES.index(self.ssm_dtype) + 1,
            st_v_heads=self.v_heads, st_v_head_dim=self.v_head_dim, st_k_head_dim=self.k_head_dim,
            st_bands=encode_bands(self.bands), st_v_start=self.v_head_start, st_total_v=self.total_v_heads,
            st_k_start=self.k_head_start, st_k_heads=self.k_heads, st_total_k=self.total_k_heads,
        )  # fmt: skip
        for i, (channels, columns) in enumerate(convs):
            out[f"st_conv{i}"], out[f"st_width{i}"] = channels, columns
        return out


#: The header fields :meth:`StateSide.fields` fills (zero for a rank without a state pool).
STATE_FIELDS = (
    "state_pool", "st_layer_count", "st_layer_first", "st_layer_last", "st_layer_crc", "st_conv_count",
    *[f"st_conv{i}" for i in range(MAX_CONVS)], *[f"st_width{i}" for i in range(MAX_CONVS)],
    "st_conv_dtype", "st_ssm_dtype", "st_v_heads", "st_v_head_dim", "st_k_head_dim", "st_bands",
    "st_v_start", "st_total_v", "st_k_start", "st_k_heads", "st_total_k",
)  # fmt: skip


def ids_crc(ids: Sequence[int]) -> int:
    """A checksum of a list of layer ids (both ranks compare lists through it)."""
    return zlib.crc32(",".join(map(str, ids)).encode())


def encode_bands(bands: Optional[tuple[str, ...]]) -> int:
    """``conv_bands`` as an int: base-4 digits, ``k`` 1, ``v`` 2, 3 between convolutions; 0 for None."""
    code = 0
    for ch in "|".join(bands or ()):
        code = code * 4 + {"k": 1, "v": 2, "|": 3}[ch]
    return code


def decode_bands(code: int) -> Optional[tuple[str, ...]]:
    """Inverse of :func:`encode_bands`: the ``conv_bands`` a header's code stands for (None for 0)."""
    if code <= 0:
        return None
    digits = []
    while code:
        code, d = divmod(code, 4)
        digits.append("?kv|"[d])
    return tuple("".join(reversed(digits)).split("|"))


def _dtype_name(code: int) -> str:
    return str(STATE_DTYPES[code - 1]) if 1 <= code <= len(STATE_DTYPES) else f"unknown dtype code {code}"


def _convs(h: object) -> list[tuple[int, int]]:
    n = getattr(h, "st_conv_count")
    return [(getattr(h, f"st_conv{i}"), getattr(h, f"st_width{i}")) for i in range(min(n, MAX_CONVS))]


def _heads(h: object, kind: str) -> tuple[int, int]:
    if kind == "v":
        return h.st_v_start, h.st_v_start + h.st_v_heads  # type: ignore[attr-defined]
    return h.st_k_start, h.st_k_start + h.st_k_heads  # type: ignore[attr-defined]


def state_mismatch(s: object, r: object) -> Optional[tuple[str, object, object, str]]:
    """The first state field the two headers (sender's, receiver's; both with a state pool)
    disagree on, as ``(name, sender's value, receiver's value, note)``, or None."""
    if s.st_conv_dtype != r.st_conv_dtype:  # type: ignore[attr-defined]
        return "conv_dtype", _dtype_name(s.st_conv_dtype), _dtype_name(r.st_conv_dtype), ""  # type: ignore[attr-defined]
    if s.st_ssm_dtype != r.st_ssm_dtype:  # type: ignore[attr-defined]
        return "ssm_dtype", _dtype_name(s.st_ssm_dtype), _dtype_name(r.st_ssm_dtype), ""  # type: ignore[attr-defined]
    span = lambda h: [h.st_layer_first, h.st_layer_last]  # noqa: E731
    if span(s) != span(r) or (s.st_layer_count, s.st_layer_crc) != (r.st_layer_count, r.st_layer_crc):  # type: ignore[attr-defined]
        counted = lambda h: f"{h.st_layer_count} ids in {span(h)}"  # noqa: E731
        return "linear_layers", counted(s), counted(r), " (the state pool's linear-attention layer ids)"
    if s.st_bands != r.st_bands:  # type: ignore[attr-defined]
        return "conv_bands", decode_bands(s.st_bands), decode_bands(r.st_bands), " (None: no state_shard)"  # type: ignore[attr-defined]
    for name, field in (("v_head_dim", "st_v_head_dim"), ("k_head_dim", "st_k_head_dim")):
        if getattr(s, field) != getattr(r, field):
            return f"ssm_{name}", getattr(s, field), getattr(r, field), " (of the SSM state)"
    widths = lambda h: [w for _, w in _convs(h)]  # noqa: E731
    if s.st_bands == 0:  # whole rows: the same shapes on both sides
        if _convs(s) != _convs(r):
            return "conv", _convs(s), _convs(r), " (channels, columns) per convolution"
        if s.st_v_heads != r.st_v_heads:  # type: ignore[attr-defined]
            return "ssm_v_heads", s.st_v_heads, r.st_v_heads, "; pass state_shard to move part of the heads"  # type: ignore[attr-defined]
        return None
    if widths(s) != widths(r):
        return "conv_width", widths(s), widths(r), " (conv_kernel - 1 columns per convolution)"
    for kind, total in (("v", "st_total_v"), ("k", "st_total_k")):
        if getattr(s, total) != getattr(r, total):
            return f"total_{kind}_heads", getattr(s, total), getattr(r, total), " (of the whole model)"
    for kind in ("v", "k"):
        (a, b), (c, d) = _heads(s, kind), _heads(r, kind)
        if max(a, c) >= min(b, d):
            return f"{kind}_heads", [a, b], [c, d], " (global head ranges of the state, which must overlap)"
    return None


@dataclass(frozen=True)
class StateOverlap:
    """The global value and key heads a transfer moves (key heads unused without a shard)."""

    v_lo: int
    v_hi: int
    k_lo: int
    k_hi: int


def state_overlap(s: object, r: object) -> StateOverlap:
    """The global value and key heads that both headers' state pools hold (sender's, receiver's),
    once :func:`state_mismatch` has found the ranges overlap."""
    (a, b), (c, d) = _heads(s, "v"), _heads(r, "v")
    (e, f), (g, h) = _heads(s, "k"), _heads(r, "k")
    return StateOverlap(max(a, c), min(b, d), max(e, g), min(f, h))


def band_spans(side: StateSide, agreed: StateOverlap) -> list[tuple[int, int, int]]:
    """One layer's wire buffers in order: ``(convolution index, or -1 for the SSM state, first byte
    in that buffer's slot row, bytes)``. Every layer has the same spans."""
    ce, se = side.conv_dtype.itemsize, side.ssm_dtype.itemsize
    ssm_head = side.v_head_dim * side.k_head_dim * se
    if side.bands is None:
        spans = [(c, 0, channels * columns * ce) for c, (channels, columns) in enumerate(side.conv)]
        return spans + [(-1, 0, side.v_heads * ssm_head)]
    spans = []
    for c, (bands, (_, columns)) in enumerate(zip(side.bands, side.conv)):
        at = 0  # channels before this band
        for letter in bands:
            heads, dim, start = ((side.k_heads, side.k_head_dim, side.k_head_start) if letter == "k"
                                 else (side.v_heads, side.v_head_dim, side.v_head_start))  # fmt: skip
            lo, hi = (agreed.k_lo, agreed.k_hi) if letter == "k" else (agreed.v_lo, agreed.v_hi)
            spans.append((c, (at + (lo - start) * dim) * columns * ce, (hi - lo) * dim * columns * ce))
            at += heads * dim
    return spans + [(-1, (agreed.v_lo - side.v_head_start) * ssm_head, (agreed.v_hi - agreed.v_lo) * ssm_head)]


def band_views(
    conv: Sequence[torch.Tensor], temporal: torch.Tensor, spans: list[tuple[int, int, int]]
) -> list[torch.Tensor]:
    """uint8 ``[slots + 1, bytes]`` views for ``spans`` of a state pool's buffers (``conv[c]`` and
    ``temporal``, each ``[layers, slots + 1, ...]``), layer after layer."""
    out = []
    for layer in range(temporal.shape[0]):
        for c, first, n in spans:
            buf = conv[c][layer] if c >= 0 else temporal[layer]
            out.append(buf.view(buf.shape[0], -1).view(torch.uint8)[:, first : first + n])
    return out


def whole_rows(side: StateSide, spans: list[tuple[int, int, int]]) -> bool:
    """Whether ``spans`` are whole slot rows in the pool's own order (its ``row_table`` then serves)."""
    ce, se = side.conv_dtype.itemsize, side.ssm_dtype.itemsize
    whole = [(c, 0, channels * columns * ce) for c, (channels, columns) in enumerate(side.conv)]
    return spans == whole + [(-1, 0, side.v_heads * side.v_head_dim * side.k_head_dim * se)]


def state_plan(row_bytes: Sequence[int], states: int, capacity: int) -> list[tuple[int, int, int, int]]:
    """``(first buffer, end buffer, first state, states)`` of each chunk of a transfer of ``states``
    slots whose wire buffers have ``row_bytes`` per slot, in chunks of at most ``capacity`` bytes:
    consecutive buffers whose rows fit together form a group; each group's slots go in as few
    chunks as fit. A pure function of its arguments, so both ranks compute the same plan.

    >>> state_plan([4, 4, 8], 3, 16)
    [(0, 2, 0, 2), (0, 2, 2, 1), (2, 3, 0, 2), (2, 3, 2, 1)]
    """
    if states < 0 or capacity < max(row_bytes, default=1):
        raise ValueError(f"states must be >= 0 and capacity >= every row, got states={states}, capacity={capacity}")
    plan, start = [], 0
    while states and start < len(row_bytes):
        stop, total = start + 1, row_bytes[start]
        while stop < len(row_bytes) and total + row_bytes[stop] <= capacity:
            total += row_bytes[stop]
            stop += 1
        per_chunk = capacity // total
        plan += [(start, stop, s, min(per_chunk, states - s)) for s in range(0, states, per_chunk)]
        start = stop
    return plan
