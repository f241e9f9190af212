"""The argument checks every kvpool entry shares: plain constructor arguments, index tensors, ranges.

Each raises naming the argument, what it must be and what it was (docs/contract.md, "Bad input"),
before anything is written. ``check_index`` reads metadata only (no synchronisation, traceable by
torch.compile); ``check_in_range`` reads the values, so device tensors pay one synchronisation.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

#: The integer types kvpool takes for slots and indices (SGLang's, and what the kernels read).
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
#: Every integer type: what a scheduler's lengths and frees may come in (the allocators take them all).
INTEGER_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def is_int(value: object) -> bool:
    """Whether ``value`` is an int (bools are not ints here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 1 (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 0 (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def non_negative_seconds(value: object, name: str) -> float:
    """``value`` as a float if it is a finite or infinite number >= 0 (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def int_list(value: object, name: str, *, accepts: str = "an int or a sequence of ints") -> list[int]:
    """``value`` as a list of ints: an int, a sequence of ints (bools are not ints here), or a 0-D or
    1-D integer tensor (read to the host: a device tensor costs a synchronisation). ``accepts``
    spells the accepted forms in the error for anything else. Raises ``ValueError``.

    >>> int_list(torch.tensor([3, 1]), "free_index")
    [3, 1]
    """
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
        if value.dim() > 1:
            raise ValueError(f"{name} must be 0-D or 1-D, got shape {tuple(value.shape)}")
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"{name} must be {accepts}, got {value!r}")


def one_slot(value: object, name: str) -> int:
    """A slot given as an int or a one-entry integer tensor (a device tensor is read: one
    synchronisation). Raises ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one slot, got shape {tuple(value.shape)}")
        value = value.reshape(-1)
    (v,) = int_list(value, name, accepts="an int or a one-entry integer tensor")
    return v


def resolve_device(device: str | torch.device, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device``; a bare ``"cuda"`` names the current CUDA device, so that
    tensors made later compare equal to it. A CUDA device this torch cannot use (a CPU-only build,
    no GPU visible, an index past the last GPU) raises ``ValueError`` naming ``name``."""
    dev = torch.device(device)
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        if torch.version.cuda is None:
            why = f"on a CPU-only torch {torch.__version__}"
        elif not torch.cuda.is_available():
            why = f"with no GPU visible to torch {torch.__version__}"
        else:
            why = f"with {torch.cuda.device_count()} GPU(s) visible"
        raise ValueError(
            f"{name} must be a device this torch can use: 'cuda' needs a CUDA build of torch and a GPU, "
            f"got {str(device)!r} {why}"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def layer_index(layer_id: object, first: int, last: int, whose: str = "this pool's") -> int:
    """Index of global layer ``layer_id`` among the consecutive layers ``first..last`` (both
    included) a pool holds. Raises ``TypeError`` for a non-int (bools are not ints here) and
    ``IndexError`` naming the range (``whose`` layers they are) for any other id.

    >>> layer_index(5, 4, 6)
    1
    """
    if isinstance(layer_id, bool) or not isinstance(layer_id, int):
        raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
    if not first <= layer_id <= last:
        raise IndexError(f"layer_id {layer_id} is outside {whose} layers [{first}, {last}]")
    return layer_id - first


def dense_layer_index(layer_id: object, dense: Mapping[int, int], kind: str, listed: str) -> int:
    """``dense[layer_id]``: the dense index of global layer ``layer_id`` in a pool that holds some of
    a model's layers (``dense`` maps their global ids to dense indices). Raises ``TypeError`` for a
    non-int and ``ValueError`` naming the id and the pool's layers otherwise: ``"layer_id 4 is not a
    <kind> layer of this pool: its <listed> are [3, 7]"``.

    >>> dense_layer_index(7, {3: 0, 7: 1}, "full-attention", "full-attention layers")
    1
    """
    if isinstance(layer_id, bool) or not isinstance(layer_id, int):
        raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
    i = dense.get(layer_id)
    if i is None:
        raise ValueError(f"layer_id {layer_id} is not a {kind} layer of this pool: its {listed} are {list(dense)}")
    return i


def layer_id_of(layer: object) -> object:
    """``layer.layer_id`` of the layer object a write names (a model's attention layer). Raises
    ``TypeError`` for None or an object without ``layer_id``."""
    if layer is None:
        raise TypeError("a write needs a layer with .layer_id or layer_id_override, got neither")
    try:
        return layer.layer_id  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"layer must have a .layer_id attribute, got {type(layer).__name__}") from None


def check_index(
    t: object,
    name: str,
    *,
    device: Optional[torch.device | tuple[torch.device, ...]] = None,
    ndim: int = 1,
    dims: str = "",
    length: Optional[int] = None,
    per: str = "",
    dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
    where: str = "",
    expect: str = "",
) -> torch.Tensor:
    """``t`` itself if it is an index tensor of one of ``dtypes`` with ``ndim`` dimensions (``dims``
    spells them in the message, e.g. ``"[T]"``), ``length`` entries along dim 0 (``per`` says what
    one entry stands for, e.g. ``"one per token"``) and on ``device`` (or on one of several devices;
    ``where`` names them in the message, e.g. ``"cpu (host slots)"``). ``expect`` spells the dtype
    and dimensions together for both messages (e.g. ``"a 1-D integer tensor"``). Raises
    ``TypeError`` for a non-tensor, else ``ValueError``.

    >>> check_index(torch.tensor([1, 2]), "loc", dims="[T]", length=2)
    tensor([1, 2])
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {expect or _spelled(dtypes)}, got {t.dtype}")
    if t.dim() != ndim:
        wanted = expect or f"{ndim}-D{' ' + dims if dims else ''}"
        raise ValueError(f"{name} must be {wanted}, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries{f' ({per})' if per else ''}, got {t.shape[0]}")
    if device is not None and t.device not in (device if isinstance(device, tuple) else (device,)):
        raise ValueError(f"{name} must be on {where or device}, got {t.device}")
    return t


def _spelled(dtypes: tuple[torch.dtype, ...]) -> str:
    if set(dtypes) == set(INTEGER_DTYPES):
        return "an integer tensor"
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_same_length(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> int:
    """Two index tensors with as many entries each; returns the count."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{b_name} must have as many entries as {a_name} ({a.shape[0]}), got {b.shape[0]}")
    return a.shape[0]


def check_in_range(
    checks: Sequence[tuple[torch.Tensor, int, str]],
    *,
    what: str = "rows",
    negative_ok: bool = True,
    wrap: bool = False,
) -> None:
    """For each ``(index, rows, name)``: every entry below ``rows``, and, unless ``negative_ok``
    (negative entries are padding), at least 0; with ``wrap``, at least ``-rows`` (negative entries
    count from the end, as in Python indexing). Raises ``IndexError`` naming the first offending
    position and value; one synchronisation for all of them when they live on a device.

    >>> check_in_range([(torch.tensor([0, 7]), 4, "loc")], what="slots")
    Traceback (most recent call last):
    IndexError: loc[1] = 7 is out of range: slots are 0..3 (negative entries are skipped)
    """
    live = [(t, rows, name) for t, rows, name in checks if t.numel()]
    if not live:
        return
    if all(t.device.type == "cpu" for t, _, _ in live):
        found = [out_of_range(t, rows, negative_ok=negative_ok, wrap=wrap) for t, rows, _ in live]
    else:  # one synchronisation for all of them; positions are looked up only for a bad one
        low = [_low(rows, negative_ok, wrap) for _, rows, _ in live]
        flags = torch.stack([_outside(t, rows, lo).any() for (t, rows, _), lo in zip(live, low)]).tolist()
        found = [
            out_of_range(t, rows, negative_ok=negative_ok, wrap=wrap) if bad else None
            for (t, rows, _), bad in zip(live, flags)
        ]
    note = " (negative entries count from the end)" if wrap else " (negative entries are skipped)" if negative_ok else ""
    for (_, rows, name), hit in zip(live, found):
        if hit is not None:
            pos, value = hit
            raise IndexError(f"{name}[{pos}] = {value} is out of range: {what} are 0..{rows - 1}{note}")


def out_of_range(
    t: torch.Tensor, rows: int, *, negative_ok: bool = True, wrap: bool = False
) -> Optional[tuple[str, int]]:
    """The first entry of ``t`` outside the range :func:`check_in_range` checks, as ``(position,
    value)`` with the position spelled as a message writes it (``"3"``, ``"1, 2"``); None when every
    entry is in range. For callers that report a problem instead of raising it (a transfer tells
    its peer). Reads ``t`` (a synchronisation for a device tensor)."""
    if t.numel() == 0:
        return None
    low = _low(rows, negative_ok, wrap)
    if t.device.type == "cpu":  # the common case, every entry in range, in one pass
        lo, hi = torch.aminmax(t)
        if int(hi) < rows and (low is None or int(lo) >= low):
            return None
    mask = _outside(t, rows, low).reshape(-1)
    if not bool(mask.any()):
        return None
    flat = int(torch.argmax(mask.to(torch.uint8)))
    pos = str(flat) if t.dim() == 1 else ", ".join(map(str, _unravel(flat, tuple(t.shape))))
    return pos, int(t.reshape(-1)[flat])


def _low(rows: int, negative_ok: bool, wrap: bool) -> Optional[int]:
    return -rows if wrap else None if negative_ok else 0


def _outside(t: torch.Tensor, rows: int, low: Optional[int]) -> torch.Tensor:
    return (t >= rows) if low is None else (t < low) | (t >= rows)


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        flat, r = divmod(flat, size)
        out.append(r)
    return out[::-1]
