"""How two ranks swap their handshake headers: through torch.distributed's key-value store.

Host memory and a socket only: no device work, no stream, no wait for earlier transfers to drain.
Keys are numbered per pair of ranks and group, in the order transfers between the two start. Each
rank publishes its header under its own key, waits for the peer's (up to the store's timeout) and
claims it (``compare_set`` to TAKEN, so a peer that gave up cannot also count it as unread). A rank
whose wait times out withdraws its own header the same atomic way, unless the peer has already
claimed it; the withdrawn key stays as a tombstone, and a peer that arrives later finds it, raises,
and removes it. Both ranks thus spend the same key number on every transfer either of them started,
and a late peer can never pair with a later transfer. docs/contract.md, "KV transfer between
ranks", has the rules users rely on.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Optional

import torch.distributed as dist

from kvpool.transfer.handshake import Header

#: Transfers started so far per pair of ranks and group, in this process (the keys' numbers).
_SEQUENCE: dict[tuple, int] = {}
#: Values a header key can hold besides a header (headers are HEADER_BYTES long, these are shorter).
TAKEN = b"kvpool:taken"
WITHDRAWN = b"kvpool:withdrawn"


def exchange(
    store: dist.Store,
    header: bytes,
    mine: Header,
    rank: int,
    peer: int,
    group: Optional[dist.ProcessGroup],
    last: Optional[Header],
) -> tuple[Header, str]:
    """Publish ``header`` (``mine``, encoded) and return the peer's header with the store key it came
    under, which the caller deletes (:func:`release`) once it no longer needs the store.

    ``last`` is the header this peer sent in the previous transfer between the same endpoints. The
    peer's header is then predictable (the same with this transfer's token and state counts and no
    error), so one ``compare_set`` against that prediction reads and claims it: two store round trips
    for the rank that arrives second instead of three. A wrong prediction, or a peer not there yet, costs
    that one round trip and the exchange continues as usual.

    Raises
    ------
    RuntimeError
        If the peer does not publish within the store's timeout (this rank withdraws), or withdrew
        from this transfer before this rank started it. Nothing moved.
    """
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None) or ",".join(map(str, dist.get_process_group_ranks(pg)))
    pair = (min(rank, peer), max(rank, peer), name)
    seq = _SEQUENCE[pair] = _SEQUENCE.get(pair, -1) + 1
    prefix = f"kvpool/transfer/{pair[0]}-{pair[1]}/{name}/{seq}/"
    mine_key, theirs_key = prefix + str(rank), prefix + str(peer)
    store.set(mine_key, header)
    theirs: Optional[bytes] = None
    if last is not None:
        predicted = replace(last, tokens=mine.tokens, states=mine.states, error_kind=0, message="").to_bytes()
        found = store.compare_set(theirs_key, predicted, TAKEN)
        if found == TAKEN:
            theirs = predicted  # read and claimed in one round trip
        elif found != predicted:  # (a missing key returns the expected value unchanged)
            theirs = _claim(store, theirs_key, found)
    if theirs is None:
        try:
            found = store.get(theirs_key)  # waits for the peer (up to the store's timeout)
        except dist.DistStoreError:
            if store.compare_set(mine_key, header, WITHDRAWN) == WITHDRAWN:
                raise RuntimeError(
                    f"kvpool transfer with rank {peer}: the peer did not start its side within the store's "
                    f"timeout (transfer {seq} between the two ranks); this rank withdrew, and the peer's call "
                    f"for this transfer will raise too; nothing moved"
                ) from None
            found = store.get(theirs_key)  # the peer took our header just in time: it has published its own
        theirs = _claim(store, theirs_key, found)
    if theirs == WITHDRAWN:
        with contextlib.suppress(Exception):  # the peer will never read ours, nor we the tombstone
            store.delete_key(mine_key)
            store.delete_key(theirs_key)
        raise RuntimeError(
            f"kvpool transfer with rank {peer}: the peer gave up waiting for this transfer (transfer {seq} "
            f"between the two ranks) before this rank started it; nothing moved"
        )
    return Header.from_bytes(theirs), theirs_key


def release(store: dist.Store, key: str) -> None:
    """Delete the peer's claimed header ``key``."""
    with contextlib.suppress(Exception):  # a store that cannot delete keeps a few bytes per transfer
        store.delete_key(key)


def _claim(store: dist.Store, key: str, found: bytes) -> bytes:
    """Claim the peer's header ``found`` under ``key``: it, or WITHDRAWN if the peer withdrew first."""
    if found == WITHDRAWN:
        return found
    return found if store.compare_set(key, found, TAKEN) == TAKEN else WITHDRAWN
