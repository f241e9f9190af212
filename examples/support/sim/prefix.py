"""``serve_sim --prefix-cache``: the simulation on a prefix cache, with a chat workload.

The workload (seeded): conversations start at exponential gaps of mean ``--arrival-every`` steps and
have ``--turns`` turns each. A turn's prompt is the whole conversation so far plus a user message of
``--prompt-len`` tokens (the first turn's "so far" is a few-shot prompt of ``--few-shot-len`` tokens
that every conversation shares), its answer ``--output-len`` tokens, drawn when the workload is made
as a deterministic model would produce them; the next turn arrives a think time (exponential, same
mean) after the answer.

The K/V of a token derive from the token and everything before it: the key of each position
(``Request.keys``) is a rolling hash of the tokens up to it, so requests with a common prefix hold
the same K/V there, and a row the cache hands to a request is checked, byte for byte, against that
request when it finishes (and rows loaded back from the host tier right after the load). A slot
evicted and reused by another request, or returned by a match it does not belong to, fails the check.

The scheduler, in SGLang's shape, matches each admitted request's tokens (all but the last, which
must be computed for its next token) against the tree, locks the match, prefills only the rest,
inserts every prefill chunk it computed (``cache_unfinished_req``), caches finished requests
(``cache_finished_req``), gives a retracted request's own pages back (``is_insert=False``), and
evicts from the tree whenever an allocation needs the room, so the tree keeps what memory allows.
``check_integrity`` (tree, allocator, request table and running requests) runs at the end, and with
``--validate`` before every step; the tree is then emptied and nothing may be left held.

The cache is a ``RadixCache``; with ``--host-tier`` a ``HiRadixCache`` over a host pool (evicted
nodes backed up by ``--host-write-policy`` live on in host memory and are loaded back when matched);
with ``--model qwen3.5`` a ``MambaRadixCache``: nodes carry state snapshots, a match is forked into
the request's state slot and checked against its recurrence, and (pages above one token) each
request snapshots its state into its track slots at every page boundary a step passes; with both, a
``HiMambaRadixCache`` over a ``HybridPoolHost``: KV pages and state snapshots move to the host and
back together, and a load is forked into the request's slot by a second match (both checked).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import random
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from kvpool.cache import CacheInitParams, EvictParams, HiRadixCache, MambaRadixCache, MatchPrefixParams, RadixCache, RadixKey
from kvpool.cache.swa_radix_cache import SWARadixCache
from kvpool.cache import HiMambaRadixCache
from kvpool.host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from kvpool.pools.hybrid_req_pool import HybridReqToTokenPool
from kvpool.pools.mla_pool import MLATokenToKVPool
from support import cache_requests
from support.cache_requests import CacheRequest
from support.sim import hybrid, sliding
from support.sim.config import HYBRID_MODEL, SWA_MODELS
from support.sim.loop import Parts, SimResult, make_pool, make_runner, simulate
from support.sim.scheduler import Request, Scheduler
from support.storage import StorageSite, storage_policy

VOCAB = 32_000
#: The rolling hash of a prefix: key_i = (key_{i-1} * KEY_BASE + token_i + 1) mod KEY_MODULUS, below
#: 2**31 as serve_sim's K/V functions want their keys.
KEY_BASE, KEY_MODULUS = 1_000_003, 2_147_483_647
def prefix_keys(tokens: Sequence[int]) -> list[int]:
    """The key of each position: a rolling hash of the tokens up to it (see KEY_BASE)."""
    out, h = [], 1
    for t in tokens:
        h = (h * KEY_BASE + t + 1) % KEY_MODULUS
        out.append(h)
    return out


# --- the workload ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def chat_request_class(base: type) -> type:
    """serve_sim's ``Request`` (``base``) with its tokens, and what the prefix cache reads and
    writes (``CacheRequest``)."""

    @dataclass(eq=False)
    class ChatRequest(base, CacheRequest):  # type: ignore[misc, valid-type]
        tokens: list[int] = field(default_factory=list)  # prompt, then answer
        think: int = 0  # steps from the previous turn's answer to this turn's arrival
        key_tensor: Optional[torch.Tensor] = None  # [len(tokens)] int64: prefix_keys(tokens)

        def keys(self, start: int, end: int, device: torch.device) -> torch.Tensor:
            return self.key_tensor[start:end].to(device)  # type: ignore[index]

        @property
        def origin_input_ids(self) -> list[int]:
            return self.tokens[: self.prompt_len]

        @property
        def output_ids(self) -> list[int]:
            return self.tokens[self.prompt_len : self.prompt_len + self.generated]

        @property
        def fill_ids(self) -> list[int]:
            return self.tokens[: self.kv_len]

    return ChatRequest


class ChatArrivals:
    """serve_sim's ``Arrivals`` for conversations: a turn after the first is queued when the turn
    before it finishes, ``think`` steps later."""

    def __init__(self, first: list, follow: dict[int, Any]) -> None:
        self.queue, self.follow = first, follow

    def __bool__(self) -> bool:
        return bool(self.queue or self.follow)

    def due(self, step: int) -> list:
        n = bisect.bisect_right(self.queue, step, key=lambda r: r.arrival)
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def next_arrival(self) -> int:
        return self.queue[0].arrival

    def finished(self, r: Any, step: int) -> None:
        nxt = self.follow.pop(r.rid, None)
        if nxt is not None:
            nxt.arrival = step + nxt.think
            bisect.insort(self.queue, nxt, key=lambda q: q.arrival)


def make_chats(cfg: Any) -> ChatArrivals:
    """``cfg.requests`` turns of seeded conversations (the module docstring)."""
    cls = chat_request_class(Request)
    rng = random.Random(cfg.seed)

    def gap() -> float:
        return rng.expovariate(1.0 / cfg.arrival_every) if cfg.arrival_every > 0 else 0.0

    few_shot = [rng.randrange(VOCAB) for _ in range(cfg.few_shot_len)]
    first: list = []
    follow: dict[int, Any] = {}
    t, rid = 0.0, 0
    while rid < cfg.requests:
        history, prev = few_shot, None
        for _ in range(min(rng.randint(*cfg.turns), cfg.requests - rid)):
            prompt = history + [rng.randrange(VOCAB) for _ in range(rng.randint(*cfg.prompt_len))]
            tokens = prompt + [rng.randrange(VOCAB) for _ in range(rng.randint(*cfg.output_len))]
            keys = torch.tensor(prefix_keys(tokens), dtype=torch.int64, device=cfg.device)
            r = cls(rid, len(prompt), len(tokens) - len(prompt), int(t), tokens=tokens, think=int(gap()), key_tensor=keys)
            if prev is None:
                first.append(r)
            else:
                follow[prev.rid] = r
            history, prev, rid = tokens, r, rid + 1
        t += gap()
    return ChatArrivals(first, follow)


# --- the cache ------------------------------------------------------------------------------------


@dataclass
class PrefixStats:
    """--prefix-cache's tallies: lookups, hits, evictions and (host tier) backups."""

    cache: str = ""
    lookups: int = 0  # admissions, re-admissions after a retraction included
    prompt_tokens: int = 0  # tokens the admitted requests needed in the pool before their next token
    matched_tokens: int = 0  # of them, found in the tree on the device
    loaded_tokens: int = 0  # of them, loaded back from the host tier
    storage_tokens: int = 0  # of those, fetched from storage into the host tier for the request (--storage)
    evict_calls: int = 0  # evictions that freed something
    evicted_tokens: int = 0  # device tokens they freed
    evicted_states: int = 0  # state snapshots they freed (hybrid)
    evicted_swa_tokens: int = 0  # SWA tokens they freed (sliding-window models)
    tombstoned_nodes: int = 0  # live nodes they made tombstones: SWA KV freed, full KV kept
    tombstoned_tokens: int = 0
    backed_up_tokens: int = 0  # host tier: tokens backed up
    host_evicted_tokens: int = 0  # host tier: tokens dropped from the host
    forks: int = 0  # hybrid: snapshots copied into a request's state slot
    loaded_states: int = 0  # hybrid host tier: snapshots loaded back from the host with their KV
    integrity_checks: int = 0
    storage: dict[str, int] = field(default_factory=dict)  # --storage: the storage tier's counters
    faults: dict[str, int] = field(default_factory=dict)  # --storage-faults: faults injected, by kind
    storage_drained: bool = True  # every storage write finished before the run's end

    @property
    def hit_rate(self) -> float:
        return (self.matched_tokens + self.loaded_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def tier_rate(self, tokens: int) -> str:
        return f"{100 * tokens / self.prompt_tokens if self.prompt_tokens else 0.0:.1f}%"

    def summary_lines(self, res: Any) -> list[str]:
        """serve_sim's summary lines for these tallies (``res``: the run's ``SimResult``)."""
        cfg, saved, pad = res.config, self.matched_tokens + self.loaded_tokens, " " * 18
        lines = [
            f"  prefix cache    {self.cache}: {self.lookups} lookups, hit rate {100 * self.hit_rate:.1f}% ({saved} of "
            f"{self.prompt_tokens} prompt tokens: {self.matched_tokens} on the device, {self.loaded_tokens} loaded "
            "from the host)",
            f"{pad}prefill tokens saved {saved} ({res.prefill_tokens} prefilled); evictions: {self.evict_calls} calls "
            f"freed {self.evicted_tokens} device tokens",
        ]
        if cfg.host_tier:
            lines.append(
                f"{pad}host tier ({cfg.host_write_policy}, {cfg.host_layout}, {cfg.host_io_backend}): "
                f"{self.backed_up_tokens} tokens backed up, {self.host_evicted_tokens} dropped from the host"
            )
        if cfg.storage is not None:
            lines += self.storage_lines(cfg, pad)
        if cfg.model == "qwen3.5":
            loaded = f", {self.loaded_states} loaded back from the host" if cfg.host_tier else ""
            lines.append(f"{pad}state snapshots: {self.forks} forked into requests' slots (each checked), {self.evicted_states} evicted{loaded}")
        lines.append(f"{pad}check_integrity of tree, allocator, request table and running requests: {self.integrity_checks} checks")
        return lines

    def storage_lines(self, cfg: Any, pad: str) -> list[str]:
        host = self.loaded_tokens - self.storage_tokens
        st = self.storage
        lines = [
            f"{pad}hit rate by tier: device {self.tier_rate(self.matched_tokens)}, host {self.tier_rate(host)}, storage "
            f"{self.tier_rate(self.storage_tokens)} ({self.matched_tokens} / {host} / {self.storage_tokens} tokens)",
            f"{pad}storage tier {cfg.storage.describe()}: {st.get('pages_written', 0)} pages written, "
            f"{st.get('pages_read', 0)} read ({st.get('tokens_loaded', 0)} tokens into the host, "
            f"{st.get('tokens_dropped', 0)} dropped); {st.get('write_failures', 0)} write and "
            f"{st.get('prefetch_failures', 0)} prefetch failures, {st.get('writes_skipped', 0)} pages skipped backing off",
        ]
        if "states_written" in st:  # the hybrid cache's state snapshots, stored beside their KV
            lines.append(
                f"{pad}state snapshots in storage: {st['states_written']} written, {st['states_read']} read, "
                f"{st['state_write_failures']} write failures, {st['states_missing']} prefetches without one"
            )
        if self.faults:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
            lines.append(f"{pad}faults injected into storage calls: {sum(self.faults.values())} ({kinds})")
        if not self.storage_drained:
            lines.append(f"{pad}storage writes FAILED to finish before the end of the run")
        return lines


class TalliedCache:
    """Mixed into a prefix cache: its evictions (and, with a host tier, backups) go into ``stats``;
    ``counting`` off while the run empties the tree at its end."""

    stats: PrefixStats
    counting = True

    def evict(self, params: Any) -> Any:
        live = sliding.live_nodes(self) if self.counting and self.supports_swa() else set()  # type: ignore[attr-defined]
        result = super().evict(params)  # type: ignore[misc]
        if self.counting and (result.num_tokens_evicted or result.mamba_num_evicted or result.swa_num_tokens_evicted):
            self.stats.evict_calls += 1
            self.stats.evicted_tokens += result.num_tokens_evicted
            self.stats.evicted_states += result.mamba_num_evicted
            self.stats.evicted_swa_tokens += result.swa_num_tokens_evicted
        if live:
            nodes, tokens = sliding.new_tombstones(self, live)
            self.stats.tombstoned_nodes += nodes
            self.stats.tombstoned_tokens += tokens
        return result


class TalliedHostTier(TalliedCache):
    def write_backup(self, node: Any, write_back: bool = False) -> int:
        n = super().write_backup(node, write_back)  # type: ignore[misc]
        if self.counting:
            self.stats.backed_up_tokens += n
        return n

    def evict_host(self, num_tokens: int) -> int:
        n = super().evict_host(num_tokens)  # type: ignore[misc]
        if self.counting:
            self.stats.host_evicted_tokens += n
        return n


def _with(mixin: type, base: type) -> type:
    return type(base.__name__, (mixin, base), {})


#: The caches with a host tier.
TIERED = (HiRadixCache, HiMambaRadixCache)


def make_cache(cfg: Any, pool: Any, allocator: Any, table: Any, stats: PrefixStats, storage: Any = None) -> RadixCache:
    """The run's prefix cache over the scheduler's allocator and request table (``storage``: a
    backend below the host tier, or None)."""
    states = isinstance(table, HybridReqToTokenPool)
    params = CacheInitParams(
        disable=False, req_to_token_pool=table, token_to_kv_pool_allocator=allocator, page_size=cfg.page_size,
        enable_mamba_extra_buffer=states and cfg.page_size > 1,
    )  # fmt: skip
    if states and cfg.host_tier:
        cache = _with(TalliedHostTier, HiMambaRadixCache)(
            params, host_pool=hybrid.host_pool(cfg, pool), write_policy=cfg.host_write_policy,
            io_backend=cfg.host_io_backend, mamba_cache_chunk_size=cfg.page_size, validate=cfg.validate,
            storage=storage, storage_policy=storage_policy(cfg.page_size) if storage is not None else None,
        )  # fmt: skip
    elif states:
        cache = _with(TalliedCache, MambaRadixCache)(params, mamba_cache_chunk_size=cfg.page_size, validate=cfg.validate)
    elif cfg.model in SWA_MODELS:
        params.sliding_window_size = cfg.sliding_window
        cache = _with(TalliedCache, SWARadixCache)(params, validate=cfg.validate)
    elif cfg.host_tier:
        host_cls = MLATokenToKVPoolHost if isinstance(pool, MLATokenToKVPool) else MHATokenToKVPoolHost
        try:
            host = host_cls(pool, cfg.host_ratio, 0, cfg.page_size, cfg.host_layout, validate=cfg.validate)
        except ValueError as e:  # too few host slots for a page
            raise ValueError(f"--host-ratio {cfg.host_ratio:g} is too small: {e}") from None
        cache = _with(TalliedHostTier, HiRadixCache)(
            params, host_pool=host, write_policy=cfg.host_write_policy, io_backend=cfg.host_io_backend,
            validate=cfg.validate, storage=storage,
            storage_policy=storage_policy(cfg.page_size) if storage is not None else None,
        )  # fmt: skip
    else:
        cache = _with(TalliedCache, RadixCache)(params, validate=cfg.validate)
    cache.stats = stats
    stats.cache = f"{type(cache).__name__}(page_size={cfg.page_size}, {cache.eviction_policy})"
    return cache


# --- the scheduler --------------------------------------------------------------------------------


class PrefixScheduler:
    """serve_sim's scheduler (mixed into ``serve_sim.Scheduler`` or support.sim.hybrid's) on a prefix
    cache; ``runner`` checks rows loaded from the host tier and forked states, ``result`` tallies."""

    def __init__(self, cfg: Any, pool: Any, *args: Any, runner: Any, result: Any, storage: Any = None, **kwargs: Any) -> None:
        super().__init__(cfg, pool, *args, **kwargs)  # type: ignore[call-arg]
        self.runner, self.result, self.stats = runner, result, result.prefix
        self.hybrid = isinstance(self.table, HybridReqToTokenPool)
        self.cache = make_cache(cfg, pool, self.allocator, self.table, self.stats, storage)
        self.loads: list[tuple[Any, int, torch.Tensor]] = []  # this step's host loads: (request, from, slots)
        self.fetched: dict[int, int] = {}  # per waiting request: tokens fetched from storage for it

    def room(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def schedule(self, with_decode: bool = True) -> Any:
        if isinstance(self.cache, TIERED):
            self.cache.check_hicache_events()  # unlock the nodes whose transfers are done
        if self.cfg.validate:
            self.check_integrity()
        batch = super().schedule(with_decode)  # type: ignore[misc]
        if self.loads:
            self.cache.ready_to_load_host_cache()
            for r, start, slots in self.loads:  # reads through the getters: waits for each layer's load
                bad, _ = self.runner.verify(r, slots, start)
                self.result.reloaded += 1
                self.result.reloaded_tokens += slots.numel()
                self.result.reload_mismatches += bad
            self.loads = []
        return batch

    def admit(self, r: Any, budget: int, pages: int) -> Optional[tuple[int, int, int]]:
        """As serve_sim's, with the cached prefix: matched (and loaded back from the host), locked,
        and written into the request's row; only the rest is computed."""
        if not cache_requests.take_row(self.table, self.cache, r):
            return None
        room = self.room()  # what locking the match and loading it back take from it, the admission takes
        target = r.prompt_len + r.generated
        key = RadixKey(r.tokens[: target - 1])  # the last token is computed: its logits give the next
        params = MatchPrefixParams(key=key, cow_mamba=self.hybrid, req=r if self.hybrid else None)
        m, fetched = cache_requests.match_with_storage(self.cache, r.rid, params)
        self.fetched[r.rid] = self.fetched.get(r.rid, 0) + fetched  # a refused admission loads them when retried
        prefix, node, loaded = m.device_indices, m.last_device_node, 0
        if m.host_hit_length:
            start = prefix.numel() + m.host_hit_length
            new = self.pages_for(min(target, start + budget)) - start // self.page_size
            states = hybrid.parked_states(m.last_host_node) if self.hybrid else 0
            slots, node = self.cache.init_load_back(m.last_host_node, m.host_hit_length, (pages - new) * self.page_size)
            if slots.numel():
                prefix, loaded = torch.cat((prefix, slots)), slots.numel()
                if self.hybrid:  # the loaded state into the request's slot (checked below)
                    hybrid.fork_loaded(self.cache, params, node, prefix)
                    self.stats.loaded_states += states
        start = prefix.numel()
        end = min(target, start + budget)
        lock = self.cache.inc_lock_ref(node)  # an SWARadixCache's: swa_uuid_for_lock
        taken = self.pages_for(end) - start // self.page_size + (room - self.room()) // self.page_size
        if taken > pages:
            self.cache.dec_lock_ref(*((node, lock) if self.cache.supports_swa() else (node,)))
            cache_requests.give_back_row(self.table, r)
            return None
        if start:
            self.table.write((r.row, slice(0, start)), prefix.to(torch.int32))
        r.kv_len, r.prefill_target = start, target
        r.last_node, r.cache_protected_len, r.prefix_indices = node, start, prefix
        r.mamba_last_track_seqlen = None
        if self.cache.supports_swa():
            r.swa_uuid_for_lock, r.swa_evicted_seqlen = lock, 0
        self.stats.lookups += 1
        self.stats.prompt_tokens += target
        self.stats.matched_tokens += start - loaded
        self.stats.loaded_tokens += loaded
        self.stats.storage_tokens += min(self.fetched.pop(r.rid, 0), loaded)
        if loaded:
            self.loads.append((r, start - loaded, slots))
        if self.hybrid and start:
            self.stats.forks += 1
            self.result.state_checked += 1
            self.result.state_mismatches += self.runner.verify_state(r, start)
        return start, end, taken

    def alloc_prefill(self, plan: list) -> torch.Tensor:
        need = sum(self.pages_for(e) - self.pages_for(s) for _, s, e in plan) * self.page_size
        cache_requests.make_room(self.cache, self.allocator, need)
        return super().alloc_prefill(plan)  # type: ignore[misc]

    def _alloc_decode(self, decode: list) -> torch.Tensor:
        need = sum(1 for r in decode if r.kv_len % self.page_size == 0) * self.page_size
        cache_requests.make_room(self.cache, self.allocator, need)
        return super()._alloc_decode(decode)  # type: ignore[misc]

    def advance(self, batch: Any) -> None:
        """As serve_sim's; then every prefill chunk's whole pages go into the tree (SGLang caches a
        request's prompt as soon as it is computed, so that requests arriving meanwhile share it)."""
        super().advance(batch)  # type: ignore[misc]
        for r, _, _ in batch.prefill:
            if r.prefilling or r.generated < r.output_len:
                self.cache.cache_unfinished_req(r, chunked=r.prefilling)

    def release(self, r: Any) -> None:
        """A finished request's pages go into the tree (the tree frees what it held already)."""
        self.cache.cache_finished_req(r)
        self.table.free(r.row)
        self.running.remove(r)
        r.row = None

    def retract(self, r: Any) -> None:
        """A retracted request gives its own pages back and unlocks its prefix, which stays cached."""
        self.cache.cache_finished_req(r, is_insert=False)
        self.table.free(r.row)
        self.running.remove(r)
        r.row, r.kv_len, r.cache_protected_len, r.prefix_indices = None, 0, 0, None
        r.last_node = self.cache.root_node
        self.waiting.appendleft(r)
        self.retractions += 1

    def check_integrity(self) -> None:
        self.stats.integrity_checks += 1
        self.cache.check_integrity(self.running)

    def leaked_slots(self) -> int:
        """Empty the tree (device, host and states), then count what is still held anywhere."""
        cache = self.cache
        cache.counting = False
        if isinstance(cache, TIERED):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every backup and load done: their nodes unlock
            cache.check_hicache_events()
            tier = cache.storage_tier
            if tier is not None:
                self.stats.storage_drained = tier.drain()
                tier.close()
                self.stats.storage = dataclasses.asdict(tier.stats)
        kv = cache.evictable_size()
        if isinstance(cache, MambaRadixCache):
            cache.evict(EvictParams(num_tokens=kv, mamba_num=cache.mamba_evictable_size()))
        else:
            cache.evict(EvictParams(num_tokens=kv))
        held = self.settled_slots_in_use()
        if isinstance(cache, TIERED):
            host = cache.token_to_kv_pool_host
            cache.evict_host(host.size)
            held += host.size - host.available_size()
        if isinstance(cache, HiMambaRadixCache):
            held += cache.mamba_pool_host.size - cache.mamba_pool_host.available_size()
        if self.hybrid:
            held += self.table.mamba_pool.size - self.table.mamba_pool.available_size()
        return held


# --- the hybrid model's track slots ---------------------------------------------------------------


class RunnerWithTracks:
    """Mixed into support.sim.hybrid's runner when pages hold more than one token: a request's state
    is known to the cache only at page boundaries, so each step advances it up to the last boundary
    its segment passes, snapshots it into the request's next track slot there (SGLang's mamba
    track: ``mamba_next_track_idx``, ``mamba_last_track_seqlen``), and advances the rest."""

    def advance_states(self, segments: list) -> None:
        page = self.cfg.page_size  # type: ignore[attr-defined]
        head, tail, tracked = [], [], []
        for r, s, e in segments:
            b = e // page * page
            head.append((r, s, b if b > s else e))
            if b > s:
                tracked.append((r, b))
                if e > b:
                    tail.append((r, b, e))
        super().advance_states(head)  # type: ignore[misc]
        if tracked:
            table = self.table  # type: ignore[attr-defined]
            slots = [table.mamba_slot(r.row) for r, _ in tracked]
            reqs, lengths = zip(*tracked)
            cache_requests.track(table, reqs, lengths, torch.tensor(slots, dtype=torch.int64, device=self.states.device))  # type: ignore[attr-defined]
        super().advance_states(tail)  # type: ignore[misc]


# --- the run --------------------------------------------------------------------------------------


def run(cfg: Any) -> Any:
    """serve_sim's run on a prefix cache with the chat workload."""
    if cfg.model == HYBRID_MODEL:
        extra = cfg.page_size > 1  # the state is known at page boundaries: track slots
        b = hybrid.build(cfg, extra_buffer=extra, spare_states=cfg.max_running,
                         runner_mixin=RunnerWithTracks if extra else None)  # fmt: skip
        pool, runner, result, parts = b.pool, b.runner, b.result, b.parts
        base = functools.partial(_with(PrefixScheduler, _with(hybrid.SchedulerWithStates, Scheduler)), table=b.table)
    elif cfg.model in SWA_MODELS:
        pool, runner, result, parts = sliding.build(cfg)
        windows = parts.scheduler
        base = functools.partial(sliding.on_cache(_with(PrefixScheduler, windows.func)), **windows.keywords)
    else:
        pool, geometry = make_pool(cfg)
        runner = make_runner(cfg, pool)
        result = SimResult(cfg, pool.size, geometry.bytes_per_token, device=str(pool.device))
        parts, base = Parts(), _with(PrefixScheduler, Scheduler)
    result.prefix = PrefixStats()
    with StorageSite(cfg.storage) if cfg.storage is not None else contextlib.nullcontext(None) as site:
        name = f"serve_sim seed {cfg.seed}, {cfg.model} {cfg.dtype}"
        storage = site.open(name, page_first=cfg.host_layout == "page_first") if site is not None else None
        parts = replace(
            parts, scheduler=functools.partial(base, runner=runner, result=result, storage=storage),
            host_parking=lambda *args: None,  # the host tier is the cache's
            arrivals=lambda c: make_chats(c),
        )  # fmt: skip
        simulate(cfg, pool, runner, result, parts)
        if site is not None:
            result.prefix.faults = site.faults()
            if not result.prefix.storage_drained:
                result.integrity_error = result.integrity_error or "the storage tier's writes did not finish"
    return result
