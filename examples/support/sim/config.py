"""serve_sim's configuration: ``SimConfig`` (one run, checked when built; errors name the command-line
flags) and the constants every part of the simulation shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.host import IO_BACKENDS, LAYOUTS
from support.cli import DTYPES, check_device
from support.storage import StorageOptions

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
#: The hybrid linear-attention model (its pools, runner and checks: support/sim/hybrid.py).
HYBRID_MODEL = "qwen3.5"
#: Models with sliding-window layers (their pools, scheduler and checks: support/sim/sliding.py): every
#: N-th layer is full attention, the others slide. Gemma 3: five local layers to one global;
#: gpt-oss: sliding and full layers alternating.
SWA_MODELS = {"gemma3": 6, "gpt-oss": 2}
MODELS = ("mha", *MLA_MODELS, HYBRID_MODEL, *SWA_MODELS)
#: What a run with a SWA_MODELS model runs without, and why (the run refuses these options).
SWA_REFUSES = {
    "host_tier": "the host tier parks MHA, MLA and hybrid pools' rows",
    "cpu_park": "a retracted request's tokens before its window have no SWA rows to copy",
    "calibrate": "calibration runs on the MHA and MLA pools",
}
# A latent row is quantized with one scale; V's, so that some values saturate here too (the row's
# values are kv_values' K half, so each layer's latent scale follows K's magnitude).
LATENT_SCALE = V_SCALE
#: When a prefix-cache run's tree nodes are backed up to the host tier (HiRadixCache's write policies).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
#: What --prefix-cache runs without, and why (the run refuses these options; --help says so too).
PREFIX_CACHE_REFUSES = {
    "cpu_park": "a retracted request's leading pages belong to the tree, which keeps them; use --host-tier",
    "spec_k": "the cache's scheduler does not schedule verify steps",
    "calibrate": "the calibration pass serves the plain request stream, not the chats",
}
#: The --dtype names of SGLang's FP4 KV formats (its --kv-cache-dtype names) and the FP4 pool's
#: ``fp4_format`` each selects (support/sim/formats.py).
FP4_DTYPES = {"fp4_e2m1": "fp4_mx_block16", "nvfp4": "nvfp4"}
#: --kv-scales: the FP8 scales each write is given (``static``: the checkpoint's, per tensor), or a
#: scale per token and head computed when each row is written (``MHATokenToKVPoolFP8PerTokenHead``).
KV_SCALES = ("static", "per-token-head")
#: What a run of a pool that keeps scales beside its codes (--dtype fp4_e2m1 / nvfp4, --kv-scales
#: per-token-head) runs without, and why (the run refuses these options).
FORMAT_REFUSES = {
    "host_tier": "the host tier copies K and V buffers, not the scales beside them",
    "cpu_park": "the parked copy is checked as K and V buffers, not with the scales beside them",
    "spec_k": "the verify steps are checked against per-tensor FP8",
    "calibrate": "these pools' scales are not calibrated",
    "prefix_cache": "the prefix cache's reloads are checked against per-tensor FP8",
}
#: The command-line flag of each SimConfig field whose flag is not its name with dashes.
FLAGS = {"spec_k": "--spec-decode"}


def pool_dtype(name: str) -> object:
    """What a pool is built with for a --dtype name: its torch dtype, or an FP4 name as it is (the FP4
    pool's ``dtype`` argument, also ``KVGeometry``'s)."""
    return name if name in FP4_DTYPES else DTYPES[name]


def flag(field_name: str) -> str:
    """The command-line flag that sets ``SimConfig.<field_name>``."""
    return FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


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
    # few-shot prompt of few_shot_len tokens) on a prefix cache (support/sim/prefix.py);
    # with --host-tier the cache's host tier, backed up by host_write_policy.
    prefix_cache: bool = False
    few_shot_len: int = 256
    turns: tuple[int, int] = (1, 4)
    host_write_policy: str = "write_through"
    # --storage file|mooncake (with --prefix-cache --host-tier): a storage tier below the host tier
    # (support/storage.py): host copies (with --model qwen3.5 their state snapshots too) are written
    # through to it, and each admission first fetches from it what follows its match's host part.
    storage: Optional[StorageOptions] = None
    # --model gemma3 / gpt-oss: the sliding layers' window (gpt-oss's is 128 tokens, Gemma 3's 1024;
    # 128 by default so that the window matters at serve_sim's default lengths), the SWA part's tokens
    # per full-part token (SGLang's --swa-full-tokens-ratio), and the context at which the summary
    # compares a request's KV bytes with a pool that keeps every layer's.
    sliding_window: int = 128
    swa_full_tokens_ratio: float = 0.8
    long_context: int = 131072
    # --kv-scales per-token-head: FP8 with a scale per token and head computed at write time
    # (support/sim/formats.py), instead of the checkpoint's per-tensor scales.
    kv_scales: str = "static"

    def __post_init__(self) -> None:
        for name in ("requests", "layers", "heads", "head_dim", "page_size", "max_running", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag(name)} must be a positive int, got {value!r}")
        for name in ("prompt_len", "output_len", "turns"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{flag(name)} must be a range MIN MAX with 1 <= MIN <= MAX, got {lo} {hi}")
        if not self.kv_budget_mib > 0:
            raise ValueError(f"--kv-budget-mib must be > 0, got {self.kv_budget_mib}")
        if not self.arrival_every >= 0:
            raise ValueError(f"--arrival-every must be >= 0, got {self.arrival_every}")
        if self.dtype not in DTYPES and self.dtype not in FP4_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join([*DTYPES, *FP4_DTYPES])}, got {self.dtype!r}")
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        self._check_scaled_format()
        check_device(self.device)
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be a positive int (0 on the command line: torch's choice), got {self.cpu_threads}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be a positive int, got {self.max_steps}")
        if not self.host_ratio > 0:
            raise ValueError(f"--host-ratio must be > 0 (host slots per device slot), got {self.host_ratio}")
        if self.host_layout not in LAYOUTS:
            raise ValueError(f"--host-layout must be one of {', '.join(LAYOUTS)}, got {self.host_layout!r}")
        if self.host_io_backend not in IO_BACKENDS:
            raise ValueError(f"--host-io-backend must be one of {', '.join(IO_BACKENDS)}, got {self.host_io_backend!r}")
        if self.host_tier and self.cpu_park:
            raise ValueError("--host-tier and --cpu-park are two ways to park a retracted request: choose one")
        if isinstance(self.spec_k, bool) or not isinstance(self.spec_k, int) or self.spec_k < 0:
            raise ValueError(f"--spec-decode must be a non-negative int, got {self.spec_k!r}")
        if self.spec_k and self.model in MLA_MODELS:
            raise ValueError(
                f"--spec-decode needs the MHA pool's set_kv_buffer_prefix_valid (--model mha, {HYBRID_MODEL}, "
                f"{' or '.join(SWA_MODELS)}), got --model {self.model}"
            )
        if self.model == HYBRID_MODEL and self.layers < 4:
            raise ValueError(f"--model {HYBRID_MODEL} needs --layers 4 or more (every 4th is full attention), got {self.layers}")
        if self.model == HYBRID_MODEL and self.calibrate:
            raise ValueError(
                f"--calibrate runs on the MHA and MLA pools only (--model mha or deepseek-v3), got --model {HYBRID_MODEL}"
            )
        steps = self.calibrate_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"--calibrate-steps must be a positive int, got {self.calibrate_steps!r}")
        if self.calibrate and DTYPES[self.dtype] not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"--calibrate needs an FP8 --dtype (fp8_e4m3 or fp8_e5m2; other pools store no scale), got {self.dtype!r}"
            )
        if self.calibrate_per_head and not self.calibrate:
            raise ValueError("--calibrate-per-head (the calibrated scales' shape) needs --calibrate")
        if self.model in SWA_MODELS:
            self._check_sliding_window()
        if self.prefix_cache:
            self._check_prefix_cache()
        if self.storage is not None:
            if not isinstance(self.storage, StorageOptions):
                raise ValueError(f"storage must be a StorageOptions or None, got {type(self.storage).__name__}")
            if not (self.prefix_cache and self.host_tier):
                raise ValueError(
                    f"--storage {self.storage.backend} sits below the prefix cache's host tier: needs --prefix-cache --host-tier"
                )

    @property
    def scaled_format(self) -> bool:
        """Whether the pool keeps scales beside its codes (FP4, or FP8 with per-token-head scales)."""
        return self.dtype in FP4_DTYPES or self.kv_scales == "per-token-head"

    def _check_scaled_format(self) -> None:
        """What --dtype fp4_e2m1 / nvfp4 and --kv-scales per-token-head need and run without."""
        if self.kv_scales not in KV_SCALES:
            raise ValueError(f"--kv-scales must be one of {', '.join(KV_SCALES)}, got {self.kv_scales!r}")
        if self.kv_scales == "per-token-head" and self.dtype not in ("fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"--kv-scales per-token-head needs --dtype fp8_e4m3 or fp8_e5m2, got {self.dtype!r}")
        if not self.scaled_format:
            return
        what = f"--dtype {self.dtype}" if self.dtype in FP4_DTYPES else "--kv-scales per-token-head"
        models = ("mha", *MLA_MODELS) if self.dtype == "fp4_e2m1" else ("mha",)
        if self.model not in models:
            if self.dtype in FP4_DTYPES and self.model in MLA_MODELS:
                why = "MLATokenToKVPoolFP4 stores exponent scales only"
            elif self.dtype in FP4_DTYPES:
                why = "the simulation checks FP4 rows of the MHA and MLA pools, not of HybridLinearKVPool's or SWAKVPool's FP4 parts"
            else:
                why = "the simulation checks per-token-head rows in the MHA pool only"
            raise ValueError(f"{what} runs with --model {' or '.join(models)} ({why}), got --model {self.model}")
        for name, why in FORMAT_REFUSES.items():
            if getattr(self, name):
                raise ValueError(f"{what} runs without {flag(name)} ({why})")
        if self.dtype in FP4_DTYPES and self.model == "mha" and self.head_dim % 16:
            raise ValueError(f"{what} needs a --head-dim that is a multiple of 16 (one scale per 16 elements), got {self.head_dim}")

    def _check_sliding_window(self) -> None:
        """What ``--model gemma3`` / ``gpt-oss`` need and what they run without (``SWA_REFUSES``)."""
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 2:
            raise ValueError(f"--sliding-window must be an int >= 2, got {w!r}")
        r = self.swa_full_tokens_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"--swa-full-tokens-ratio must be a number in (0, 1], got {r!r}")
        n = self.long_context
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--long-context must be a positive int, got {n!r}")
        every = SWA_MODELS[self.model]
        if self.layers < every:
            raise ValueError(
                f"--model {self.model} needs --layers {every} or more (layer i is full attention when (i + 1) % {every} == 0), "
                f"got {self.layers}"
            )
        for name, why in SWA_REFUSES.items():
            if getattr(self, name):
                raise ValueError(f"--model {self.model} runs without {flag(name)} ({why})")

    def _check_prefix_cache(self) -> None:
        """What ``--prefix-cache`` needs and what it runs without (``REFUSED``)."""
        if isinstance(self.few_shot_len, bool) or not isinstance(self.few_shot_len, int) or self.few_shot_len < 0:
            raise ValueError(f"--few-shot-len must be a non-negative int, got {self.few_shot_len!r}")
        if self.host_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"--host-write-policy must be one of {', '.join(WRITE_POLICIES)}, got {self.host_write_policy!r}"
            )
        for name in ("cpu_park", "spec_k", "calibrate"):
            if getattr(self, name):
                raise ValueError(f"--prefix-cache runs without {flag(name)} ({PREFIX_CACHE_REFUSES[name]})")

    @property
    def max_context_len(self) -> int:
        if self.prefix_cache:  # a conversation's last turn holds every earlier one
            return self.few_shot_len + self.turns[1] * (self.prompt_len[1] + self.output_len[1])
        return self.prompt_len[1] + self.output_len[1]
