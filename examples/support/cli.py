"""What the examples' command lines share: a ``--device`` this torch can use."""

from __future__ import annotations

from kvpool.checks import resolve_device


def check_device(value: str) -> None:
    """Raise a one-line ``ValueError`` naming ``--device`` unless this torch can use ``value``
    (``'cuda'`` on a CPU-only torch or without a GPU, or a name torch does not know)."""
    try:
        resolve_device(value, "--device")
    except RuntimeError as e:  # torch.device's own message for a name it does not know
        raise ValueError(f"--device must be a torch device (cpu, cuda, cuda:N), got {value!r}: {e}") from None
