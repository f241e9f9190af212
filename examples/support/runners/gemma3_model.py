"""The Gemma 3 runner's model, pools and scheduler: its shapes (``GemmaShape``, ``SHAPES``), the
seeded ``Gemma3ForCausalLM``, which layers slide (``swa_geometry``), the ``SWAKVPool`` of a run sized
by ``plan_swa_pools`` (``make_pool``, ``SWAPools``; with speculative decoding the draft's pool too) and
the scheduler that gives each request's sliding-window slots back as its tokens leave the window
(``SWAScheduler``, with verify steps for speculative decoding). The pools and the
scheduler hold any model whose config has ``layer_types`` and ``sliding_window`` (the gpt-oss runner's too).

The window rule is transformers' (``masking_utils.sliding_window_overlay`` and
``DynamicSlidingWindowLayer``): a query at position ``q`` of a sliding layer sees the keys at
positions ``k`` with ``q - window < k <= q``, its own included, ``window`` keys at most. Every later
query of a request is at a position >= its ``kv_len`` (the tokens whose K/V is in the pool), so the
tokens at positions ``<= kv_len - window`` are never read again by a sliding layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvpool import KVGeometry, MHATokenToKVPool, SWAKVPool, SWASizing, SWATokenToKVPoolAllocator, plan_swa_pools
from kvpool.checks import positive_int
from kvpool.errors import IntegrityError
from support.part_counts import PathCounts
from support.runners.config import RunConfig
from support.runners.scheduler import Request
from support.runners.verify import VerifyScheduling

from transformers import Gemma3ForCausalLM, Gemma3TextConfig

# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmaShape:
    """The dimensions of a Gemma 3 text model.

    Layer ``i`` is global (full attention, RoPE base ``global_rope_theta``) iff ``(i + 1) %
    sliding_window_pattern == 0``, otherwise local (sliding window of ``sliding_window`` tokens, RoPE
    base ``local_rope_theta``): 5 local to 1 global at Gemma 3's pattern of 6. Attention scores are
    scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma 3's own scalar, not ``head_dim``), and the
    LM head's logits soft-capped at ``final_logit_softcapping`` (None: not capped).
    """

    layers: int = 6
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 128
    vocab: int = 128
    sliding_window: int = 10
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: int = 48
    local_rope_theta: float = 10000.0
    global_rope_theta: float = 1000000.0
    final_logit_softcapping: Optional[float] = 30.0
    init_std: Optional[float] = None  # the weights' std (HF's initializer_range); None: 2 / sqrt(hidden)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                     "query_pre_attn_scalar", "sliding_window_pattern"):  # fmt: skip
            positive_int(getattr(self, name), name)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads = {self.heads}, got {self.kv_heads}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 2:
            # transformers' sliding cache keeps the last window - 1 tokens, which is everything at 1
            raise ValueError(f"sliding_window must be an int >= 2, got {self.sliding_window!r}")
        if not 2 <= self.sliding_window_pattern <= self.layers:
            raise ValueError(
                f"sliding_window_pattern must be in 2..layers = {self.layers} (at least one layer of each kind), "
                f"got {self.sliding_window_pattern}"
            )
        if self.init_std is not None and not self.init_std > 0:
            raise ValueError(f"init_std must be None or > 0, got {self.init_std}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping must be None or > 0, got {self.final_logit_softcapping}")

    @property
    def layer_types(self) -> list[str]:
        k = self.sliding_window_pattern
        return ["full_attention" if (i + 1) % k == 0 else "sliding_attention" for i in range(self.layers)]

    def describe(self) -> str:
        full = self.layer_types.count("full_attention")
        cap = f", logits soft-capped at {self.final_logit_softcapping:g}" if self.final_logit_softcapping else ""
        return (
            f"{self.layers} layers ({self.layers - full} local with a window of {self.sliding_window} tokens, {full} "
            f"global), hidden {self.hidden}, {self.heads} query / {self.kv_heads} KV heads x {self.head_dim}, "
            f"query_pre_attn_scalar {self.query_pre_attn_scalar}, RoPE bases {self.local_rope_theta:g} local / "
            f"{self.global_rope_theta:g} global, intermediate {self.intermediate}, vocab {self.vocab}{cap}"
        )


SHAPES = {
    "tiny": GemmaShape(),
    "small": GemmaShape(
        layers=12, hidden=256, heads=8, kv_heads=4, head_dim=64, intermediate=512, vocab=512, sliding_window=16,
        query_pre_attn_scalar=96,
    ),
}  # fmt: skip


def text_config(shape: GemmaShape) -> Gemma3TextConfig:
    """The HF text config of ``shape``. Weights are drawn with std ``shape.init_std``, by default
    ``2/sqrt(hidden)``, and the LM head is not tied to the embedding: with HF's own 0.02 or with a tied
    head a tiny random model mostly repeats one token (the current token's scaled embedding dominates
    the residual), which would make the comparison with HF weak. No token ends a sequence."""
    return Gemma3TextConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        initializer_range=shape.init_std or 2 * shape.hidden**-0.5,
        query_pre_attn_scalar=shape.query_pre_attn_scalar,
        sliding_window=shape.sliding_window,
        layer_types=shape.layer_types,
        final_logit_softcapping=shape.final_logit_softcapping,
        tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": shape.local_rope_theta},
            "full_attention": {"rope_type": "default", "rope_theta": shape.global_rope_theta},
        },
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(config: dict[str, Any], dtype: torch.dtype, device: str | torch.device, seed: int) -> Gemma3ForCausalLM:
    """``Gemma3ForCausalLM(Gemma3TextConfig(**config))`` built in float32 on the CPU right after
    ``torch.manual_seed(seed)`` (what ``--json`` tells others to rebuild), then moved to ``device`` and
    ``dtype``, with HF's eager attention (the reference the runner matches)."""
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**config))
    model.set_attn_implementation("eager")
    return model.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class SWAGeometry:
    """What a Gemma 3 model's ``SWAKVPool`` must hold, and which layers slide."""

    kv_heads: int
    head_dim: int
    window: int
    swa_layers: tuple[int, ...]  # global ids of the sliding-window (local) layers
    full_layers: tuple[int, ...]  # global ids of the global layers


