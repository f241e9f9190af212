"""The model runners' configuration: ``RunConfig`` (one run, checked when built), the dtypes and
bounds every runner shares, and the command-line options every runner takes (``add_run_arguments``).

Importing it checks that Hugging Face transformers >= 5 is there (the ``model`` extra)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Union

import torch

from kvpool.checks import positive_int
from support.cli import DTYPES, check_device
from support.storage import StorageOptions, storage_options

try:
    import transformers
except ImportError as e:
    raise ImportError(
        "the model runners need Hugging Face transformers as their model and reference: pip install -e '.[model]'"
    ) from e
if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(
        f"the model runners need transformers >= 5, found {transformers.__version__}: pip install -e '.[model]'"
    )

from support.runners.formats import POOL_FORMATS, PoolFormat  # noqa: E402  (after the check: it needs transformers)

MODEL_DTYPES = ("fp32", "bf16", "fp16")
#: fp32 model + fp32 pool: the largest allowed max|logits - HF| / max|HF logits| of any step.
LOGIT_RTOL = 1e-4
#: SDPA's memory-efficient CUDA kernel wants the mask's last dim a multiple of 16; padding keys are masked.
KV_LEN_MULTIPLE = 16

Scales = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_scale, v_scale), float32 on the device
#: Scales by HF layer index, for a reference cache: a list, or a mapping when only some layers hold K/V.
LayerScales = Union[Scales, Mapping[int, tuple[torch.Tensor, torch.Tensor]]]


def pool_kind(name: str) -> "torch.dtype | PoolFormat":
    """What a ``--dtypes`` name builds a pool of: a torch dtype, or a ``PoolFormat``."""
    return POOL_FORMATS[name] if name in POOL_FORMATS else DTYPES[name]


def unit_scales(layers: int, device: str | torch.device) -> Scales:
    one = torch.ones(1, dtype=torch.float32, device=device)
    return [(one, one)] * layers



# --- configuration --------------------------------------------------------------------------------


class Shape(Protocol):
    """What the shared code reads from a model family's shape (each runner has its own dataclass)."""

    layers: int
    vocab: int

    def describe(self) -> str: ...


@dataclass(frozen=True)
class RunConfig:
    """One run: the model, the prompts, the scheduler's limits and the pool dtypes to compare.

    ``prompt_len`` and ``new_tokens`` are inclusive ranges; each prompt draws its own (prompt lengths
    distinct where the range allows). ``batch`` is the most requests running at once (request table
    rows); prompts beyond it wait for a finished request's row and pages. ``chunk_size`` is the most
    prompt tokens one prefill step takes (None: whole prompts); a longer prompt is prefilled in chunks
    over several steps. ``prefix_cache``: the prompts share prefixes (each after the first begins
    with part of an earlier one) and the scheduler serves them on a prefix cache (support.runners.prefix);
    ``host_tier``: the cache has a host tier (a ``HiRadixCache``), and ``storage`` a storage tier
    below it (support.runners.tiers checks both against a device-only cache and no cache).
    """

    shape: Shape
    model_dtype: str = "fp32"
    pool_dtypes: tuple[str, ...] = ("fp32", "bf16", "fp8_e4m3")
    prompts: int = 8
    batch: int = 4
    prompt_len: tuple[int, int] = (3, 40)
    new_tokens: tuple[int, int] = (2, 12)
    page_size: int = 16
    seed: int = 0
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    calibrate: bool = True
    # Small matmuls on a 2-core CPU run faster on one thread (as in serve_sim). None: torch's choice.
    cpu_threads: Optional[int] = 1
    chunk_size: Optional[int] = None
    prefix_cache: bool = False
    host_tier: bool = False
    storage: Optional[StorageOptions] = None

    def __post_init__(self) -> None:
        for name in ("prompts", "batch", "page_size"):
            positive_int(getattr(self, name), name)
        if self.chunk_size is not None:
            positive_int(self.chunk_size, "chunk_size")
        for name in ("prompt_len", "new_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.model_dtype!r}")
        if not self.pool_dtypes:
            raise ValueError("pool_dtypes must name at least one pool dtype, got none")
        for d in self.pool_dtypes:
            if d not in DTYPES and d not in POOL_FORMATS:
                raise ValueError(f"pool dtype must be one of {', '.join([*DTYPES, *POOL_FORMATS])}, got {d!r}")
        check_device(self.device)
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be a positive int or None, got {self.cpu_threads}")
        if self.host_tier and not self.prefix_cache:
            raise ValueError("--host-tier is the prefix cache's host tier: needs --prefix-cache")
        if self.storage is not None and not self.host_tier:
            raise ValueError(f"--storage {self.storage.backend} sits below the host tier: needs --prefix-cache --host-tier")
        if self.storage is not None and not isinstance(self.storage, StorageOptions):
            raise ValueError(f"storage must be a StorageOptions or None, got {type(self.storage).__name__}")

    @property
    def max_context_len(self) -> int:
        return self.prompt_len[1] + self.new_tokens[1]



