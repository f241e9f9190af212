"""``check_integrity``: the tree, its allocator, its request table and the running requests, checked
together. Every slot the allocator has handed out must be owned by exactly one of the tree and a
running request, and every slot either of them owns must be handed out once.

The checks read everything to the host; they are for tests and debugging.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from kvpool.cache.requests import committed_len, protected_len
from kvpool.errors import IntegrityError

if TYPE_CHECKING:
    from kvpool.cache.node import TreeNode
    from kvpool.cache.radix_cache import RadixCache

_SHOWN = 5  # examples listed per kind of problem


def _sample(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:_SHOWN])) + (", ..." if len(xs) > _SHOWN else "")


def tree_problems(cache: "RadixCache") -> tuple[list[str], list[torch.Tensor]]:
    """What is wrong with the tree itself, and the slot tensors of its nodes."""
    problems: list[str] = []
    root, p, elem = cache.root_node, cache.page_size, cache._elem
    evictable = protected = 0
    values: list[torch.Tensor] = []
    stack: list[tuple["TreeNode", Any]] = [(child, child.key.extra_key) for child in root.children.values()]
    for ck, child in root.children.items():
        if child.parent is not root or child._ck != ck:
            problems.append(f"node {child.id} is filed under {ck!r} in the root but records parent/key {child._ck!r}")
    if root._dev_children != sum(c.value is not None for c in root.children.values()):
        problems.append(f"the root records {root._dev_children} children on the device, has another number")
    while stack:
        node, extra = stack.pop()
        for ck, child in node.children.items():
            if child.parent is not node or child._ck != ck:
                problems.append(f"node {child.id} is filed under {ck!r} in node {node.id} but records otherwise")
            stack.append((child, extra))
        key = node.key
        n = len(key._enc) // elem
        where = f"node {node.id}"
        if n == 0 or n % p:
            problems.append(f"{where} holds {n} tokens, not a positive multiple of page_size = {p}")
        if key.extra_key != extra or key.is_bigram != cache.is_eagle:
            problems.append(f"{where} has extra_key {key.extra_key!r} below a node of extra_key {extra!r}")
        if node._ck != cache._child_key(key._enc, 0, key.extra_key):
            problems.append(f"{where} is filed under {node._ck!r}, not its first page's key")
        device_children = sum(c.value is not None for c in node.children.values())
        if node._dev_children != device_children:
            problems.append(f"{where} records {node._dev_children} children on the device, has {device_children}")
        if node.value is None:
            if node.host_value is None:
                problems.append(f"{where} is evicted with no host copy but still in the tree")
            if device_children:
                problems.append(f"{where} is on the host only but has {device_children} children on the device")
            continue
        if node.value.shape != (n,) or node.value.dtype != torch.int64:
            problems.append(f"{where} has value of shape {tuple(node.value.shape)} {node.value.dtype} for {n} tokens")
        values.append(node.value)
        if node.lock_ref < 0:
            problems.append(f"{where} has lock_ref {node.lock_ref} < 0")
        below = sum(c.lock_ref for c in node.children.values())
        if node.lock_ref < below:
            problems.append(f"{where} has lock_ref {node.lock_ref}, below its children's total {below}")
        if node.lock_ref:
            protected += n
        else:
            evictable += n
        if cache._is_evictable(node) and not cache._queue.holds(node):
            problems.append(f"{where} is an evictable leaf missing from the eviction queue")
    if (evictable, protected) != (cache.evictable_size_, cache.protected_size_):
        problems.append(
            f"evictable/protected sizes are recorded as {cache.evictable_size_}/{cache.protected_size_} but the "
            f"nodes hold {evictable}/{protected}"
        )
    return problems, values


def _path_slots(node: "TreeNode", root: "TreeNode") -> list[torch.Tensor]:
    parts = []
    while node is not None and node is not root:
        parts.append(node.value)
        node = node.parent
    return parts[::-1]


def request_problems(cache: "RadixCache", requests: Iterable[Any]) -> tuple[list[str], list[torch.Tensor]]:
    """What is wrong with the running requests, and the slots each owns."""
    problems: list[str] = []
    owned: list[torch.Tensor] = []
    pool = cache.req_to_token_pool
    free_rows = set(pool.free_slots) if hasattr(pool, "free_slots") else set()
    rows: set[int] = set()
    for req in requests:
        row = req.req_pool_idx
        where = f"request in row {row}"
        if row in rows:
            problems.append(f"{where}: two running requests hold the row")
        rows.add(row)
        if row in free_rows:
            problems.append(f"{where}: the row is free in the request table")
        cpl = protected_len(req)
        end = int(getattr(req, "kv_allocated_len", committed_len(req)))
        slots = pool.req_to_token[row, :end].to(torch.int64)
        last = req.last_node
        if last is not cache.root_node and (last.lock_ref < 1 or last.value is None):
            problems.append(f"{where}: its last_node {last.id} is {'evicted' if last.value is None else 'not locked'}")
        prefix = _path_slots(last, cache.root_node)
        prefix_slots = torch.cat(prefix) if prefix else slots[:0]
        if prefix_slots.numel() != cpl or not torch.equal(prefix_slots.cpu(), slots[:cpl].cpu()):
            problems.append(
                f"{where}: its first {cpl} slots (cache_protected_len) are not the {prefix_slots.numel()} slots of "
                "its last_node's path"
            )
        owned.append(slots[cpl:])
    return problems, owned


def ownership_problems(cache: "RadixCache", tree: list[torch.Tensor], reqs: list[torch.Tensor]) -> list[str]:
    """Each handed-out slot owned once, by the tree or a request; nothing else handed out; the tree's
    slots in whole pages. Only for kvpool's allocators (a simulated cache's "slots" are anything)."""
    allocator = cache.token_to_kv_pool_allocator
    backup = getattr(allocator, "backup_state", None)
    if not callable(backup):
        return []
    owners = getattr(backup(), "owners", None)
    if not isinstance(owners, torch.Tensor):
        return []  # not a kvpool allocator (a test double): nothing to compare with
    problems: list[str] = []
    owners = owners.cpu().to(torch.int64)
    n_slots = owners.numel()
    claims = torch.zeros(n_slots, dtype=torch.int64)
    for what, parts in (("the tree", tree), ("running requests", reqs)):
        slots = torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.int64)
        outside = slots[(slots < 0) | (slots >= n_slots)]
        if outside.numel():
            problems.append(f"{what} hold{'s' if what == 'the tree' else ''} slots outside 0..{n_slots - 1}: {_sample(outside.tolist())}")
        slots = slots[(slots >= 0) & (slots < n_slots)]
        claims.index_add_(0, slots, torch.ones_like(slots))
    p = cache.page_size
    if tree and p > 1:
        pages = torch.cat(tree).cpu().view(-1, p)
        bad = int(((pages[:, 0] % p != 0) | ((pages[:, 1:] - pages[:, :-1]) != 1).any(1)).sum())
        if bad:
            problems.append(f"{bad} of the tree's pages are not {p} consecutive slots from a page start")
    twice = (claims > 1).nonzero().flatten().tolist()
    if twice:
        problems.append(f"{len(twice)} slots owned twice (tree and/or requests): {_sample(twice)}")
    unheld = ((claims > 0) & (owners == 0)).nonzero().flatten().tolist()
    if unheld:
        problems.append(f"{len(unheld)} slots owned but free in the allocator: {_sample(unheld)}")
    leaked = ((owners > 0) & (claims == 0)).nonzero().flatten().tolist()
    if leaked:
        problems.append(f"{len(leaked)} slots handed out but owned by neither the tree nor a request (leaked): {_sample(leaked)}")
    multi = (owners > 1).nonzero().flatten().tolist()
    if multi:
        problems.append(f"{len(multi)} slots handed out more than once by the allocator: {_sample(multi)}")
    return problems


def check_integrity(cache: "RadixCache", requests: Iterable[Any] = ()) -> None:
    """Check tree, allocator, request table and ``requests`` together; raise ``IntegrityError``
    listing every problem (see ``RadixCache.check_integrity``)."""
    problems, tree_slots = tree_problems(cache)
    reqs = list(requests)
    if cache.req_to_token_pool is not None:
        req_problems, req_slots = request_problems(cache, reqs)
        problems += req_problems
    else:
        req_slots = []
    problems += ownership_problems(cache, tree_slots, req_slots)
    problems += cache._integrity_problems()
    for part, kwargs in ((cache.token_to_kv_pool_allocator, {}), (cache.req_to_token_pool, cache._table_check_args())):
        check = getattr(part, "check_integrity", None)
        if callable(check):
            try:
                check(**kwargs)
            except IntegrityError as e:
                problems.append(str(e))
    if problems:
        raise IntegrityError("RadixCache integrity check failed: " + "; ".join(problems))
