"""Serve prompts with a Qwen3.5 model whose K/V lives in kvpool's ``HybridLinearKVPool`` and whose
linear-attention state lives in its ``MambaPool``, with and without speculative decoding, and check it
against transformers.

Qwen3.5 (``Qwen3_5MoeForCausalLM``) is hybrid: every ``full_attention_interval``-th layer is gated
full attention (GQA, an output gate, RoPE on part of each head, per-head q/k RMSNorms), the others are
Gated DeltaNet linear attention, which keeps no K/V per token but a fixed-size state per request: a
causal convolution window and a recurrent (SSM) state. Every layer ends in a MoE block (routed experts
plus a gated shared expert). The model here is a small seeded random-init one built locally.

The runner shares examples/support/runners/'s scheduler, references and checks with the Llama and
DeepSeek-V3 runners (continuous batching, chunked prefill with ``--chunk-size``, requests finishing at
different steps) and calls HF's modules for everything but the token mixers' caches. The pools are
SGLang's trio: a ``HybridReqToTokenPool`` (the request table, one ``MambaPool`` state slot per
request, kept across prefill chunks) and a ``HybridLinearKVPool`` over the full-attention layers.

- Full-attention layers write the step's K/V with ``pool.set_kv_buffer`` (global layer ids; the pool
  holds the full-attention layers only) and attend over each request's rows read back through
  ``req_to_token``, FP8 rows multiplied back by the layer's scale.
- Gated DeltaNet layers read each request's state from its state slot, run HF's own torch gated delta
  rule (the chunked form for prefill chunks, from the request's state as initial state; the
  recurrent form for decode), and write the new state back. A request's first chunk starts from the
  zero state, as HF's prefill does.

State layout (SGLang's, which the pool keeps) and how it is converted at the boundary with HF's code:

- Convolution window: the pool keeps the last ``conv_kernel - 1`` inputs of the convolution,
  ``[slots + 1, conv_dim, conv_kernel - 1]``; HF's cache keeps ``conv_kernel`` columns, whose first is
  never read by the next step (the causal convolution of a new token covers the new token and the
  ``conv_kernel - 1`` before it). The runner concatenates the window with the step's inputs, runs the
  depthwise convolution without padding (HF's prefill pads with zeros on the left, the same as a zero
  window) and keeps each request's last ``conv_kernel - 1`` input columns as its new window.
- Recurrent state: the pool keeps ``[slots + 1, v_heads, v_head_dim, k_head_dim]`` (float32); HF's gated
  delta rule takes and returns ``[B, v_heads, k_head_dim, v_head_dim]``: the runner transposes the last
  two dimensions on the way in and on the way out.
- The window is kept in the model's dtype (what HF's cache keeps), the recurrent state in float32.

Speculative decoding (``--spec-width W``, on the pools of ``--spec-dtypes``): each decode step drafts
``W - 1`` tokens per request and verifies the block ``[last token, drafts]`` in one target forward.
The draft model is the target without its linear-attention layers (embedding, the gated-attention
layers with their MoE blocks, final norm, LM head: a layer-skipping self-draft that needs no state); its
K/V lives in a second KV pool indexed by the target's slots, as DFLASH's draft cache is. In the verify
forward, full-attention layers attend over the pool's rows of the committed prefix plus the block's
own K/V (rounded as the pool stores it), and linear layers step the recurrent rule through the block,
keeping the state and window after every step in the ``MambaPool``'s intermediate buffers (one row
per batch position). The greedy acceptance then commits, per request, its accepted prefix: the K/V
with ``set_kv_buffer_prefix_valid`` and the state with ``MambaPool.commit(slots, accepted_steps)``;
the rejected slots go back to the allocator. The tokens must equal the non-speculative run's.

Checks (exit status 1 if one fails): with an fp32 model and an fp32 pool every generated token equals
HF's greedy ``generate`` and the logits are within ``LOGIT_RTOL`` relative; with an fp32 model the
speculative run's tokens equal the non-speculative run's on the same pool dtype (with a 16-bit model
this is reported: a verify forward's wider matmuls may round differently from one-token steps on a
GPU and part at a near-tie); the allocators, the request table and the
state pool end consistent with nothing held. bf16 and FP8 pools (scale 1.0, and calibrated) report
token agreement and KL against HF, and the identical-tokens check against HF generating through a cache
that rounds K/V as the pool does (the state is float32 in both).

With ``--prefix-cache`` the prompts share prefixes and the plain runs serve them on a
``MambaRadixCache`` (examples/support/runners/prefix.py): a match's state snapshot is copied into the
request's state slot and only the rest of the prompt is prefilled; with pages above one token the
prefill chunks end at page boundaries, where each request's state is copied into its track slots (the
snapshots the tree caches). The speculative runs serve without the cache.

With ``--prefix-cache --host-tier`` the cache is a ``HiMambaRadixCache`` over a ``HybridPoolHost``
(examples/support/runners/tiers.py checks it): nodes are backed up to host memory, KV pages with
their state snapshots (write-through); a node evicted from the device lives on there, and a match
that reaches it loads its KV and its state back together, then matches again with ``cow_mamba`` to
fork the loaded state into the request's slot. The cache's integrity is checked after every step;
the same prompts are served again with no cache and with a device-only ``MambaRadixCache``, and the
tokens must be the same (an fp32 pool's are also transformers'); the summary and ``--json`` count the
tokens and the state snapshots loaded back from the host. With ``--storage file|mooncake`` as well,
host copies and state snapshots are written through to a storage tier, and a second engine (a fresh
pool, cache and host pool over the same store) serves the prompts from what the first stored:
KV pages with their states, storage -> host -> device, with the same tokens again.

``--json PATH`` writes ``{"config": <the text config's to_dict()>, "seed": S, "prompts": [[ids]],
"fp32_tokens": [[ids]], "spec_tokens": [[ids]]}`` (generated tokens of the fp32 pool without and with
speculative decoding); the model is ``Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))`` built in
float32 right after ``torch.manual_seed(S)``, so anyone can rebuild it and compare. With
``--host-tier`` it also has ``"runs"``: each pool run's cache counters (``host_loaded_tokens``,
``host_loaded_states``, ...) and tier checks, as the Llama runner's ``--json`` writes them.

With ``--dtypes fp8_e4m3_per_token_head`` (or ``fp8_e5m2_per_token_head``) the full-attention part is
built with ``kv_scale_mode="per_token_head"`` and read from its codes and scales; with ``fp4_e2m1`` or
``nvfp4`` it stores SGLang's FP4 or NVFP4 and its getters dequantize. The speculative runs take plain
dtypes only (``--spec-dtypes``: the verify block is rounded as a plain or FP8 part stores it).

    python examples/qwen35_runner.py                                  # tiny config, a few seconds on a CPU
    python examples/qwen35_runner.py --head-dim 256 --spec-width 6 --json out.json
    python examples/qwen35_runner.py --prefix-cache --host-tier --spec-width 0 --prompts 12 --batch 1   # nodes move to the host and back
    python examples/qwen35_runner.py --prefix-cache --host-tier --storage file --spec-width 0 --batch 1   # ... and to storage
    python examples/qwen35_runner.py --config 397b-4layer --device cuda --model-dtype bf16 --dtypes bf16 fp8_e4m3

Exit status: 0 when the checks pass, 1 otherwise, 2 on bad arguments.

Needs ``transformers`` >= 5 with ``qwen3_5_moe`` (the ``model`` extra: ``pip install -e ".[model]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: its shared code, support/
from support import runners as rc  # noqa: E402  (the shared scheduler, references and checks)
from support.runners import DTYPES, Architecture, RunConfig, Scales  # noqa: E402
from support.runners import prefix  # noqa: E402  (the scheduler on a prefix cache)
from support.runners import tiers  # noqa: E402  (--host-tier, --storage)
from support.runners.qwen35_layers import Qwen35Runner, SpecRunner  # noqa: E402
from support.runners.verify import SpecReport, add_spec_runs, spec_check_line, spec_run_lines, with_spec_dtypes  # noqa: E402
from support.runners.qwen35_model import (  # noqa: E402, F401  (the tests and benchmarks use them here)
    SHAPES,
    HybridPools,
    HybridScheduler,
    Qwen3_5MoeForCausalLM,
    QwenShape,
    build_model,
    hybrid_geometry,
    make_pool,
    text_config,
)

from kvpool import MHATokenToKVPool  # noqa: E402

PROGRAM = "qwen35_runner"


# --- the architecture, runs and report --------------------------------------------------------------


class Qwen35(Architecture):
    """The Qwen3.5 architecture for the shared ``serve``/``calibrate``/``run``; with ``spec_width``,
    speculative decoding with verify blocks of that many tokens."""

    program = PROGRAM
    model_name = "Qwen3_5MoeForCausalLM"

    speculative_prefix_cache = False  # its verify steps are not cached: the speculative runs serve without
    pool_formats = {
        "fp8_e4m3_per_token_head": "",
        "fp8_e5m2_per_token_head": "",
        "fp4_e2m1": "",
        "nvfp4": "",
    }

    def __init__(self, spec_width: Optional[int] = None) -> None:
        if spec_width is not None and (isinstance(spec_width, bool) or not isinstance(spec_width, int) or spec_width < 2):
            raise ValueError(f"spec_width must be an int >= 2 (the last token and a draft) or None, got {spec_width!r}")
        self.spec_width = spec_width

    def build_model(self, cfg: RunConfig) -> Qwen3_5MoeForCausalLM:
        if not isinstance(cfg.shape, QwenShape):
            raise ValueError(f"shape must be a QwenShape for Qwen3.5, got {type(cfg.shape).__name__}")
        return build_model(text_config(cfg.shape).to_dict(), DTYPES[cfg.model_dtype], cfg.device, cfg.seed)

    def make_pool(self, cfg: RunConfig, model: Any, dtype: torch.dtype) -> HybridPools:
        return make_pool(cfg, model, dtype, self.spec_width)

    def runner(self, model: Any, pool: Any, scales: Optional[Scales]) -> Qwen35Runner:
        if self.spec_width is None:
            return Qwen35Runner(model, pool, scales)
        kv = pool.kv.full_kv_pool
        draft_pool = MHATokenToKVPool(kv.size, kv.page_size, kv.dtype, kv.head_num, kv.head_dim, kv.layer_num, kv.device)
        return SpecRunner(model, pool, scales, draft_pool)

    def scheduler(
        self, pool: Any, max_running: int, max_context_len: int, chunk_size: Optional[int], prefix_cache: bool = False,
        tiers: Optional[prefix.HostTier] = None,
    ) -> HybridScheduler:  # fmt: skip
        """On a ``MambaRadixCache`` with ``prefix_cache``, a ``HiMambaRadixCache`` with ``tiers`` too."""
        if prefix_cache and self.spec_width is not None:
            raise ValueError("prefix_cache must be False for a speculative run (spec_width set): its verify steps are not cached")
        if tiers is not None and not prefix_cache:
            raise ValueError("tiers (a host tier) need prefix_cache=True: the host tier is the prefix cache's")
        if not prefix_cache:
            return HybridScheduler(pool, max_running, max_context_len, chunk_size, self.spec_width)
        return prefix.caching(HybridScheduler)(pool, max_running, max_context_len, chunk_size, self.spec_width, tiers=tiers)

    def reference_scales(self, model: Any, scales: Optional[rc.LayerScales]) -> Optional[rc.LayerScales]:
        if scales is None or isinstance(scales, Mapping):
            return scales
        return dict(zip(hybrid_geometry(model).full_layers, scales))


#: The Qwen3.5 runner's report: the shared runs and the speculative ones.
QwenReport = SpecReport


@dataclass(frozen=True)
class QwenOptions:
    """What the Qwen3.5 runner adds to a ``RunConfig``: the speculative runs and the JSON output."""

    spec_width: Optional[int] = 4
    spec_dtypes: tuple[str, ...] = ("fp32",)
    json_path: Optional[str] = None

    def __post_init__(self) -> None:
        Qwen35(self.spec_width)  # checks the width
        for d in self.spec_dtypes:
            if d not in DTYPES:
                raise ValueError(f"spec dtype must be one of {', '.join(DTYPES)}, got {d!r}")


def progress(msg: str) -> None:
    print(f"{PROGRAM}: {msg}", file=sys.stderr, flush=True)


def run(cfg: RunConfig, opts: QwenOptions = QwenOptions(), log: Optional[Any] = None) -> QwenReport:
    """The shared runs (each pool dtype against HF), then the speculative runs on a pool of each of
    ``opts.spec_dtypes`` (compared with the plain run on that dtype and with HF), then ``--json``;
    ``log`` is told what starts."""
    log = log or (lambda msg: None)
    if opts.json_path is not None:
        if cfg.model_dtype != "fp32":
            raise ValueError(f"--json describes an fp32 model: model_dtype must be fp32, got {cfg.model_dtype!r}")
        if opts.spec_width is None or "fp32" not in opts.spec_dtypes:
            raise ValueError("--json needs a speculative run on an fp32 pool (--spec-width >= 2, fp32 in --spec-dtypes)")
    if opts.spec_width is not None:  # each speculative run is compared with a plain run on its dtype
        cfg = with_spec_dtypes(cfg, opts.spec_dtypes)
    with exact_fp32():
        return _run(cfg, opts, log)


class exact_fp32:
    """Within the block, CUDA float32 convolutions and matmuls do not round their inputs to TF32
    (cuDNN's default for convolutions): the fp32 checks compare HF's prompt-long convolution with the
    runner's chunked one, which only plain float32 keeps within LOGIT_RTOL."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc: object) -> None:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved


def _run(cfg: RunConfig, opts: QwenOptions, log: Any) -> QwenReport:
    report = SpecReport.of(rc.run(cfg, Qwen35(), log))
    if opts.spec_width is None:
        return report
    with rc.cpu_threads(cfg):
        add_spec_runs(report, cfg, Qwen35(opts.spec_width), opts.spec_dtypes, log)
    if opts.json_path is not None:
        write_json(opts.json_path, cfg, rc.make_prompts(cfg), report)
        log(f"wrote {opts.json_path}")
    return report


def write_json(path: str, cfg: RunConfig, prompts: Sequence[rc.Prompt], report: QwenReport) -> None:
    fp32 = next(r for r in report.runs if r.dtype == "fp32")
    spec = next(s for s in report.spec_runs if s.dtype == "fp32")
    out = {
        "config": text_config(cfg.shape).to_dict(),  # type: ignore[arg-type]
        "seed": cfg.seed,
        "prompts": [list(p.tokens) for p in prompts],
        "fp32_tokens": [g.tokens for g in fp32.result.generations],
        "spec_tokens": [g.tokens for g in spec.result.generations],
    }
    if cfg.host_tier:
        out["runs"] = tiers.report_json(report)["runs"]
    with open(path, "w") as f:
        json.dump(out, f)


#: What the speculative runs draft with and commit with (the summary says so).
SPEC_DRAFT = "the target without its linear-attention layers, K/V in a second pool at the target's slots"
SPEC_COMMITS = "KV commits with set_kv_buffer_prefix_valid, state with commit(slots, accepted_steps)"


def format_summary(rep: QwenReport) -> str:
    text = rc.format_summary(rep).replace("; a HiRadixCache with a host tier", "; a HiMambaRadixCache with a host tier")
    lines = text.split("\n")[:-1]  # without the final PASS/FAIL
    for s in rep.spec_runs:
        lines += spec_run_lines(s, SPEC_DRAFT, SPEC_COMMITS)
    if rep.spec_runs and rep.config.prefix_cache:
        lines.append("  note        the speculative runs serve without the prefix cache (verify steps are not cached)")
    check = spec_check_line(rep)
    if check is not None:
        lines.append(check)
    lines.append("PASS" if rep.ok else "FAIL")
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROGRAM, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", choices=sorted(SHAPES), default="tiny", help="model shape preset")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--head-dim", type=int, help="override the preset's attention head_dim (Qwen3.5's is 256)")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--full-attention-interval", type=int, help="every N-th layer is full attention (Qwen3.5: 4)")
    p.add_argument("--spec-width", type=int, default=4,
                   help="tokens per verify block (the last token + drafts); 0: no speculative run")  # fmt: skip
    p.add_argument("--spec-dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"],
                   help="pool dtypes of the speculative runs")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write config, seed, prompts and the fp32 and speculative tokens")
    rc.add_run_arguments(p, **RUN_DEFAULTS)
    tiers.add_tier_arguments(p)
    return p


#: The runner's defaults where they differ from ``RunConfig``'s: prompts longer than a prefill chunk,
#: pages of 4 so that prompts and decode cross page ends.
RUN_DEFAULTS: dict[str, Any] = dict(prompts=6, batch=3, prompt_len=(4, 40), new_tokens=(4, 10), page_size=4, chunk_size=16)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[RunConfig, QwenOptions]:
    a = make_parser().parse_args(argv)
    names = {"layers": "layers", "head_dim": "head_dim", "vocab": "vocab", "full_attention_interval": "full_attention_interval"}
    overrides = {k: getattr(a, v) for k, v in names.items() if getattr(a, v) is not None}
    cfg = rc.run_config(a, replace(SHAPES[a.config], **overrides))
    return cfg, QwenOptions(a.spec_width or None, tuple(a.spec_dtypes), a.json)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return rc.run_main(argv, parse_args, PROGRAM, execute=lambda cfg, opts: run(cfg, opts, progress),  # type: ignore[arg-type]
                       summary=format_summary)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
