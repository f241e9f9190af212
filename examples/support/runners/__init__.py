"""What the model runners in examples/ share (llama_runner.py, deepseek_runner.py, qwen35_runner.py,
gemma3_runner.py, gpt_oss_runner.py): the scheduler, the request table, reading rows back from
a pool, the Hugging Face references and the comparisons with them.

A model family plugs in through an ``Architecture`` (build the seeded model of a ``RunConfig``, make its
pool, make its model runner); ``serve``, ``calibrate`` and ``run`` do the rest:

- ``Scheduler``: a ``ReqToTokenPool`` and a ``PagedTokenToKVPoolAllocator`` (page size > 1), continuous
  batching: it admits waiting prompts while request rows and pages allow, prefills them (whole, or in
  chunks of at most ``chunk_size`` tokens per step), otherwise decodes every running request by one
  token; requests finish at different steps and give their slots back.
- ``ForwardBatch``: one step's ragged tokens and the per-request padded attention metadata, with each
  request's key slots read back through ``req_to_token``; ``read_rows``, ``grouped_attention`` and
  ``attention_mask`` attend over them.
- ``hf_reference``: HF's greedy ``generate`` of each prompt alone, optionally through a cache that
  rounds the K/V it stores as a pool of a given dtype does (``RoundingCache``); ``compare`` reports
  token agreement, logit error and KL; ``run`` serves on a pool of each dtype and compares;
  ``format_summary`` prints it.
- ``RunConfig.prefix_cache`` (``--prefix-cache``): prompts that share prefixes, served on a prefix cache
  (``support.runners.prefix``; the sliding-window runners' on an ``SWARadixCache``,
  ``support.runners.swa_prefix``): each prefills only what the tree does not hold.

The modules: ``config`` (``RunConfig``, the shared options), ``reference`` (prompts, HF references),
``scheduler`` (``Request``, ``ForwardBatch``, ``Scheduler``), ``attention`` (attention over pool
rows), ``results`` (``ServeResult``, ``compare``, ``Report``), ``summary``, ``serving`` (``Architecture``,
``serve``, ``calibrate``, ``run``, ``run_main``), ``prefix`` (the scheduler on a prefix cache),
``tiers`` (``--host-tier`` and ``--storage``: the runs and checks of the tiers below the device),
``qwen35_model``/``qwen35_layers`` (the Qwen3.5 runner's model, pools and layers), ``gemma3_model``
(the Gemma 3 runner's model, sliding-window pool and the scheduler that frees SWA slots, which the
gpt-oss runner uses too), ``swa_prefix`` (that scheduler on an ``SWARadixCache``) and ``sliding`` (a sliding layer's keys and the SWA summary of both). This package re-exports the names the
runners and benchmarks/bench_runner.py use, so ``from support import runners as rc`` reads as one
module.
"""

from __future__ import annotations

from support.runners.attention import attention_mask, grouped_attention, read_rows
from support.runners.config import (
    DTYPES,
    KV_LEN_MULTIPLE,
    LOGIT_RTOL,
    MODEL_DTYPES,
    LayerScales,
    RunConfig,
    Scales,
    Shape,
    add_run_arguments,
    run_config,
    transformers,
    unit_scales,
)
from support.runners.reference import Generation, Prompt, RoundingCache, hf_reference, make_prompts, round_like_pool
from support.runners.results import Agreement, PoolRun, Report, ServeResult, compare
from support.runners.scheduler import ForwardBatch, Request, Scheduler
from support.runners.serving import Architecture, ModelRunner, calibrate, cpu_threads, run, run_main, serve
from support.runners.summary import ROUNDING_NOTE, agreement_line, format_summary

__all__ = [
    "DTYPES", "KV_LEN_MULTIPLE", "LOGIT_RTOL", "MODEL_DTYPES", "ROUNDING_NOTE", "Agreement", "Architecture",
    "ForwardBatch", "Generation", "LayerScales", "ModelRunner", "PoolRun", "Prompt", "Report", "Request",
    "RoundingCache", "RunConfig", "Scales", "Scheduler", "ServeResult", "Shape", "add_run_arguments",
    "agreement_line", "attention_mask", "calibrate", "compare", "cpu_threads", "format_summary",
    "grouped_attention", "hf_reference", "make_prompts", "read_rows", "round_like_pool", "run", "run_config",
    "run_main", "serve", "transformers", "unit_scales",
]  # fmt: skip
