"""The per-request state of a hybrid model's linear-attention layers: what one state slot holds.

A linear-attention layer (Gated DeltaNet, Mamba2) keeps, per request, a convolution window and a
recurrent ("temporal", SSM) state instead of KV per token. These classes describe their shapes and
element types on one rank, under SGLang's names and attribute layout (``shape.conv``,
``shape.temporal``, ``dtype.conv``, ``dtype.temporal``, ``layers``), so a ``MambaPool`` takes either
these or SGLang's own ``Mamba2CacheParams``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvpool.checks import non_negative_int, positive_int


def _shape(value: object, name: str, ndim: int) -> tuple[int, ...]:
    if isinstance(value, torch.Size):
        value = tuple(value)
    if not isinstance(value, (tuple, list)) or len(value) != ndim:
        raise ValueError(f"{name} must be a tuple of {ndim} positive ints, got {value!r}")
    return tuple(positive_int(v, f"{name}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class MambaStateShape:
    """Per-layer state shapes on one rank (SGLang's ``Mamba2StateShape``, shapes only).

    Parameters
    ----------
    conv : the convolution window ``(conv_dim, conv_kernel - 1)``, or a sequence of such shapes for
        layers with several convolutions (each gets its own buffer). Stored as a tuple of shapes.
    temporal : the recurrent state ``(v_heads, v_head_dim, k_head_dim)`` (SGLang's layout: the
        value dim before the key dim).

    Examples
    --------
    >>> MambaStateShape(conv=(1536, 3), temporal=(8, 128, 128)).conv
    ((1536, 3),)
    """

    conv: tuple[tuple[int, int], ...]
    temporal: tuple[int, int, int]

    def __post_init__(self) -> None:
        conv = self.conv
        if isinstance(conv, (tuple, list, torch.Size)) and conv and isinstance(conv[0], int):
            conv = (conv,)
        if not isinstance(conv, (tuple, list)) or not conv:
            raise ValueError(
                f"conv must be a shape (conv_dim, conv_kernel - 1) or a non-empty list of them, got {conv!r}"
            )
        object.__setattr__(self, "conv", tuple(_shape(c, f"conv[{i}]", 2) for i, c in enumerate(conv)))
        object.__setattr__(self, "temporal", _shape(self.temporal, "temporal", 3))

    @classmethod
    def create(
        cls,
        *,
        tp_world_size: int,
        intermediate_size: int,
        n_groups: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        conv_kernel: int,
    ) -> "MambaStateShape":
        """One rank's shapes from the model's dimensions, with SGLang's keywords and formulas: the
        convolution runs over ``intermediate_size + 2 * n_groups * state_size`` channels and the
        recurrent state is ``(num_heads, head_dim, state_size)``, both split over ``tp_world_size``
        ranks; ``n_groups`` that does not divide into the ranks is replicated up to
        ``tp_world_size`` groups first.

        Raises
        ------
        ValueError
            If a dimension is not a positive int, or heads or channels do not split evenly.
        """
        tp = positive_int(tp_world_size, "tp_world_size")
        for name, v in (("intermediate_size", intermediate_size), ("n_groups", n_groups), ("num_heads", num_heads),
                        ("head_dim", head_dim), ("state_size", state_size), ("conv_kernel", conv_kernel)):  # fmt: skip
            positive_int(v, name)
        if conv_kernel < 2:
            raise ValueError(
                f"conv_kernel must be at least 2 (the window keeps conv_kernel - 1 columns), got {conv_kernel}"
            )
        if n_groups % tp:
            if tp % n_groups:
                raise ValueError(f"n_groups ({n_groups}) must divide into or be replicated over tp_world_size ({tp})")
            n_groups = tp
        conv_dim = intermediate_size + 2 * n_groups * state_size
        for name, v in (("conv channels", conv_dim), ("num_heads", num_heads)):
            if v % tp:
                raise ValueError(f"{name} ({v}) must split evenly over tp_world_size ({tp})")
        return cls(conv=((conv_dim // tp, conv_kernel - 1),), temporal=(num_heads // tp, head_dim, state_size))

    @classmethod
    def gated_delta_net(
        cls,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        tp_world_size: int = 1,
    ) -> "MambaStateShape":
        """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5): the convolution covers the query, key and
        value channels (``2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim``), the state is
        ``(num_v_heads, head_v_dim, head_k_dim)``, split over ``tp_world_size`` ranks.

        >>> MambaStateShape.gated_delta_net(num_k_heads=16, num_v_heads=64, head_k_dim=128,
        ...                                 head_v_dim=128, conv_kernel=4, tp_world_size=8)
        MambaStateShape(conv=((1536, 3),), temporal=(8, 128, 128))
        """
        return cls.create(
            tp_world_size=tp_world_size, intermediate_size=num_v_heads * head_v_dim, n_groups=num_k_heads,
            num_heads=num_v_heads, head_dim=head_v_dim, state_size=head_k_dim, conv_kernel=conv_kernel,
        )  # fmt: skip


@dataclass(frozen=True)
class MambaStateDType:
    """Element types of the states (SGLang's ``Mamba2StateDType``): bf16 convolution windows and a
    float32 recurrent state by default. Any floating type is accepted; the pool copies bytes."""

    conv: torch.dtype = torch.bfloat16
    temporal: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("conv", "temporal"):
            dtype = getattr(self, name)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"{name} must be a floating torch.dtype, got {dtype!r}")


@dataclass(frozen=True)
class MambaCacheParams:
    """Everything a ``MambaPool`` needs to allocate one rank's state (SGLang's ``Mamba2CacheParams``).

    Parameters
    ----------
    shape : the per-layer shapes.
    layers : global ids of the linear-attention layers this rank holds (distinct, ascending).
    dtype : element types.

    Examples
    --------
    >>> p = MambaCacheParams(MambaStateShape(conv=(1536, 3), temporal=(8, 128, 128)), layers=range(45))
    >>> p.bytes_per_slot  # 45 x (1536 x 3 x 2 + 8 x 128 x 128 x 4)
    24007680
    """

    shape: MambaStateShape
    layers: tuple[int, ...]
    dtype: MambaStateDType = field(default_factory=MambaStateDType)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, MambaStateShape):
            raise TypeError(f"shape must be a MambaStateShape, got {type(self.shape).__name__}")
        if not isinstance(self.dtype, MambaStateDType):
            raise TypeError(f"dtype must be a MambaStateDType, got {type(self.dtype).__name__}")
        layers = tuple(self.layers) if isinstance(self.layers, (Sequence, range)) else self.layers
        if not isinstance(layers, tuple) or not layers:
            raise ValueError(f"layers must be a non-empty sequence of layer ids, got {self.layers!r}")
        for i, layer in enumerate(layers):
            non_negative_int(layer, f"layers[{i}]")
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ValueError(f"layers must be distinct and ascending, got {list(layers)}")
        object.__setattr__(self, "layers", layers)

    @classmethod
    def of(cls, cache_params: object) -> "MambaCacheParams":
        """``cache_params`` itself, or an SGLang ``Mamba2CacheParams`` (anything with ``shape.conv``,
        ``shape.temporal``, ``dtype.conv``, ``dtype.temporal`` and ``layers``) converted."""
        if isinstance(cache_params, cls):
            return cache_params
        try:
            shape, dtype = cache_params.shape, cache_params.dtype  # type: ignore[attr-defined]
            layers = cache_params.layers  # type: ignore[attr-defined]
            conv, temporal = shape.conv, shape.temporal
            conv_dtype, temporal_dtype = dtype.conv, dtype.temporal
        except AttributeError:
            raise TypeError(
                "cache_params must be a MambaCacheParams or have shape.conv, shape.temporal, dtype.conv, "
                f"dtype.temporal and layers (SGLang's Mamba2CacheParams), got {type(cache_params).__name__}"
            ) from None
        return cls(MambaStateShape(conv, temporal), tuple(layers), MambaStateDType(conv_dtype, temporal_dtype))

    @property
    def num_layers(self) -> int:
        """The number of linear layers, ``len(layers)``."""
        return len(self.layers)

    @property
    def conv_bytes(self) -> int:
        """Bytes of one slot's convolution windows in one layer (all of them)."""
        return sum(c[0] * c[1] for c in self.shape.conv) * self.dtype.conv.itemsize

    @property
    def temporal_bytes(self) -> int:
        """Bytes of one slot's recurrent state in one layer."""
        h, v, k = self.shape.temporal
        return h * v * k * self.dtype.temporal.itemsize

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one state slot over every layer (SGLang's ``mamba_cache_per_req``)."""
        return (self.conv_bytes + self.temporal_bytes) * self.num_layers

    @property
    def mamba_cache_per_req(self) -> int:
        """SGLang's name for :attr:`bytes_per_slot`."""
        return self.bytes_per_slot

    def speculative_bytes_per_request(self, num_draft_tokens: int) -> int:
        """Bytes of one request's speculative scratch over every layer: a convolution window and a
        recurrent state after each of ``num_draft_tokens`` draft steps."""
        return positive_int(num_draft_tokens, "num_draft_tokens") * self.bytes_per_slot
