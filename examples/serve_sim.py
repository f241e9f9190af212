"""Serve a stream of requests through kvpool: a scheduler and a model runner, simulated.

The scheduler admits requests as they arrive (seeded prompt and output lengths), reserves their
KV-cache slots with a ``PagedTokenToKVPoolAllocator`` (``--page-size 1``: ``TokenToKVPoolAllocator``),
records them in a ``ReqToTokenPool``, prefills long prompts in chunks, decodes one token per request
per step, retracts requests when decode runs out of pages, and frees requests when they finish. The
model runner writes each step's K/V for every layer with ``pool.set_kv_buffer`` into an FP8 pool
with per-layer, per-tensor float32 scales, as an attention layer would. K/V values are a deterministic
function of (request, position, layer), their range differing from layer to layer and between K and
V, so before a request's slots are freed its K/V is regenerated, quantized with ``kvpool.quantize``
and compared byte for byte with the pool. With ``--model deepseek-v3`` the pool is an
``MLATokenToKVPool`` with DeepSeek-V3's latent rows (512 latent + 64 rotary values per token and
layer), written through both of its entry points, and the check covers the whole latent row. With
``--model qwen3.5`` the model is hybrid, as Qwen3.5: every 4th layer is full attention (its K/V in a
``HybridLinearKVPool``) and the others are Gated DeltaNet layers whose per-request state lives in a
``MambaPool`` slot beside the request's row of a ``HybridReqToTokenPool``; the states are checked
byte for byte too (examples/serve_sim_hybrid.py).

With ``--calibrate`` a calibration pass comes first, on the same pool: the request stream of ``--seed
+ 1`` for ``--calibrate-steps`` steps, written with ``pool.observe_amax(True)``; the run then writes
and checks with ``pool.calibrated_scales()`` instead of the checkpoint's scales, and the summary
compares the quantisation error (relative RMS of the dequantised values against the bf16 input, per
layer, on the run's first requests) with scale 1.0, the checkpoint's scales and the calibrated ones
(examples/serve_sim_calibration.py).

With ``--prefix-cache`` the requests are turns of multi-turn chats after a common few-shot prompt,
served on a prefix cache (``RadixCache``; with ``--host-tier`` a ``HiRadixCache``, with ``--model
qwen3.5`` a ``MambaRadixCache``): each request prefills only what the tree does not hold, and a
token's K/V derive from the token and its prefix rather than the request, so the rows the tree hands
out are checked byte for byte like any others (examples/serve_sim_prefix.py).

    python examples/serve_sim.py                    # GPU (fused kernel) if there is one, else CPU
    python examples/serve_sim.py --model deepseek-v3   # MLA pool, 4 layers of DeepSeek-V3's geometry
    python examples/serve_sim.py --page-size 1      # token allocator
    python examples/serve_sim.py --corrupt          # flip one stored byte: the check must fail
    python examples/serve_sim.py --host-tier        # park retracted requests' KV in host memory
    python examples/serve_sim.py --cpu-park         # ... with pool.get_cpu_copy / load_cpu_copy
    python examples/serve_sim.py --spec-decode 4    # speculative decoding: verify writes + moves
    python examples/serve_sim.py --calibrate        # calibrated per-layer scales, and their error
    python examples/serve_sim.py --model qwen3.5    # hybrid: KV of every 4th layer, state of the others
    python examples/serve_sim.py --prefix-cache     # multi-turn chats on a prefix cache (RadixCache)
    python examples/serve_sim.py --prefix-cache --host-tier   # ... whose evicted nodes live on in host memory

Exit status: 0 when every request's K/V verified and the allocators are consistent, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Optional, Sequence, Union

import torch

from kvpool import MHATokenToKVPool, MLATokenToKVPool, quantize
from kvpool.host import IO_BACKENDS, LAYOUTS, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.pools.req_to_token import ReqToTokenPool
from kvpool.pools.sizing import KVGeometry

DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
# Per-tensor scales as a checkpoint would carry them, for kv_values' base range [-16, 16). K values stay
# in range after the divide; some V values (|x| > 448 * 0.03 = 13.4) saturate, so both the rounding
# and the clamp are exercised. Each layer's scales are multiplied by its power of two below, which
# leaves every stored byte as the base range would store it.
K_SCALE, V_SCALE = 0.04, 0.03
# log2 of each layer's K and V magnitude relative to the base range, cycling over layers. Real models'
# K/V ranges differ from layer to layer and between K and V, and one scale for all (1.0 when a
# checkpoint has none) fits none of them: layer 1's K reaches 1024, past e4m3's 448, and layer 0's V
# stays below 2**-6, where e4m3 at scale 1.0 has only subnormals. Per-layer calibration (--calibrate)
# is for exactly this.
LAYER_LOG2_MAGNITUDE = ((0, -10), (6, -3), (-3, -6), (3, -1))
#: Models whose KV cache is one latent row per token and layer (MLA): (kv_lora_rank, qk_rope_head_dim).
MLA_MODELS = {"deepseek-v3": (512, 64)}
#: The hybrid linear-attention model (its pools, runner and checks: examples/serve_sim_hybrid.py).
HYBRID_MODEL = "qwen3.5"
MODELS = ("mha", *MLA_MODELS, HYBRID_MODEL)
# A latent row is quantized with one scale; V's, so that some values saturate here too (the row's
# values are kv_values' K half, so each layer's latent scale follows K's magnitude).
LATENT_SCALE = V_SCALE
# Admission keeps free pages for this fraction of the running requests' remaining output tokens;
# when the guess is short, decode retracts requests (as SGLang does with its new_token_ratio).
NEW_TOKEN_RATIO = 0.5


@dataclass(frozen=True)
class SimConfig:
    """One simulation run. Lengths are inclusive ranges; arrivals are every ``arrival_every`` steps
    on average (exponential gaps)."""

    requests: int = 64
    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    page_size: int = 16
    kv_budget_mib: float = 4.0
    max_running: int = 16
    chunk_size: int = 256
    prompt_len: tuple[int, int] = (8, 256)
    output_len: tuple[int, int] = (8, 128)
    arrival_every: float = 2.0
    dtype: str = "fp8_e4m3"
    model: str = "mha"  # "mha": heads x head_dim K and V; an MLA_MODELS name: its latent rows
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0
    max_steps: Optional[int] = None
    # Every tensor here is small (a step's tokens), so intra-op threads cost more in hand-offs than
    # they save: on a 2-vCPU CI machine two threads made the CPU run 10-20x slower. None: torch's choice.
    cpu_threads: Optional[int] = 1
    validate: bool = False
    corrupt: bool = False
    progress: bool = False
    # --host-tier: a retracted request's KV goes to a host pool and is loaded back, layer by layer,
    # when it resumes (instead of being recomputed).
    host_tier: bool = False
    host_ratio: float = 2.0
    host_layout: str = "page_first"
    host_io_backend: str = "kernel"
    # --cpu-park: a retracted request's KV goes to host memory with pool.get_cpu_copy and comes back
    # with pool.load_cpu_copy (SGLang's retraction path) instead of being recomputed.
    cpu_park: bool = False
    # --spec-decode K: decode drafts K tokens per request and step, writes the accepted prefix (a
    # random 1..K) with set_kv_buffer_prefix_valid into draft slots laid out in reverse, compacts the
    # accepted tokens into order with move_kv_cache, and frees the rejected slots. 0: plain decode.
    spec_k: int = 0
    # --calibrate: first a calibration pass on the same pool (the request stream of seed + 1, for
    # calibrate_steps steps) with observe_amax on, then this run with pool.calibrated_scales()
    # instead of the checkpoint's scales, and the quantisation error of both (and of scale 1.0).
    calibrate: bool = False
    calibrate_steps: int = 100
    calibrate_per_head: bool = False
    # --prefix-cache: a chat workload (conversations of ``turns`` turns, each turn's prompt the whole
    # conversation so far plus a user message of prompt_len tokens, the first one after a common
    # few-shot prompt of few_shot_len tokens) on a prefix cache (examples/serve_sim_prefix.py);
    # with --host-tier the cache's host tier, backed up by host_write_policy.
    prefix_cache: bool = False
    few_shot_len: int = 256
    turns: tuple[int, int] = (1, 4)
    host_write_policy: str = "write_through"

    def __post_init__(self) -> None:
        for name in ("requests", "layers", "heads", "head_dim", "page_size", "max_running", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if not self.kv_budget_mib > 0:
            raise ValueError(f"kv_budget_mib must be > 0, got {self.kv_budget_mib}")
        if not self.arrival_every >= 0:
            raise ValueError(f"arrival_every must be >= 0, got {self.arrival_every}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be a positive int or None, got {self.cpu_threads}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive int or None, got {self.max_steps}")
        if self.host_layout not in LAYOUTS:
            raise ValueError(f"host_layout must be one of {', '.join(LAYOUTS)}, got {self.host_layout!r}")
        if self.host_io_backend not in IO_BACKENDS:
            raise ValueError(f"host_io_backend must be one of {', '.join(IO_BACKENDS)}, got {self.host_io_backend!r}")
        if self.host_tier and self.cpu_park:
            raise ValueError("host_tier and cpu_park are two ways to park a retracted request: choose one")
        if isinstance(self.spec_k, bool) or not isinstance(self.spec_k, int) or self.spec_k < 0:
            raise ValueError(f"spec_k must be a non-negative int, got {self.spec_k!r}")
        if self.spec_k and self.model not in ("mha", HYBRID_MODEL):
            raise ValueError(f"spec_k needs the MHA pool's set_kv_buffer_prefix_valid, got model {self.model!r}")
        if self.model == HYBRID_MODEL and (self.layers < 4 or self.calibrate):
            raise ValueError(
                f"model {HYBRID_MODEL!r} needs at least 4 layers (every 4th is full attention) and no calibrate, "
                f"got layers={self.layers}, calibrate={self.calibrate}"
            )
        steps = self.calibrate_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"calibrate_steps must be a positive int, got {self.calibrate_steps!r}")
        if self.calibrate and DTYPES[self.dtype] not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"calibrate needs an FP8 dtype (fp8_e4m3 or fp8_e5m2; other pools store no scale), got {self.dtype!r}"
            )
        if self.calibrate_per_head and not self.calibrate:
            raise ValueError(
                "calibrate_per_head (the calibrated scales' shape) needs calibrate=True, got calibrate=False"
            )
        if self.prefix_cache:
            companion("prefix").check_config(self)

    @property
    def max_context_len(self) -> int:
        if self.prefix_cache:  # a conversation's last turn holds every earlier one
            return self.few_shot_len + self.turns[1] * (self.prompt_len[1] + self.output_len[1])
        return self.prompt_len[1] + self.output_len[1]


@dataclass
class Request:
    """A request's progress. Its sequence has ``prompt_len + output_len`` tokens; the K/V of
    positions ``0..kv_len-1`` is in the pool at ``req_to_token[row, :kv_len]``."""

    rid: int
    prompt_len: int
    output_len: int
    arrival: int
    row: Optional[int] = None
    kv_len: int = 0
    generated: int = 0
    prefill_target: int = 0  # kv_len at which (re-)prefill ends and one token is produced

    @property
    def prefilling(self) -> bool:
        return self.kv_len < self.prefill_target

    @property
    def final_kv_len(self) -> int:
        return self.prompt_len + self.output_len - 1  # the last output token's K/V is never written

    def keys(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """What the K/V of positions ``start..end - 1`` derive from besides position and layer: Tensor
        [end - start] int64 below 2**31, here the request id (a prefix-cache workload's requests derive
        it from their tokens, so that equal prefixes hold equal K/V)."""
        return torch.full((end - start,), self.rid, dtype=torch.int64, device=device)


@dataclass
class Batch:
    """One forward step: prefill chunks first, then one decode token per decoding request."""

    prefill: list[tuple[Request, int, int]]  # (request, from position, to position)
    decode: list[Request]
    loc: torch.Tensor  # [T] int64 slots
    rids: torch.Tensor  # [T] int64: each token's key (Request.keys), what its K/V derive from
    positions: torch.Tensor  # [T] int64

    @property
    def prefill_tokens(self) -> int:
        return sum(end - start for _, start, end in self.prefill)


@dataclass
class Mismatch:
    rid: int
    position: int
    layer: int
    which: str  # "K", "V" or "latent"


@dataclass
class SimResult:
    config: SimConfig
    pool_size: int
    bytes_per_token: int
    served: int = 0
    steps: int = 0
    forward_steps: int = 0  # steps that ran a batch (the others waited for arrivals or made room)
    retractions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    peak_slots: int = 0
    peak_running: int = 0
    verified_requests: int = 0
    verified_tokens: int = 0
    mismatched_tokens: int = 0
    first_mismatch: Optional[Mismatch] = None
    integrity_error: Optional[str] = None
    leaked_slots: int = 0
    fused_calls: int = 0
    reference_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    device: str = ""
    # --host-tier
    parked: int = 0  # retractions whose KV went to the host tier
    reloaded: int = 0
    host_full: int = 0  # retractions recomputed because the host tier had no room
    host_bytes: int = 0  # backed up + loaded
    host_seconds: float = 0.0
    reloaded_tokens: int = 0
    reload_mismatches: int = 0
    # --cpu-park (parked/reloaded/reloaded_tokens/reload_mismatches above count these too)
    cpu_bytes: int = 0
    # --spec-decode
    spec_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    moved_slots: int = 0
    # --calibrate
    calibration: Optional["serve_sim_calibration.Calibration"] = None
    # --model qwen3.5: requests whose linear layers' states were checked, and those that differed
    state_checked: int = 0
    state_mismatches: int = 0
    # --prefix-cache: hits, savings and evictions
    prefix: Optional["serve_sim_prefix.PrefixStats"] = None

    @property
    def ok(self) -> bool:
        return (
            self.mismatched_tokens == 0 and self.integrity_error is None and self.leaked_slots == 0
            and self.reload_mismatches == 0 and self.state_mismatches == 0
            and (self.calibration is None or self.calibration.result.ok)
        )  # fmt: skip


# --- K/V values the "model" produces ------------------------------------------------------------

_M31 = 2_147_483_647  # integer hashing modulo a prime keeps every intermediate below 2**62


def layer_magnitude(layer: int) -> tuple[float, float]:
    """The powers of two that ``layer``'s K and V values (and their checkpoint scales) are scaled by."""
    k_log2, v_log2 = LAYER_LOG2_MAGNITUDE[layer % len(LAYER_LOG2_MAGNITUDE)]
    return 2.0**k_log2, 2.0**v_log2


