"""``check_integrity``: the tree, its allocator, its request table and the running requests, checked
together. Every slot the allocator has handed out must be owned by exactly one of the tree and a
running request, and every slot either of them owns must be handed out once. The cache reports its
own tree's problems and slots (``RadixTree.tree_problems`` and its tiers'); this module compares
them with the requests, the table and the allocator (the cache typed as
``kvpool.cache.protocols.CheckedCache``).

The checks read everything to the host; they are for tests and debugging.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from kvpool.cache.node import TreeNode
from kvpool.cache.protocols import CheckedCache
from kvpool.cache.requests import committed_len, protected_len
from kvpool.errors import IntegrityError

_SHOWN = 5  # examples listed per kind of problem


def _sample(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:_SHOWN])) + (", ..." if len(xs) > _SHOWN else "")


def _path_slots(node: TreeNode, root: TreeNode) -> Optional[list[torch.Tensor]]:
    """The device slots of ``node``'s path from the root, or None when a node on it is not on the
    device or the path does not reach the root (a detached node)."""
    parts = []
    while node is not root:
        if node is None or node.value is None:
            return None
        parts.append(node.value)
        node = node.parent
    return parts[::-1]


def running_committed_len(req: Any) -> int:
    """A running request's committed length, read without ``pop_committed_kv_cache`` (SGLang's
    ``Req`` marks its KV freed when that is called, which only ``cache_finished_req`` may do):
    ``kv_committed_len`` when the request has it, else ``committed_len``."""
    if hasattr(req, "kv_committed_len"):
        return int(req.kv_committed_len)
    return committed_len(req)


def request_problems(cache: CheckedCache, requests: Iterable[Any]) -> tuple[list[str], list[torch.Tensor]]:
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
        protected = protected_len(req)
        end = int(req.kv_allocated_len) if hasattr(req, "kv_allocated_len") else running_committed_len(req)
        slots = pool.req_to_token[row, :end].to(torch.int64)
        last = req.last_node
        if not isinstance(last, TreeNode):
            problems.append(f"{where}: its last_node is a {type(last).__name__}, not a TreeNode")
            owned.append(slots[protected:])
            continue
        if last is not cache.root_node and (last.lock_ref < 1 or last.value is None):
            problems.append(f"{where}: its last_node {last.id} is {'evicted' if last.value is None else 'not locked'}")
        prefix = _path_slots(last, cache.root_node)
        if prefix is None:  # an evicted last_node is reported above; otherwise a node above it is gone
            if last.value is not None:
                problems.append(f"{where}: its last_node {last.id}'s path to the root is not on the device (evicted or detached)")
            owned.append(slots[protected:])
            continue
        prefix_slots = torch.cat(prefix) if prefix else slots[:0]
        if prefix_slots.numel() != protected or not torch.equal(prefix_slots.cpu(), slots[:protected].cpu()):
            problems.append(
                f"{where}: its first {protected} slots (cache_protected_len) are not the {prefix_slots.numel()} slots of "
                "its last_node's path"
            )
        owned.append(slots[protected:])
    return problems, owned


def ownership_problems(cache: CheckedCache, tree: list[torch.Tensor], reqs: list[torch.Tensor]) -> list[str]:
    """Each handed-out slot owned once, by the tree or a request; nothing else handed out; the tree's
    slots in whole pages. Only for kvpool's allocators (a simulated cache's "slots" are anything)."""
    allocator = cache.token_to_kv_pool_allocator
    backup = getattr(allocator, "backup_state", None)
    if not callable(backup):
        return []
    state = backup()
    owners = getattr(getattr(state, "full", state), "owners", None)  # an SWA allocator: its full part's
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
    whole = [v for v in tree if v.numel() % p == 0]  # a node of a partial page is the tree check's report
    if whole and p > 1:
        pages = torch.cat(whole).cpu().view(-1, p)
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


def check_integrity(
    cache: CheckedCache, requests: Iterable[Any], tree_problems: list[str], tree_slots: list[torch.Tensor],
    table_check_args: dict,
) -> None:
    """Check tree, allocator, request table and ``requests`` together; raise ``IntegrityError``
    listing every problem (see ``RadixCache.check_integrity``).

    Parameters
    ----------
    cache : the cache (its pools, root and page size).
    requests : the running requests.
    tree_problems, tree_slots : what the cache found wrong with its own tree and tiers, and the
        device slot tensors of its nodes.
    table_check_args : keywords for the request table's own ``check_integrity``.
    """
    problems = list(tree_problems)
    reqs = list(requests)
    if cache.req_to_token_pool is not None:
        req_problems, req_slots = request_problems(cache, reqs)
        problems += req_problems
    else:
        req_slots = []
    problems += ownership_problems(cache, tree_slots, req_slots)
    for part, kwargs in ((cache.token_to_kv_pool_allocator, {}), (cache.req_to_token_pool, table_check_args)):
        check = getattr(part, "check_integrity", None)
        if callable(check):
            try:
                check(**kwargs)
            except IntegrityError as e:
                problems.append(str(e))
    if problems:
        raise IntegrityError("RadixCache integrity check failed: " + "; ".join(problems))