def swa_geometry(model: Gemma3ForCausalLM) -> SWAGeometry:
    c = model.config
    kinds = list(c.layer_types)
    return SWAGeometry(
        kv_heads=c.num_key_value_heads, head_dim=c.head_dim, window=c.sliding_window,
        swa_layers=tuple(i for i, t in enumerate(kinds) if t == "sliding_attention"),
        full_layers=tuple(i for i, t in enumerate(kinds) if t == "full_attention"),
    )  # fmt: skip


# --- the pools ------------------------------------------------------------------------------------

#: The draft model's K/V dtype: the target on an FP8 pool (scale 1.0) is a draft that agrees with it
#: except where the rounding turns a near-tie, so verify steps accept anything from none to all drafts.
DRAFT_DTYPE = torch.float8_e5m2


def swa_pages(window: int, page_size: int, step_tokens: int, tokens: int) -> int:
    """The most SWA pages a request of ``tokens`` K/V tokens holds at once when at most
    ``step_tokens`` of them are added in one step and, after every step, the whole pages of tokens
    that left the window are given back: the kept tokens are at most ``window - 1`` live ones plus
    ``page_size - 1`` before them on the first kept page, and a step adds its tokens to them."""
    return -(-min(window + page_size - 2 + step_tokens, tokens) // page_size)


def cached_swa_pages(window: int, page_size: int, step_tokens: int, prompt_len: int, tokens: int, locked: int = 0) -> int:
    """The most SWA pages a request of ``tokens`` K/V tokens and a ``prompt_len``-token prompt keeps
    alive at once on a prefix cache (support.runners.swa_prefix), its own and those its lock holds in
    the tree. Its own: it keeps the last window of its whole pages (``ceil(window / page) * page``
    slots, and the partial page after them), plus a step's tokens. Its lock: the window the match
    locked (``locked`` tokens) and what later insertions of its prompt add to it, at most a window
    and an inserted step's pages."""
    p = page_size
    own = min(-(-window // p) * p + p - 1 + step_tokens, tokens)
    lock = locked + min(prompt_len, window + step_tokens + p)
    return -(-own // p) + -(-lock // p)


@dataclass
class SWAPools:
    """One run's ``SWAKVPool`` (``kv``: local layers in its SWA part, global layers in its full part),
    the sliding window and the sizing it was built at, and for speculative decoding the draft model's
    pool (``draft``: every layer's K/V at the full part's slots, ``DRAFT_DTYPE``). It stands where the shared code
    expects a KV pool: size, page size, dtype and device are the pool's, ``stats`` counts both parts'
    writes."""

    kv: SWAKVPool
    window: int
    sizing: SWASizing
    all_layers_bytes: int  # what a pool keeping every layer's K/V at the full part's size would take
    draft: Optional[MHATokenToKVPool] = None
    stats: PathCounts = field(init=False)

    def __post_init__(self) -> None:
        self.stats = PathCounts(self.kv)

    def __getattr__(self, name: str) -> Any:  # size, size_swa, page_size, dtype, device
        if name == "kv":
            raise AttributeError(name)
        return getattr(self.kv, name)


def plan_pools(
    cfg: RunConfig, g: SWAGeometry, dtype: torch.dtype, verify_width: Optional[int] = None
) -> tuple[SWASizing, int, int]:
    """``plan_swa_pools`` for ``cfg.batch`` of the longest requests: the full part holds their whole
    length, the SWA part their largest live window (``swa_pages``, a step adding a prefill chunk or a
    verify block of ``verify_width`` tokens; on a prefix cache ``cached_swa_pages`` without a match,
    the tree holding the rest of both parts); with ``verify_width`` the draft pool (every layer in
    ``DRAFT_DTYPE``, the draft model's K/V) holds what the full part holds. The budget is what those
    pools take, split at their ratio. Returns the sizing and the slots each part needs."""
    p = cfg.page_size
    step = max(min(cfg.prompt_len[1], cfg.chunk_size or cfg.prompt_len[1]), verify_width or 1)
    full_need = cfg.batch * -(-cfg.max_context_len // p) * p
    if cfg.prefix_cache:
        swa_need = cfg.batch * cached_swa_pages(g.window, p, step, cfg.prompt_len[1], cfg.max_context_len) * p
        swa_need = min(swa_need, full_need)  # no part holds more SWA slots than full ones
    else:
        swa_need = cfg.batch * swa_pages(g.window, p, step, cfg.max_context_len) * p
    full = KVGeometry(g.kv_heads, g.head_dim, len(g.full_layers), dtype)
    swa = KVGeometry(g.kv_heads, g.head_dim, len(g.swa_layers), dtype)
    draft = KVGeometry(g.kv_heads, g.head_dim, len(g.full_layers) + len(g.swa_layers), DRAFT_DTYPE) if verify_width else None
    budget = full.pool_bytes(full_need, p) + swa.pool_bytes(swa_need, p) + (draft.pool_bytes(full_need, p) if draft else 0)
    ratio = min(1.0, (swa_need + 0.5) / full_need)  # the half keeps the float product from rounding below
    sizing = plan_swa_pools(budget, full, swa, ratio, page_size=p, draft=draft)
    if sizing.size < full_need or sizing.size_swa < swa_need:
        raise RuntimeError(
            f"plan_swa_pools gave ({sizing.size}, {sizing.size_swa}) slots for a budget that holds "
            f"({full_need}, {swa_need})"
        )
    return sizing, full_need, swa_need


def make_pool(
    cfg: RunConfig, model: Gemma3ForCausalLM, dtype: torch.dtype, verify_width: Optional[int] = None
) -> SWAPools:
    """An ``SWAKVPool`` of ``dtype`` with room for ``cfg.batch`` of the longest requests (admission
    waits for the rest), its parts sized by ``plan_pools``; with ``verify_width`` (speculative
    decoding's verify blocks) also the draft's ``MHATokenToKVPool`` of every layer in ``DRAFT_DTYPE``,
    of the sizing's ``draft_size``."""
    if cfg.page_size < 2:
        raise ValueError(
            f"page_size must be at least 2 (SWATokenToKVPoolAllocator extends requests page by page), got {cfg.page_size}"
        )
    g = swa_geometry(model)
    sizing, _, _ = plan_pools(cfg, g, dtype, verify_width)
    kv = SWAKVPool(
        sizing.size, sizing.size_swa, cfg.page_size, dtype, g.kv_heads, g.head_dim, g.swa_layers, g.full_layers,
        False, cfg.device,
    )  # fmt: skip
    draft = None
    if verify_width is not None:
        draft = MHATokenToKVPool(
            sizing.draft_size, cfg.page_size, DRAFT_DTYPE, g.kv_heads, g.head_dim, len(g.full_layers) + len(g.swa_layers),
            cfg.device,
        )  # fmt: skip
    every = KVGeometry(g.kv_heads, g.head_dim, len(g.swa_layers) + len(g.full_layers), dtype)
    return SWAPools(kv, g.window, sizing, every.pool_bytes(sizing.size, cfg.page_size), draft)


# --- the scheduler ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepMemory:
    """The slots each part holds at the end of one step (after its frees)."""

    running: int
    tokens: int  # K/V tokens of the running requests
    full_held: int
    swa_held: int
    swa_bound: int  # the most the running requests may hold in the SWA part: a live window and a page each


class SWAScheduler(VerifyScheduling):
    """The shared scheduler on an ``SWATokenToKVPoolAllocator`` over ``pools``; with
    ``verify_width``, verify steps of speculative decoding in place of decode steps.

    After every step each running request gives back, with ``free_swa``, the SWA part of its whole
    pages whose tokens all left the window (positions ``<= kv_len - window``); its full slots stay
    until it finishes, when ``free`` gives back both parts of what is left. A request is admitted when
    the full part has pages for its whole length and the SWA part for the most it holds at once
    (``swa_pages``, a step adding a prefill chunk or a verify block), on top of what the running
    requests may still take; a verify step's rejected slots go back in both parts before the window's
    pages are given back. With ``check_each_step``,
    every step ends with the allocator's ``check_integrity()``, a check that each running request's
    live window is mapped and the tokens before it are not, and that the SWA part holds no more than
    a live window and a page per request; the first failure is raised by ``check_integrity()``.
    """

    def __init__(
        self, pools: SWAPools, max_running: int, max_context_len: int, chunk_size: Optional[int],
        check_each_step: bool = True, verify_width: Optional[int] = None,
    ) -> None:  # fmt: skip
        self.pools = pools
        super().__init__(pools, max_running, max_context_len, chunk_size)  # type: ignore[arg-type]
        self.verify_width = verify_width
        self.window = pools.window
        self.capacity = self.allocator.size_full
        self.swa_capacity = self.allocator.size_swa
        self.check_each_step = check_each_step
        self.released: dict[int, int] = {}  # rid -> tokens whose SWA part was given back (a page multiple)
        self.steps: list[StepMemory] = []
        self.step_error: Optional[str] = None

    def _make_allocator(self, pool: Any) -> SWATokenToKVPoolAllocator:
        return SWATokenToKVPoolAllocator(pool.size, pool.size_swa, pool.page_size, pool.dtype, pool.device, pool.kv)

    def swa_pages(self, r: Request) -> int:
        step = max(min(len(r.prompt), self.chunk_size or len(r.prompt)), self.verify_width or 1)
        return swa_pages(self.window, self.page_size, step, r.final_kv_len)

    def add(self, r: Request) -> None:
        if self.swa_pages(r) * self.page_size > self.swa_capacity:
            raise ValueError(
                f"request {r.rid} needs {self.swa_pages(r) * self.page_size} SWA slots at once, the SWA part has "
                f"{self.swa_capacity}"
            )
        super().add(r)

    def _admit(self) -> list[Request]:
        free = self.allocator.full_available_size() // self.page_size
        free -= sum(self.pages(r.final_kv_len) - self.pages(r.kv_len) for r in self.running)
        swa_free = self.swa_capacity // self.page_size - sum(self.swa_pages(r) for r in self.running)
        out = []
        while self.waiting:
            r = self.waiting[0]
            need, swa_need = self.pages(r.final_kv_len), self.swa_pages(r)
            if need > free or swa_need > swa_free or not self._take_row(r):
                break
            self.running.append(self.waiting.popleft())
            out.append(r)
            free -= need
            swa_free -= swa_need
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _give_back_row(self, r: Request) -> None:
        self.released.pop(r.rid, None)
        super()._give_back_row(r)

    def live_from(self, r: Request) -> int:
        """The first position whose SWA part ``r`` keeps: the start of the page of its oldest token
        still inside the window."""
        return max(0, r.kv_len - self.window + 1) // self.page_size * self.page_size

    def advance(self, batch: Any, logits: torch.Tensor, keep_logits: bool) -> None:
        super().advance(batch, logits, keep_logits)  # frees the finished requests
        self._release_windows()

    def advance_verify(self, batch: Any, tokens: Any, logits: Any) -> None:
        super().advance_verify(batch, tokens, logits)  # frees the rejected slots and the finished requests
        self._release_windows()

    def _release_windows(self) -> None:
        """Each running request gives back the SWA part of its whole pages that left the window; then
        the step's checks and memory figures."""
        self.allocator.free_group_begin()
        for r in self.running:
            start, end = self.released.get(r.rid, 0), self.live_from(r)
            if end > start:
                self.allocator.free_swa(self.table.req_to_token[r.row, start:end].to(torch.int64))
                self.released[r.rid] = end
        self.allocator.free_group_end()
        self._end_of_step()

    def _end_of_step(self) -> None:
        if self.check_each_step and self.step_error is None:
            try:
                self.allocator.check_integrity()
                self._check_windows()
            except RuntimeError as e:
                self.step_error = f"after step {len(self.steps) + 1}: {e}"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the free counts the device sends back, before reading them
        a = self.allocator
        bound = self.swa_bound()
        step = StepMemory(
            len(self.running), sum(r.kv_len for r in self.running), a.size_full - a.full_available_size(),
            a.size_swa - a.swa_available_size(), bound,
        )  # fmt: skip
        self.steps.append(step)
        if self.check_each_step and self.step_error is None and step.swa_held > bound:
            self.step_error = (
                f"after step {len(self.steps)}: the SWA part holds {step.swa_held} slots, more than its bound for the "
                f"{step.running} running requests ({bound}: {self.swa_bound_rule})"
            )

    swa_bound_rule = "a live window and a page each"

    def swa_bound(self) -> int:
        """The most SWA slots the allocator may have handed out at a step's end: a live window and a
        page per running request."""
        p = self.page_size
        return len(self.running) * swa_pages(self.window, p, 0, self.max_context_len) * p

    def _check_windows(self) -> None:
        """Each running request's tokens in the window are mapped to SWA slots; those before its kept
        pages are not."""
        problems = []
        for r in self.running:
            full = self.table.req_to_token[r.row, : r.kv_len].to(torch.int64)
            swa = self.allocator.translate_loc_from_full_to_swa(full).cpu()
            live, kept = max(0, r.kv_len - self.window + 1), self.released.get(r.rid, 0)
            if bool((swa[live:] <= 0).any()):
                problems.append(f"request {r.rid} lost the SWA slot of a token inside its window")
            if bool((swa[:kept] != 0).any()):
                problems.append(f"request {r.rid} still maps a token whose SWA slot it gave back")
        if problems:
            raise IntegrityError("; ".join(problems))

    def check_integrity(self) -> None:
        if self.step_error is not None:
            raise IntegrityError(self.step_error)
        super().check_integrity()

    def slots_in_use(self) -> int:
        a = self.allocator
        return (a.size_full - a.full_available_size()) + (a.size_swa - a.swa_available_size())

    @property
    def memory(self) -> dict[str, int]:
        """The run's memory figures: the most slots each part held at a step's end, the SWA bound at
        that step, the pool's slots and bytes, what a pool keeping every layer's K/V would take, and
        the draft model's pool (0 without one)."""
        peak = max(self.steps, key=lambda s: s.swa_held, default=StepMemory(0, 0, 0, 0, 0))
        s = self.pools.sizing
        return {
            "swa_peak": peak.swa_held, "swa_peak_running": peak.running, "swa_peak_bound": peak.swa_bound,
            "full_peak": max((m.full_held for m in self.steps), default=0), "size": s.size, "size_swa": s.size_swa,
            "pool_bytes": s.full_bytes + s.swa_bytes, "all_layers_bytes": self.pools.all_layers_bytes,
            "draft_bytes": s.draft_bytes,
        }  # fmt: skip
