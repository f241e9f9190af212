"""Decode step of examples/qwen35_runner.py with and without speculative decoding, on a GPU.

The model is Qwen3.5-397B's attention and Gated DeltaNet geometry in 4 layers (``--config 397b-4layer``:
3 linear + 1 gated attention, 32 query / 2 KV heads x 256, DeltaNet 16 key / 64 value heads x 128),
random bf16 weights, an FP8 e4m3 KV pool with page size 64 and float32 recurrent states. For each batch
size, ``batch`` prompts of ``--prompt-len`` tokens are prefilled, then the runner's whole step is timed
between device synchronisations (schedule, forward, greedy tokens to the host, bookkeeping; with
speculative decoding: drafting, the verify forward, acceptance, the K/V and state commits and the
frees of rejected slots), ``--warmup`` steps untimed then ``--steps`` timed, no request finishing.

Reported per batch size: the median step time, and tokens per second (a plain step makes one token
per request; a verify step makes the accepted drafts plus one). The draft is the runner's
layer-skipping self-draft, whose acceptance on random weights says nothing about a trained model's:
the step time at a given width is the figure to read, the tokens per second only with that rate.

Usage (on a GPU): python benchmarks/bench_qwen35_runner.py --out DIR
Writes DIR/qwen35_runner.json and DIR/qwen35_runner.md. ``--config tiny --device cpu`` runs the same
code at a toy size (no GPU figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from kvpool.checks import resolve_device

_PATH = Path(__file__).resolve().parents[1] / "examples" / "qwen35_runner.py"
_spec = importlib.util.spec_from_file_location("qwen35_runner", _PATH)
qwen35_runner = importlib.util.module_from_spec(_spec)
sys.modules["qwen35_runner"] = qwen35_runner  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(qwen35_runner)
rc = sys.modules["runner_common"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: Any, args: argparse.Namespace, device: torch.device, batch: int, width: Optional[int]) -> dict:
    """Prefill ``batch`` prompts, then time decode (or verify, with ``width``) steps of all of them."""
    steps = args.warmup + args.steps
    new_tokens = steps * (width or 1) + 2  # nobody finishes while measured
    cfg = rc.RunConfig(
        shape=qwen35_runner.SHAPES[args.config], model_dtype=args.model_dtype, pool_dtypes=(args.pool_dtype,),
        batch=batch, prompt_len=(args.prompt_len, args.prompt_len), new_tokens=(new_tokens, new_tokens),
        page_size=args.page_size, device=str(device),
    )  # fmt: skip
    arch = qwen35_runner.Qwen35(width)
    pools = arch.make_pool(cfg, model, rc.DTYPES[args.pool_dtype])
    sched = arch.scheduler(pools, batch, cfg.max_context_len, None)
    runner = arch.runner(model, pools, None)
    g = torch.Generator().manual_seed(args.seed + batch)
    for rid in range(batch):
        tokens = torch.randint(model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
        sched.add(rc.Request(rid, tokens, new_tokens))
    if runner.step(sched, keep_logits=False) != "prefill" or len(sched.running) != batch:
        raise RuntimeError(f"expected one prefill of {batch} requests")
    times, made = [], []
    for i in range(steps):
        before = sum(len(r.output) for r in sched.running)
        sync(device)
        start = time.perf_counter()
        kind = runner.step(sched, keep_logits=False)
        sync(device)
        if kind not in ("decode", "verify") or len(sched.running) != batch:
            raise RuntimeError(f"expected a {'verify' if width else 'decode'} step of {batch} requests, got {kind}")
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            made.append(sum(len(r.output) for r in sched.running) - before)
    step_s = statistics.median(times)
    tokens_per_step = sum(made) / len(made)
    return {
        "batch": batch, "spec_width": width, "step_ms": 1e3 * step_s, "step_ms_min": 1e3 * min(times),
        "step_ms_max": 1e3 * max(times), "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / step_s,
        "accepted_per_request_step": tokens_per_step / batch - 1,
    }  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=".", help="directory for qwen35_runner.json and qwen35_runner.md")
    p.add_argument("--config", choices=sorted(qwen35_runner.SHAPES), default="397b-4layer", help="model shape preset")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="requests decoding at once")
    p.add_argument("--spec-widths", type=int, nargs="+", default=[4, 16], help="verify block sizes (last token + drafts)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens of each prompt")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--page-size", type=int, default=64, help="slots per page")
    p.add_argument("--pool-dtype", choices=sorted(rc.DTYPES), default="fp8_e4m3", help="KV pool dtype")
    p.add_argument("--model-dtype", choices=rc.MODEL_DTYPES, default="bf16", help="weights and activations")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda when available")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompts")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    shape = qwen35_runner.SHAPES[args.config]
    log(f"building {args.config} ({shape.describe()}) on {device}")
    model = qwen35_runner.build_model(qwen35_runner.text_config(shape).to_dict(), rc.DTYPES[args.model_dtype], device, args.seed)
    rows = []
    with rc.cpu_threads(rc.RunConfig(shape=shape, device=str(device))), torch.no_grad():
        for batch in args.batches:
            for width in [None, *args.spec_widths]:
                log(f"batch {batch}, {'plain decode' if width is None else f'verify blocks of {width}'}")
                rows.append(measure(model, args, device, batch, width))
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "config": args.config, "shape": shape.describe(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else "cpu", "torch": torch.__version__, "pool_dtype": args.pool_dtype, "model_dtype": args.model_dtype,
        "prompt_len": args.prompt_len, "page_size": args.page_size, "steps": args.steps, "warmup": args.warmup,
        "command": "python benchmarks/bench_qwen35_runner.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }  # fmt: skip
    with open(os.path.join(args.out, "qwen35_runner.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"Qwen3.5 runner decode step: {meta['shape']}, {args.model_dtype} weights, {args.pool_dtype} pool, prompts of "
        f"{args.prompt_len} tokens, on {meta['device']}",
        "",
        "| batch | step | median ms (min-max) | tokens / step | tokens/s | drafts accepted per request and step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = "decode" if r["spec_width"] is None else f"verify {r['spec_width']}"
        acc = "-" if r["spec_width"] is None else f"{r['accepted_per_request_step']:.2f}"
        lines.append(
            f"| {r['batch']} | {step} | {r['step_ms']:.2f} ({r['step_ms_min']:.2f}-{r['step_ms_max']:.2f}) | "
            f"{r['tokens_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {acc} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "qwen35_runner.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