_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def add_run_arguments(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """The options every model family's runner takes (the model shape's are its own); ``defaults``
    replace ``RunConfig``'s for this runner."""
    d = {**_DEFAULTS, **defaults}
    p.add_argument("--model-dtype", choices=MODEL_DTYPES, default=d["model_dtype"], help="weights and activations")
    p.add_argument("--dtypes", nargs="+", choices=[*sorted(DTYPES), *POOL_FORMATS], default=list(d["pool_dtypes"]),
                   help="pool dtypes, and pool formats: fp4_e2m1 (SGLang's FP4), nvfp4, fp8_e4m3_per_token_head, "
                        "fp8_e5m2_per_token_head (a scale per token and head)")
    p.add_argument("--prompts", type=int, default=d["prompts"], help="prompts to serve")
    p.add_argument("--batch", type=int, default=d["batch"], help="most requests running at once")
    p.add_argument("--prompt-len", type=int, nargs=2, default=d["prompt_len"], metavar=("MIN", "MAX"),
                   help="prompt lengths drawn from this range")  # fmt: skip
    p.add_argument("--new-tokens", type=int, nargs=2, default=d["new_tokens"], metavar=("MIN", "MAX"),
                   help="tokens each request generates, drawn from this range")  # fmt: skip
    p.add_argument("--page-size", type=int, default=d["page_size"], help="slots per page")
    p.add_argument("--chunk-size", type=int, default=d["chunk_size"],
                   help="most prompt tokens per prefill step (chunked prefill; 0 or unset: whole prompts)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d["seed"], help="seeds the weights and the prompts")
    p.add_argument("--device", default=d["device"], help="cuda when available, else cpu")
    p.add_argument("--no-calibrate", action="store_true", help="skip the calibrated-scale FP8 runs")
    p.add_argument("--cpu-threads", type=int, default=d["cpu_threads"], help="torch threads on a CPU (0: torch's choice)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="prompts that share prefixes, served on a prefix cache (each prefills only what it does not hold)")  # fmt: skip


def run_config(a: argparse.Namespace, shape: Shape) -> RunConfig:
    """The ``RunConfig`` of parsed ``add_run_arguments`` options (and ``tiers.add_tier_arguments``'
    where the runner takes them) and a model shape."""
    tiers: dict[str, Any] = {}
    if hasattr(a, "host_tier"):
        tiers = dict(host_tier=a.host_tier, storage=storage_options(a, a.seed))
    return RunConfig(
        shape=shape, model_dtype=a.model_dtype, pool_dtypes=tuple(a.dtypes),
        prompts=a.prompts, batch=a.batch, prompt_len=tuple(a.prompt_len), new_tokens=tuple(a.new_tokens),
        page_size=a.page_size, seed=a.seed, device=a.device, calibrate=not a.no_calibrate,
        cpu_threads=a.cpu_threads or None, chunk_size=a.chunk_size or None, prefix_cache=a.prefix_cache, **tiers,
    )  # fmt: skip