def kv_values(rids: torch.Tensor, positions: torch.Tensor, layer: int, heads: int, head_dim: int) -> torch.Tensor:
    """K and V of tokens (rid, position) at ``layer``: Tensor [T, 2, heads, head_dim] bfloat16.

    Pure integer arithmetic, then multiples of 1/256 in [-16, 16) times the layer's power of two
    (``layer_magnitude``; exact, so rounding to bfloat16 commutes with it), so the same values come
    out on every device and for any batch shape; the check regenerates them.
    """
    lanes = torch.arange(2 * heads * head_dim, dtype=torch.int64, device=rids.device)
    key = (rids * 65_537 + positions) * 131 + layer
    h = (key[:, None] * 4_099 + lanes) % _M31
    for _ in range(2):
        h = (h * 48_271) % _M31
        h = h ^ (h >> 11)
    values = ((h % 8_192) - 4_096).to(torch.float32).view(-1, 2, heads * head_dim)
    k_mag, v_mag = layer_magnitude(layer)
    magnitude = torch.tensor([k_mag / 256.0, v_mag / 256.0], dtype=torch.float32, device=rids.device)
    return (values * magnitude[:, None]).to(torch.bfloat16).view(-1, 2, heads, head_dim)


Scales = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_scale, v_scale), float32 on the pool's device


def checkpoint_scales(layers: int, device: torch.device, mla: bool = False) -> Scales:
    """The scales a checkpoint would carry, per layer: K_SCALE and V_SCALE (an MLA row: LATENT_SCALE,
    as (s, s)) times the layer's magnitude."""
    out = []
    for layer in range(layers):
        k_mag, v_mag = layer_magnitude(layer)
        k, v = (LATENT_SCALE * k_mag, LATENT_SCALE * k_mag) if mla else (K_SCALE * k_mag, V_SCALE * v_mag)
        out.append(tuple(torch.tensor([s], dtype=torch.float32, device=device) for s in (k, v)))
    return out  # type: ignore[return-value]


# --- the scheduler --------------------------------------------------------------------------------


class Scheduler:
    """Admission, slot allocation, retraction and freeing, in the shape of SGLang's scheduler."""

    def __init__(self, cfg: SimConfig, pool: MHATokenToKVPool) -> None:
        self.cfg = cfg
        self.device = pool.device
        self.page_size = cfg.page_size
        self.allocator: Union[TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator]
        if cfg.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(pool.size, pool.dtype, self.device, pool, validate=cfg.validate)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                pool.size, cfg.page_size, pool.dtype, self.device, pool, validate=cfg.validate
            )
        self.capacity = self.allocator.available_size()
        self.table = ReqToTokenPool(cfg.max_running, cfg.max_context_len, self.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retractions = 0
        self.host: Optional[Union["HostParking", "CpuParking"]] = None  # --host-tier / --cpu-park

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def decode_reserve(self, r: Request, kv_len: int) -> int:
        """Pages request ``r`` is expected to add while decoding from ``kv_len`` tokens: a fraction
        of its remaining output (SGLang's new_token_ratio idea)."""
        expected = math.ceil(NEW_TOKEN_RATIO * (r.output_len - r.generated))
        return self.pages_for(kv_len + expected) - self.pages_for(kv_len)

    def schedule(self, with_decode: bool = True) -> Optional[Batch]:
        """Pick this step's work, reserve its slots and record them in the request table
        (``with_decode=False``: prefill only; --spec-decode decodes separately)."""
        decode = self._schedule_decode() if with_decode else []
        prefill = self._schedule_prefill(decode)
        if not prefill and not decode:
            return None
        loc = torch.cat((self._alloc_prefill(prefill), self._alloc_decode(decode)))
        segments = prefill + [(r, r.kv_len, r.kv_len + 1) for r in decode]
        starts = torch.tensor([s for _, s, _ in segments], dtype=torch.int64, device=self.device)
        counts = torch.tensor([e - s for _, s, e in segments], dtype=torch.int64, device=self.device)
        keys = torch.cat([r.keys(s, e, self.device) for r, s, e in segments])
        rows = torch.tensor([r.row for r, _, _ in segments], dtype=torch.int64, device=self.device)
        tokens = loc.shape[0]

        def per_token(per_segment: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(per_segment, counts, output_size=tokens)

        offsets = torch.arange(tokens, device=self.device) - per_token(torch.cumsum(counts, 0) - counts)
        positions = per_token(starts) + offsets
        self.table.write((per_token(rows), positions), loc.to(torch.int32))
        return Batch(prefill, decode, loc, keys, positions)

    def _schedule_decode(self) -> list[Request]:
        """Decoding requests, minus those retracted to make room for the rest (newest first)."""
        decode = [r for r in self.running if not r.prefilling]
        while decode:
            need = sum(1 for r in decode if r.kv_len % self.page_size == 0)
            if need * self.page_size <= self.room():
                return decode
            self.retract(decode.pop())
        return decode

    def _schedule_prefill(self, decode: list[Request]) -> list[tuple[Request, int, int]]:
        """Continue chunked prefills, then admit waiting requests, within the token budget and the
        free pages, keeping pages back for the running requests' expected decode."""
        budget = self.cfg.chunk_size
        free_pages = self.room() // self.page_size
        free_pages -= sum(1 for r in decode if r.kv_len % self.page_size == 0)
        plan: list[tuple[Request, int, int]] = []
        for r in [r for r in self.running if r.prefilling]:
            end = min(r.prefill_target, r.kv_len + budget)
            pages = self.pages_for(end) - self.pages_for(r.kv_len)
            if end > r.kv_len and pages <= free_pages:
                plan.append((r, r.kv_len, end))
                budget -= end - r.kv_len
                free_pages -= pages
        reserved = sum(self.decode_reserve(r, max(r.kv_len, r.prefill_target)) for r in self.running)
        while self.waiting and budget > 0:
            r = self.waiting[0]
            admitted = self.admit(r, budget, free_pages - reserved)
            if admitted is None:
                break
            start, end, pages = admitted
            self.waiting.popleft()
            self.running.append(r)
            plan.append((r, start, end))
            budget -= end - start
            free_pages -= pages
            reserved += self.decode_reserve(r, r.prefill_target)
        return plan

    def admit(self, r: Request, budget: int, pages: int) -> Optional[tuple[int, int, int]]:
        """Give waiting request ``r`` a table row if its first chunk (at most ``budget`` tokens) fits
        in ``pages`` free pages: returns (its first position to compute, the chunk's end, the pages
        the admission takes from the free ones), or None with nothing changed. A retracted request
        re-prefills its outputs too; with --host-tier its parked positions are reloaded instead."""
        if self.table.available_size() == 0:
            return None
        target = r.prompt_len + r.generated
        start = self.host.parked_len(r) if self.host is not None else 0
        end = min(target, start + budget)
        if self.pages_for(end) > pages:
            return None
        r.row = self.table.alloc(1)[0]  # type: ignore[index]
        r.prefill_target = target
        if start:
            self._resume(r, start)
        return start, end, self.pages_for(end)

    def room(self) -> int:
        """Slots a step may take: the allocator's free ones (a prefix cache adds what it can evict)."""
        return self.allocator.available_size()

    def _alloc_prefill(self, plan: list[tuple[Request, int, int]]) -> torch.Tensor:
        total = sum(end - start for _, start, end in plan)
        if isinstance(self.allocator, TokenToKVPoolAllocator):
            out = self.allocator.alloc(total)
        else:
            prefix = torch.tensor([s for _, s, _ in plan], dtype=torch.int64)
            seq = torch.tensor([e for _, _, e in plan], dtype=torch.int64)
            last_loc = self._last_loc([r for r, _, _ in plan], prefix)
            out = self.allocator.alloc_extend(
                prefix.to(self.device), prefix, seq.to(self.device), seq, last_loc, total
            )
        if out is None:  # the plan was sized from available_size(), so this is a bug
            raise RuntimeError(f"allocator refused a prefill of {total} tokens it said it had room for")
        return out

    def _alloc_decode(self, decode: list[Request]) -> torch.Tensor:
        if isinstance(self.allocator, TokenToKVPoolAllocator):
            out = self.allocator.alloc(len(decode))
        else:
            held = torch.tensor([r.kv_len for r in decode], dtype=torch.int64)
            out = self.allocator.alloc_decode((held + 1).to(self.device), held + 1, self._last_loc(decode, held))
        if out is None:
            raise RuntimeError(f"allocator refused {len(decode)} decode slots it said it had room for")
        return out

    def _last_loc(self, requests: list[Request], held: torch.Tensor) -> torch.Tensor:
        """Slot of each request's last token in the pool (-1 if it holds none), from the table."""
        rows = torch.tensor([r.row for r in requests], dtype=torch.int64, device=self.device)
        held = held.to(self.device)
        last = self.table.req_to_token[rows, (held - 1).clamp(min=0)].to(torch.int64)
        return torch.where(held > 0, last, torch.full_like(last, -1))

    def advance(self, batch: Batch) -> None:
        """Record what the forward step produced."""
        for r, _, end in batch.prefill:
            r.kv_len = end
            if not r.prefilling:
                r.generated += 1  # the prefill's last position yields the next token
        for r in batch.decode:
            r.kv_len += 1
            r.generated += 1

    def finished(self) -> list[Request]:
        return [r for r in self.running if not r.prefilling and r.generated >= r.output_len]

    def slots_of(self, r: Request) -> torch.Tensor:
        return self.table.req_to_token[r.row, : r.kv_len].to(torch.int64)

    def release(self, r: Request) -> None:
        self.allocator.free(self.slots_of(r))
        self.table.free(r.row)  # type: ignore[arg-type]
        self.running.remove(r)
        r.row = None

    def retract(self, r: Request) -> None:
        """Give back a request's slots and queue it again; it re-prefills prompt + outputs so far
        (with --host-tier its KV is parked in host memory first and loaded back when it resumes)."""
        if self.host is not None:
            self.host.park(r, self.slots_of(r))
        self.release(r)
        r.kv_len = 0
        self.waiting.appendleft(r)
        self.retractions += 1

    def slots_in_use(self) -> int:
        return self.capacity - self.allocator.available_size()

    def check_integrity(self) -> None:
        """The allocator's and the request table's own checks (``IntegrityError``)."""
        self.allocator.check_integrity()
        self.table.check_integrity()

    def leaked_slots(self) -> int:
        """Slots still held once no request runs."""
        return self.slots_in_use()

    def _resume(self, r: Request, parked: int) -> None:
        """--host-tier: slots for a parked request's first ``parked`` positions, recorded in the
        request table and filled from the host tier (its prefill then continues from there)."""
        slots = self._alloc_prefill([(r, 0, parked)])
        rows = torch.full((parked,), r.row, dtype=torch.int64, device=self.device)  # type: ignore[arg-type]
        self.table.write((rows, torch.arange(parked, device=self.device)), slots.to(torch.int32))
        self.host.resume(r, slots)  # type: ignore[union-attr]
        r.kv_len = parked


# --- the model runner -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    layer_id: int


class ModelRunner:
    """Writes each layer's K/V for a batch, as every attention layer's ``forward`` would, with the
    layer's ``scales`` (default: ``checkpoint_scales``)."""

    def __init__(self, cfg: SimConfig, pool: MHATokenToKVPool, scales: Optional[Scales] = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.layers = [Layer(i) for i in range(cfg.layers)]
        if scales is None:
            scales = checkpoint_scales(cfg.layers, pool.device, mla=isinstance(pool, MLATokenToKVPool))
        if len(scales) != cfg.layers:
            raise ValueError(f"scales must have one (k_scale, v_scale) per layer ({cfg.layers}), got {len(scales)}")
        self.scales = scales

    def forward(self, batch: Batch) -> None:
        for layer in self.layers:
            kv = kv_values(batch.rids, batch.positions, layer.layer_id, self.cfg.heads, self.cfg.head_dim)
            k_scale, v_scale = self.scales[layer.layer_id]
            # K and V are strided views of one projection output, as with a fused QKV matmul.
            self.pool.set_kv_buffer(layer, batch.loc, kv[:, 0], kv[:, 1], k_scale, v_scale)

    def parts(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> list[tuple[str, torch.Tensor]]:
        """What a write of ``layer`` stores for tokens (rid, position): (name, values) for K and V,
        quantised with the layer's k_scale and v_scale in that order."""
        kv = kv_values(rids, positions, layer, self.cfg.heads, self.cfg.head_dim)
        return [("K", kv[:, 0]), ("V", kv[:, 1])]

    def verify(self, r: Request, slots: torch.Tensor, start: int = 0) -> tuple[int, Optional[Mismatch]]:
        """Tokens of ``r`` whose stored K or V differs from what was written, and the first one;
        ``slots`` hold its positions ``start..``."""
        n = slots.shape[0]
        rids = r.keys(start, start + n, self.pool.device)
        positions = torch.arange(start, start + n, dtype=torch.int64, device=self.pool.device)
        bad_any = torch.zeros(n, dtype=torch.bool, device=self.pool.device)
        first: Optional[Mismatch] = None
        for layer in self.layers:
            kv = kv_values(rids, positions, layer.layer_id, self.cfg.heads, self.cfg.head_dim)
            k_buf, v_buf = self.pool.get_kv_buffer(layer.layer_id)
            k_scale, v_scale = self.scales[layer.layer_id]
            for which, x, buf, scale in (("K", kv[:, 0], k_buf, k_scale), ("V", kv[:, 1], v_buf, v_scale)):
                expected = quantize(x, self.pool.dtype, scale).contiguous().view(torch.uint8)
                stored = buf.view(torch.uint8)[slots]
                bad = (stored != expected).flatten(1).any(dim=1)
                if first is None and bool(bad.any()):
                    first = Mismatch(r.rid, start + int(bad.nonzero()[0]), layer.layer_id, which)
                bad_any |= bad
        return int(bad_any.sum()), first


class MLAModelRunner(ModelRunner):
    """Writes each layer's latent rows as an MLA attention layer would: the latent and rotary parts
    (two column ranges of one projection output) through ``set_mla_kv_buffer`` on even layers, the
    whole row through ``set_kv_buffer`` on odd ones, so both entry points serve every run."""

    def __init__(self, cfg: SimConfig, pool: MLATokenToKVPool, scales: Optional[Scales] = None) -> None:
        super().__init__(cfg, pool, scales)  # type: ignore[arg-type]
        self.pool: MLATokenToKVPool = pool

    def latent(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """The latent rows of tokens (rid, position) at ``layer``: [T, 1, kv_cache_dim] bfloat16."""
        return kv_values(rids, positions, layer, 1, self.pool.kv_cache_dim)[:, 0]

    def parts(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> list[tuple[str, torch.Tensor]]:
        return [("latent", self.latent(rids, positions, layer))]

    def forward(self, batch: Batch) -> None:
        r = self.pool.kv_lora_rank
        for layer in self.layers:
            row = self.latent(batch.rids, batch.positions, layer.layer_id)
            scale = self.scales[layer.layer_id][0]  # one scale per row: the pair's k_scale
            if layer.layer_id % 2 == 0:
                self.pool.set_mla_kv_buffer(layer, batch.loc, row[:, :, :r], row[:, :, r:], scale)
            else:
                self.pool.set_kv_buffer(layer, batch.loc, row, None, scale)

    def verify(self, r: Request, slots: torch.Tensor, start: int = 0) -> tuple[int, Optional[Mismatch]]:
        """Tokens of ``r`` whose stored latent row differs from what was written, and the first one;
        ``slots`` hold its positions ``start..``."""
        n = slots.shape[0]
        rids = r.keys(start, start + n, self.pool.device)
        positions = torch.arange(start, start + n, dtype=torch.int64, device=self.pool.device)
        bad_any = torch.zeros(n, dtype=torch.bool, device=self.pool.device)
        first: Optional[Mismatch] = None
        for layer in self.layers:
            row = self.latent(rids, positions, layer.layer_id)
            expected = quantize(row, self.pool.dtype, self.scales[layer.layer_id][0]).contiguous().view(torch.uint8)
            stored = self.pool.get_key_buffer(layer.layer_id).view(torch.uint8)[slots]
            bad = (stored != expected).flatten(1).any(dim=1)
            if first is None and bool(bad.any()):
                first = Mismatch(r.rid, start + int(bad.nonzero()[0]), layer.layer_id, "latent")
            bad_any |= bad
        return int(bad_any.sum()), first


# --- --host-tier: parking retracted requests in host memory ---------------------------------------


class HostParking:
    """Retracted requests' K/V in an ``MHATokenToKVPoolHost``: all layers are backed up when the
    request is retracted, and loaded back layer by layer (the pool's getters wait for each layer's
    event) when it resumes; the reloaded rows are then checked byte for byte. A request whose KV does
    not fit in the host tier is recomputed as without it.

    On CUDA the transfers run on the host pool's streams; this simulation synchronises around each
    one only to time it (the library itself never does)."""

    def __init__(self, cfg: SimConfig, pool: MHATokenToKVPool, runner: "ModelRunner", result: SimResult) -> None:
        self.cfg, self.pool, self.runner, self.result = cfg, pool, runner, result
        host_cls = MLATokenToKVPoolHost if isinstance(pool, MLATokenToKVPool) else MHATokenToKVPoolHost
        self.host = host_cls(pool, cfg.host_ratio, 0, cfg.page_size, cfg.host_layout, validate=cfg.validate)
        pool.register_layer_transfer_counter(self.host.layer_transfer_counter)
        self.bytes_per_token = self.host.size_per_token
        self.parked: dict[int, tuple[torch.Tensor, int]] = {}  # rid -> (host slots, tokens)

    def parked_len(self, r: Request) -> int:
        entry = self.parked.get(r.rid)
        return 0 if entry is None else entry[1]

    def _padded(self, slots: torch.Tensor, n: int) -> torch.Tensor:
        # Host transfers move whole pages; positions past the request's tokens are padding (-1).
        pad = torch.full((n - slots.shape[0],), -1, dtype=slots.dtype, device=slots.device)
        return torch.cat((slots, pad))

    def _timed(self, fn) -> None:
        cuda = self.pool.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.pool.device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(self.pool.device)
        self.result.host_seconds += time.perf_counter() - start

    def park(self, r: Request, slots: torch.Tensor) -> None:
        n = slots.shape[0]
        if n == 0:
            return
        host_slots = self.host.alloc(-(-n // self.host.page_size) * self.host.page_size)
        if host_slots is None:
            self.result.host_full += 1
            return
        device = self._padded(slots, host_slots.shape[0])
        backend = self.cfg.host_io_backend
        self._timed(lambda: self.host.backup_from_device_all_layer(self.pool, host_slots, device, backend))
        self.host.wait_for_backups()  # the slots are freed next: later writes wait for the backup
        self.parked[r.rid] = (host_slots, n)
        self.result.parked += 1
        self.result.host_bytes += n * self.bytes_per_token

    def resume(self, r: Request, slots: torch.Tensor) -> None:
        host_slots, n = self.parked.pop(r.rid)
        device = self._padded(slots, host_slots.shape[0])
        backend = self.cfg.host_io_backend
        self._timed(lambda: self.host.load_to_device_all_layer(self.pool, host_slots, device, backend))
        self.host.free(host_slots)  # a later backup into these pages waits for this load
        self.result.reloaded += 1
        self.result.reloaded_tokens += n
        self.result.host_bytes += n * self.bytes_per_token
        bad, _ = self.runner.verify(r, slots)  # reads through the getters: waits for each layer
        self.result.reload_mismatches += bad


# --- --cpu-park: parking retracted requests with get_cpu_copy / load_cpu_copy ----------------------


class CpuParking:
    """Retracted requests' K/V copied to host memory with ``pool.get_cpu_copy`` (all layers, exact
    bytes) and written back into the request's new slots with ``pool.load_cpu_copy`` when it resumes,
    as SGLang parks a retracted request; the reloaded rows are then checked byte for byte."""

    def __init__(self, pool: MHATokenToKVPool, runner: "ModelRunner", result: SimResult) -> None:
        self.pool, self.runner, self.result = pool, runner, result
        self.parked: dict[int, tuple[object, int]] = {}  # rid -> (KVCpuCopy, tokens)

    def parked_len(self, r: Request) -> int:
        entry = self.parked.get(r.rid)
        return 0 if entry is None else entry[1]

    def _bytes(self, copy: object) -> int:
        return sum(t.numel() * t.element_size() for t in (copy.k, copy.v))  # type: ignore[attr-defined]

    def park(self, r: Request, slots: torch.Tensor) -> None:
        if slots.shape[0] == 0:
            return
        copy = self.pool.get_cpu_copy(slots)
        self.parked[r.rid] = (copy, slots.shape[0])
        self.result.parked += 1
        self.result.cpu_bytes += self._bytes(copy)

    def resume(self, r: Request, slots: torch.Tensor) -> None:
        copy, n = self.parked.pop(r.rid)
        self.pool.load_cpu_copy(copy, slots)
        self.result.reloaded += 1
        self.result.reloaded_tokens += n
        self.result.cpu_bytes += self._bytes(copy)
        bad, _ = self.runner.verify(r, slots)
        self.result.reload_mismatches += bad


# --- --spec-decode: speculative decoding's verify write and compaction --------------------------


class SpecDecode:
    """Each step, every decoding request drafts K tokens (positions kv_len .. kv_len + K - 1) into K
    fresh slots, of which a random prefix of 1..K is accepted (never more than the request still
    produces). The drafts are laid out in reverse slot order (as a tree-shaped draft scatters them),
    the verify write stores only the accepted prefix with ``set_kv_buffer_prefix_valid``, and
    ``move_kv_cache`` then compacts the accepted tokens into position order (sources and targets
    overlap: the move must read every source before writing). Rejected slots are freed."""

    def __init__(self, cfg: SimConfig, sched: "Scheduler", runner: "ModelRunner", result: SimResult) -> None:
        self.cfg, self.sched, self.runner, self.result = cfg, sched, runner, result
        self.rng = random.Random(cfg.seed + 1)

    def step(self) -> int:
        """Decode every decoding request by its accepted drafts; returns the tokens accepted."""
        sched, k = self.sched, self.cfg.spec_k
        decode = [r for r in sched.running if not r.prefilling]
        while decode:  # every request needs room for all K drafts
            pages = sum(sched.pages_for(r.kv_len + k) - sched.pages_for(r.kv_len) for r in decode)
            if pages * sched.page_size <= sched.allocator.available_size():
                break
            sched.retract(decode.pop())
        if not decode:
            return 0
        bs, dev = len(decode), sched.device
        slots = sched._alloc_prefill([(r, r.kv_len, r.kv_len + k) for r in decode]).view(bs, k)
        start = torch.tensor([r.kv_len for r in decode], dtype=torch.int64, device=dev)
        positions = start[:, None] + torch.arange(k, device=dev)
        rows = torch.tensor([r.row for r in decode], dtype=torch.int64, device=dev)
        sched.table.write((rows[:, None].expand(bs, k).reshape(-1), positions.reshape(-1)), slots.reshape(-1).to(torch.int32))
        accepted = [min(self.rng.randint(1, k), r.output_len - r.generated) for r in decode]
        commit = torch.tensor(accepted, dtype=torch.int32, device=dev)
        drafts = slots.flip(1)  # draft j of request i sits in slot slots[i, k - 1 - j]
        rids = torch.stack([r.keys(r.kv_len, r.kv_len + k, dev) for r in decode])
        runner = self.runner
        for layer in runner.layers:
            kv = kv_values(rids.reshape(-1), positions.reshape(-1), layer.layer_id, self.cfg.heads, self.cfg.head_dim)
            k_scale, v_scale = runner.scales[layer.layer_id]
            runner.pool.set_kv_buffer_prefix_valid(layer, drafts, commit, kv[:, 0], kv[:, 1], k_scale, v_scale)
        # Accepted draft j moves from drafts[i, j] to slots[i, j], its position's slot in the table.
        keep = torch.arange(k, device=dev)[None, :] < commit[:, None]
        runner.pool.move_kv_cache(slots[keep], drafts[keep])
        sched.allocator.free(slots[~keep])
        self.after_verify(decode, accepted)
        for r, a in zip(decode, accepted):
            r.kv_len += a
            r.generated += a
        total = sum(accepted)
        self.result.spec_steps += 1
        self.result.drafted_tokens += bs * k
        self.result.accepted_tokens += total
        self.result.moved_slots += total
        return total

    def after_verify(self, decode: list[Request], accepted: list[int]) -> None:
        """What else a verify step keeps, before the requests advance (a hybrid model's states)."""


# --- the loop -------------------------------------------------------------------------------------


class Checker:
    """Verifies requests against what was written and tallies the outcome in a ``SimResult``.

    With ``corrupt``, it first flips one stored byte of the first request it checks (its V, last
    layer, middle token), as a stray write would, to show that the check fails.
    """

    def __init__(self, runner: ModelRunner, result: SimResult, corrupt: bool) -> None:
        self.runner, self.result, self.corrupt_pending = runner, result, corrupt

    def check(self, r: Request, slots: torch.Tensor) -> None:
        if self.corrupt_pending and slots.numel():
            last_layer = self.runner.layers[-1].layer_id
            buf = self.runner.pool.get_value_buffer(last_layer).view(torch.uint8)
            buf[slots[slots.numel() // 2], 0, 0] ^= 0x5A
            self.corrupt_pending = False
        bad, first = self.runner.verify(r, slots)
        res = self.result
        res.verified_requests += 1
        res.verified_tokens += slots.numel()
        res.mismatched_tokens += bad
        if res.first_mismatch is None:
            res.first_mismatch = first


def make_requests(cfg: SimConfig) -> list[Request]:
    rng = random.Random(cfg.seed)
    out, t = [], 0.0
    for rid in range(cfg.requests):
        out.append(Request(rid, rng.randint(*cfg.prompt_len), rng.randint(*cfg.output_len), int(t)))
        t += rng.expovariate(1.0 / cfg.arrival_every) if cfg.arrival_every > 0 else 0.0
    return out


class Arrivals:
    """The request stream in arrival order. A workload whose requests follow others' answers (a
    chat's next turn, serve_sim_prefix.py) queues them when those finish."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.queue = deque(requests)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def due(self, step: int) -> list[Request]:
        """The requests that have arrived by ``step``, taken from the stream."""
        out = []
        while self.queue and self.queue[0].arrival <= step:
            out.append(self.queue.popleft())
        return out

    def next_arrival(self) -> int:
        return self.queue[0].arrival

    def finished(self, r: Request, step: int) -> None:
        """``r`` finished at ``step`` (no request follows it here)."""


@dataclass(frozen=True)
class Parts:
    """What a run is made of; a model with more to keep than K/V swaps some (serve_sim_hybrid.py),
    and so does a prefix-cache run (serve_sim_prefix.py)."""

    scheduler: Callable[..., Scheduler] = Scheduler
    host_parking: Callable[..., Optional[HostParking]] = HostParking
    cpu_parking: Callable[..., CpuParking] = CpuParking
    spec: Callable[..., SpecDecode] = SpecDecode
    checker: Callable[..., Checker] = Checker
    arrivals: Callable[[SimConfig], Arrivals] = lambda cfg: Arrivals(make_requests(cfg))


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.last = total, enabled, 0.0
        self.start = time.perf_counter()

    def update(self, done: int, step: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < 0.1):
            return
        self.last = now
        width = 30
        filled = width * done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\rserve_sim [{bar}] {done}/{self.total} requests, step {step}, {now - self.start:.1f} s")
        sys.stderr.flush()

    def close(self, done: int, step: int) -> None:
        if self.enabled:
            self.update(done, step, force=True)
            sys.stderr.write("\n")


def run(cfg: SimConfig) -> SimResult:
    """Run the simulation and return what happened; ``result.ok`` says whether every check passed."""
    threads = torch.get_num_threads()
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def companion(name: str) -> ModuleType:
    """``examples/serve_sim_<name>.py``: a part of the simulation that builds on this module's classes
    (each of its functions takes this module), imported when a run needs it."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(f"serve_sim_{name}")


def make_pool(cfg: SimConfig) -> tuple[Union[MHATokenToKVPool, MLATokenToKVPool], KVGeometry]:
    """The run's pool (MHA, or MLA for an ``MLA_MODELS`` name), as large as ``kv_budget_mib`` allows.

    Raises
    ------
    ValueError
        If the budget does not hold the longest request plus a page.
    """
    dtype = DTYPES[cfg.dtype]
    mla = MLA_MODELS.get(cfg.model)
    if mla is None:
        geometry = KVGeometry(cfg.heads, cfg.head_dim, cfg.layers, dtype)
    else:
        geometry = KVGeometry.mla(*mla, cfg.layers, dtype)
    size = geometry.max_pool_size(int(cfg.kv_budget_mib * 2**20), cfg.page_size)
    longest = cfg.max_context_len
    if -(-longest // cfg.page_size) + 1 > size // cfg.page_size:
        raise ValueError(
            f"kv_budget_mib must hold the longest request ({longest} tokens) plus a page, "
            f"got {cfg.kv_budget_mib} MiB = {size} slots"
        )
    if mla is None:
        return MHATokenToKVPool(size, cfg.page_size, dtype, cfg.heads, cfg.head_dim, cfg.layers, cfg.device), geometry
    return MLATokenToKVPool(size, cfg.page_size, dtype, *mla, cfg.layers, cfg.device), geometry


def _run(cfg: SimConfig) -> SimResult:
    sim = sys.modules[__name__]
    if cfg.prefix_cache:
        return companion("prefix").run(cfg, sim)
    if cfg.model == HYBRID_MODEL:
        return companion("hybrid").run(cfg, sim)
    pool, geometry = make_pool(cfg)
    calibration = companion("calibration").calibrate(cfg, pool, geometry.bytes_per_token, sim) if cfg.calibrate else None
    runner = make_runner(cfg, pool, None if calibration is None else calibration.scales)
    result = SimResult(cfg, pool.size, geometry.bytes_per_token, device=str(pool.device), calibration=calibration)
    _simulate(cfg, pool, runner, result)
    if calibration is not None:
        checkpoint = checkpoint_scales(cfg.layers, torch.device("cpu"), mla=isinstance(pool, MLATokenToKVPool))
        calibration.errors, calibration.sample_requests, calibration.sample_tokens = companion(
            "calibration"
        ).quantisation_errors(runner, checkpoint, calibration.amax, sim)
    return result


def make_runner(cfg: SimConfig, pool: MHATokenToKVPool, scales: Optional[Scales] = None) -> ModelRunner:
    if isinstance(pool, MLATokenToKVPool):
        return MLAModelRunner(cfg, pool, scales)
    return ModelRunner(cfg, pool, scales)


def _simulate(
    cfg: SimConfig, pool: MHATokenToKVPool, runner: ModelRunner, result: SimResult, parts: Parts = Parts()
) -> None:
    """The scheduler loop over ``cfg``'s request stream on ``pool``, tallied in ``result``."""
    stats_before = (pool.stats.fused_calls, pool.stats.reference_calls, dict(pool.stats.reasons))
    sched = parts.scheduler(cfg, pool)
    arrivals = parts.arrivals(cfg)
    progress = Progress(cfg.requests, cfg.progress)
    checker = parts.checker(runner, result, corrupt=cfg.corrupt)
    if cfg.host_tier:
        sched.host = parts.host_parking(cfg, pool, runner, result)
    elif cfg.cpu_park:
        sched.host = parts.cpu_parking(pool, runner, result)
    spec = parts.spec(cfg, sched, runner, result) if cfg.spec_k else None

    start = time.perf_counter()
    step = 0
    while arrivals or sched.waiting or sched.running:
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        sched.waiting.extend(arrivals.due(step))
        accepted = spec.step() if spec is not None else 0
        batch = sched.schedule(with_decode=spec is None)
        step += 1
        if batch is None and not accepted:
            if sched.running:  # every running request waits for pages: make room
                sched.retract(sched.running[-1])
            elif not sched.waiting and arrivals:  # idle until the next arrival
                step = max(step, arrivals.next_arrival())
            continue
        result.peak_slots = max(result.peak_slots, sched.slots_in_use())
        result.peak_running = max(result.peak_running, len(sched.running))
        result.decode_tokens += accepted
        if batch is not None:
            runner.forward(batch)
            result.prefill_tokens += batch.prefill_tokens
            result.decode_tokens += len(batch.decode)
            sched.advance(batch)
        result.forward_steps += 1

        finished = sched.finished()
        sched.allocator.free_group_begin()  # as SGLang frees a step's finished requests together
        for r in finished:
            checker.check(r, sched.slots_of(r))  # before the slots can be handed out again
            sched.release(r)
            arrivals.finished(r, step)
        sched.allocator.free_group_end()
        result.served += len(finished)
        progress.update(result.served, step)
    progress.close(result.served, step)

    for r in sched.running:  # stopped by --max-steps: check what is still live
        checker.check(r, sched.slots_of(r))
    result.wall_s = time.perf_counter() - start
    result.steps = step
    result.retractions = sched.retractions
    # The pool's statistics also count a calibration pass's writes on the same pool.
    fused, reference, reasons = stats_before
    result.fused_calls = pool.stats.fused_calls - fused
    result.reference_calls = pool.stats.reference_calls - reference
    result.reasons = {k: n - reasons.get(k, 0) for k, n in pool.stats.reasons.items() if n > reasons.get(k, 0)}
    try:
        sched.check_integrity()
    except RuntimeError as e:
        result.integrity_error = str(e)
    if not sched.running:
        result.leaked_slots = sched.leaked_slots()


def format_summary(res: SimResult) -> str:
    cfg = res.config
    allocator = "TokenToKVPoolAllocator"
    if cfg.page_size > 1:
        allocator = f"PagedTokenToKVPoolAllocator(page_size={cfg.page_size})"
    written = res.prefill_tokens + res.decode_tokens
    if cfg.model in MLA_MODELS:
        rank, rope = MLA_MODELS[cfg.model]
        shape, parts = f"{cfg.model} MLA latent rows ({rank} + {rope})", "latent"
    elif cfg.model == HYBRID_MODEL:
        full = cfg.layers // 4
        shape = f"{cfg.heads} KV heads x {cfg.head_dim} ({full} full-attention, {cfg.layers - full} linear)"
        parts = "K,V"
    else:
        shape, parts = f"{cfg.heads} KV heads x {cfg.head_dim}", "K,V"
    kv_layers = cfg.layers // 4 if cfg.model == HYBRID_MODEL else cfg.layers  # the layers that keep K/V
    lines = [
        f"kvpool serve_sim: {cfg.requests} requests, {cfg.layers} layers x {shape}, "
        f"{DTYPES[cfg.dtype]} pool on {res.device}, {allocator}, seed {cfg.seed}",
        f"  pool            {res.pool_size} slots ({res.bytes_per_token} B/token, {cfg.kv_budget_mib:g} MiB budget), "
        f"{cfg.max_running} request rows",
        f"  served          {res.served}/{cfg.requests} requests in {res.steps} steps "
        f"({res.retractions} retractions, peak {res.peak_running} running)",
        f"  tokens written  {written} ({res.prefill_tokens} prefill + {res.decode_tokens} decode) "
        f"x {kv_layers} layers x {parts}",
        f"  peak slot use   {res.peak_slots}/{res.pool_size} ({100.0 * res.peak_slots / res.pool_size:.1f}%)",
        f"  write path      fused {res.fused_calls} calls, reference {res.reference_calls} calls",
    ]
    for reason, count in sorted(res.reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"                  reference because {reason} ({count} calls)")
    rate = written / res.wall_s if res.wall_s > 0 else float("inf")
    lines.append(f"  wall time       {res.wall_s:.2f} s ({rate:,.0f} tokens/s)")
    check = (
        f"{res.verified_requests} requests, {res.verified_tokens} tokens x {kv_layers} layers x {parts} "
        f"byte-equal to kvpool.quantize"
    )
    if res.mismatched_tokens:
        m = res.first_mismatch
        where = f"; first: request {m.rid} position {m.position} layer {m.layer} {m.which}" if m else ""
        lines.append(f"  check           FAILED: {res.mismatched_tokens} tokens differ{where}")
    else:
        lines.append(f"  check           OK: {check}")
    if cfg.model == HYBRID_MODEL:
        linear = cfg.layers - cfg.layers // 4
        if res.state_mismatches:
            lines.append(f"  state check     FAILED: {res.state_mismatches} of {res.state_checked} requests' states differ")
        else:
            lines.append(
                f"  state check     OK: {res.state_checked} requests' conv windows and SSM states x {linear} linear "
                f"layers byte-equal to their recurrence"
            )
    if res.integrity_error:
        lines.append(f"  allocators      FAILED: {res.integrity_error}")
    elif res.leaked_slots:
        lines.append(f"  allocators      FAILED: {res.leaked_slots} slots still held after every request finished")
    else:
        lines.append("  allocators      OK: integrity checks pass, no slot leaked")
    if res.prefix is not None:
        lines += res.prefix.summary_lines(res)
    if cfg.host_tier and res.prefix is None:
        rate = res.host_bytes / res.host_seconds / 1e9 if res.host_seconds > 0 else 0.0
        lines.append(
            f"  host tier       {res.parked} parked, {res.reloaded} reloaded ({cfg.host_layout}, {cfg.host_io_backend}), "
            f"{res.host_full} recomputed for lack of host room; {res.host_bytes / 1e6:.2f} MB moved in "
            f"{res.host_seconds * 1e3:.1f} ms ({rate:.2f} GB/s)"
        )
    if cfg.host_tier:
        if res.reload_mismatches:
            lines.append(f"  reload check    FAILED: {res.reload_mismatches} of {res.reloaded_tokens} reloaded tokens differ")
        else:
            lines.append(f"  reload check    OK: every byte of {res.reloaded_tokens} reloaded tokens x {kv_layers} layers x {parts} matches")
    if cfg.cpu_park:
        lines.append(
            f"  cpu park        {res.parked} parked with get_cpu_copy, {res.reloaded} reloaded with load_cpu_copy; "
            f"{res.cpu_bytes / 1e6:.2f} MB copied"
        )
        if res.reload_mismatches:
            lines.append(f"  reload check    FAILED: {res.reload_mismatches} of {res.reloaded_tokens} reloaded tokens differ")
        else:
            lines.append(f"  reload check    OK: every byte of {res.reloaded_tokens} reloaded tokens x {kv_layers} layers x {parts} matches")
    if cfg.spec_k:
        rate = res.accepted_tokens / res.drafted_tokens if res.drafted_tokens else 0.0
        lines.append(
            f"  spec decode     {res.spec_steps} steps of {cfg.spec_k} drafts: {res.accepted_tokens}/{res.drafted_tokens} "
            f"accepted ({100 * rate:.0f}%), written with set_kv_buffer_prefix_valid, {res.moved_slots} slots compacted "
            f"with move_kv_cache"
        )
    if res.calibration is not None:
        lines += companion("calibration").format_calibration(res.calibration, parts, sys.modules[__name__])
    if not res.ok and cfg.corrupt:
        lines.append("  expected        --corrupt flipped one stored byte on purpose: the FAIL below is the check catching it")
    lines.append("PASS" if res.ok else "FAIL")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> SimConfig:
    d = SimConfig()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the stream")
    p.add_argument("--layers", type=int, default=d.layers, help="attention layers")
    p.add_argument("--heads", type=int, default=d.heads, help="KV heads")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="K and V head dim")
    p.add_argument("--page-size", type=int, default=d.page_size, help="1 selects the token allocator")
    p.add_argument("--kv-budget-mib", type=float, default=d.kv_budget_mib, help="KV-cache memory; sizes the pool")
    p.add_argument("--max-running", type=int, default=d.max_running, help="request table rows")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="prefill tokens per step")
    p.add_argument("--prompt-len", type=int, nargs=2, default=d.prompt_len, metavar=("MIN", "MAX"), help="uniform")
    p.add_argument("--output-len", type=int, nargs=2, default=d.output_len, metavar=("MIN", "MAX"), help="uniform")
    p.add_argument("--arrival-every", type=float, default=d.arrival_every, help="mean steps between arrivals")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="pool element type")
    p.add_argument("--model", choices=MODELS, default=d.model,
                   help="mha: --heads x --head-dim K and V; deepseek-v3: MLA pool of latent rows (512 + 64); "
                        "qwen3.5: hybrid, every 4th layer full attention, the others with a state per request")
    p.add_argument("--device", default=d.device, help="cuda when available, else cpu")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds lengths and arrivals")
    p.add_argument("--cpu-threads", type=int, default=d.cpu_threads, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--max-steps", type=int, default=None, help="stop early (live requests are checked)")
    p.add_argument("--validate", action="store_true", help="allocators raise on bad frees and bad last_loc")
    p.add_argument("--corrupt", action="store_true", help="flip one stored byte: the run then reports FAIL and exits 1, which is the expected outcome")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    p.add_argument("--host-tier", action="store_true", help="park retracted requests' KV in host memory")
    p.add_argument("--host-ratio", type=float, default=d.host_ratio, help="host slots per device slot")
    p.add_argument("--host-layout", choices=LAYOUTS, default=d.host_layout, help="host memory layout")
    p.add_argument("--host-io-backend", choices=IO_BACKENDS, default=d.host_io_backend, help="host transfer backend")
    p.add_argument("--cpu-park", action="store_true", help="park retracted requests with get_cpu_copy/load_cpu_copy")
    p.add_argument("--spec-decode", type=int, default=d.spec_k, metavar="K",
                   help="speculative decoding: K drafts per request and step (0: off)")
    p.add_argument("--calibrate", action="store_true",
                   help="calibration pass with observe_amax first, then the run with the calibrated scales; "
                        "prints the quantisation error with scale 1.0, the checkpoint's and the calibrated scales")
    p.add_argument("--calibrate-steps", type=int, default=d.calibrate_steps, metavar="N",
                   help="steps of the calibration pass (the request stream of --seed + 1)")
    p.add_argument("--calibrate-per-head", action="store_true", help="calibrated scales per KV head, not per tensor")
    p.add_argument("--prefix-cache", action="store_true",
                   help="a chat workload (multi-turn conversations after a common few-shot prompt) on a prefix cache; "
                        "with --host-tier the cache's host tier, with --model qwen3.5 the hybrid cache")
    p.add_argument("--few-shot-len", type=int, default=d.few_shot_len, help="--prefix-cache: the common prompt's tokens")
    p.add_argument("--turns", type=int, nargs=2, default=d.turns, metavar=("MIN", "MAX"),
                   help="--prefix-cache: turns per conversation (each turn's user message: --prompt-len)")
    p.add_argument("--host-write-policy", choices=("write_through", "write_through_selective", "write_back"),
                   default=d.host_write_policy, help="--prefix-cache --host-tier: when tree nodes are backed up")
    a = p.parse_args(argv)
    return SimConfig(
        requests=a.requests, layers=a.layers, heads=a.heads, head_dim=a.head_dim, page_size=a.page_size,
        kv_budget_mib=a.kv_budget_mib, max_running=a.max_running, chunk_size=a.chunk_size,
        prompt_len=tuple(a.prompt_len), output_len=tuple(a.output_len), arrival_every=a.arrival_every,
        dtype=a.dtype, model=a.model, device=a.device, seed=a.seed, max_steps=a.max_steps, validate=a.validate,
        cpu_threads=a.cpu_threads or None,
        corrupt=a.corrupt, progress=not a.no_progress and sys.stderr.isatty(),
        host_tier=a.host_tier, host_ratio=a.host_ratio, host_layout=a.host_layout, host_io_backend=a.host_io_backend,
        cpu_park=a.cpu_park, spec_k=a.spec_decode,
        calibrate=a.calibrate, calibrate_steps=a.calibrate_steps, calibrate_per_head=a.calibrate_per_head,
        prefix_cache=a.prefix_cache, few_shot_len=a.few_shot_len, turns=tuple(a.turns),
        host_write_policy=a.host_write_policy,
    )  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_args(argv)
        result = run(cfg)
    except ValueError as e:
        print(f"serve_sim: {e}", file=sys.stderr)
        return 2
    print(format_summary(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
