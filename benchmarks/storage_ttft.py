"""Time to first token of a repeated long prompt served from the storage tier, against recomputing
it (the ``ttft`` cases of bench_storage.py).

One prompt of ``prompt_len`` random tokens, one new token. First a writer engine serves it on a
``HiRadixCache`` over a storage backend (write-through: its pages reach host memory and storage) and
drains its writes. Then, in alternation, ``reps`` times each (after one untimed round):

* *recompute*: a fresh pool and scheduler without a prefix cache prefill the whole prompt;
* *from storage*: a fresh engine (a new pool, a new ``HiRadixCache`` and host pool, a new backend
  over the same store: nothing on the device or in host memory) matches the prompt, prefetches its
  pages from storage (``wait_complete``), loads them host -> device and prefills only the tokens
  after the last whole page.

Time to first token is the wall time from the request's arrival to its first token on the host
(the scheduler's whole step, synchronised on a GPU); medians. Each engine's hit must come from
storage (tokens fetched from storage > 0, else the case is an error), and the first token of both
paths is reported (the same for an fp32 pool; a rounded pool may pick another at a near-tie).

Models: the runners' Llama-3-8B shape with 4 layers (``llama``) and Qwen3.5-397B's in 4 layers
(``qwen3.5``), or their ``tiny`` shapes on a CPU. A model whose cache refuses a storage tier
(``ValueError`` when the tiered scheduler is made) is skipped, the message saying why.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")

#: model -> (runner module, shape on a GPU, page size, prompt tokens on a GPU)
MODELS = {
    "llama": ("llama_runner", "8b-4layer", 16, 8192),
    "qwen3.5": ("qwen35_runner", "397b-4layer", 64, 8192),
}
#: The CPU run: the runners' tiny shapes and a short prompt.
CPU_SHAPE, CPU_PROMPT_LEN = "tiny", 256


class Refused(Exception):
    """The model's prefix cache takes no storage tier (the message is the cache's)."""


def _examples() -> Any:
    """The examples' runner modules and storage site (imported on first use: they need transformers)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import importlib

    from support import runners, storage
    from support.runners import prefix

    return dict(llama_runner=importlib.import_module("llama_runner"), qwen35_runner=importlib.import_module("qwen35_runner"),
                rc=runners, HostTier=prefix.HostTier, StorageOptions=storage.StorageOptions, StorageSite=storage.StorageSite)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Setup:
    """One model's runner pieces: architecture, shape, model, run config and pool dtype."""

    def __init__(self, model: str, device: torch.device, prompt_len: Optional[int], pool_dtype: str, seed: int) -> None:
        ex = _examples()
        self.rc, self.host_tier = ex["rc"], ex["HostTier"]
        module_name, gpu_shape, self.page_size, gpu_len = MODELS[model]
        module = ex[module_name]
        self.name, self.device, self.pool_dtype = model, device, pool_dtype
        self.config = gpu_shape if device.type == "cuda" else CPU_SHAPE
        self.prompt_len = prompt_len or (gpu_len if device.type == "cuda" else CPU_PROMPT_LEN)
        if self.prompt_len <= self.page_size:
            raise ValueError(f"prompt_len must be more than one page ({self.page_size} tokens) for {model}, got {self.prompt_len}")
        self.shape = module.SHAPES[self.config]
        self.arch = module.LLAMA if model == "llama" else module.Qwen35(None)
        model_dtype = "bf16" if device.type == "cuda" else "fp32"
        # A hybrid model's state is kept where a prefill chunk ends: its prompt is prefilled as its
        # whole pages but the last, then the rest, so a state sits where a later match stops (both
        # paths prefill so). A plain model's prompt is one chunk.
        chunk = (self.prompt_len - 1) // self.page_size * self.page_size if model == "qwen3.5" else None
        self.cfg = self.rc.RunConfig(
            shape=self.shape, model_dtype=model_dtype, pool_dtypes=(pool_dtype,), prompts=1, batch=1,
            prompt_len=(self.prompt_len, self.prompt_len), new_tokens=(1, 1), page_size=self.page_size, device=str(device),
            chunk_size=chunk,
        )  # fmt: skip
        #: The tiered engines' pools are made for a prefix cache (a hybrid model's state slots for the tree).
        self.tiered_cfg = dataclasses.replace(self.cfg, prefix_cache=True, host_tier=True)
        self.model = self.arch.build_model(self.cfg)
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(self.model.config.vocab_size, (self.prompt_len,), generator=g).tolist()

    def describe(self) -> str:
        return (f"{self.name} {self.config} ({self.shape.describe()}), {self.cfg.model_dtype} weights, "
                f"{self.pool_dtype} pool, page size {self.page_size}")

    def serve(self, tiers: Any) -> dict:
        """The prompt on a fresh pool and scheduler (a tiered prefix cache with ``tiers``): seconds
        to its first token, the token, and the tokens fetched from storage; the engine is emptied
        afterwards (its storage writes drained)."""
        pool = self.arch.make_pool(self.cfg if tiers is None else self.tiered_cfg, self.model, self.rc.DTYPES[self.pool_dtype])
        try:
            sched = self.arch.scheduler(pool, 1, self.cfg.max_context_len, self.cfg.chunk_size, tiers is not None, tiers=tiers)
        except ValueError as exc:
            if tiers is not None:
                raise Refused(str(exc)) from exc
            raise
        runner = self.arch.runner(self.model, pool, None)
        _sync(self.device)
        start = time.perf_counter()
        sched.add(self.rc.Request(0, list(self.tokens), 1))
        while not any(r.output for r in (*sched.running, *sched.finished)):
            if runner.step(sched, keep_logits=False) is None:
                raise RuntimeError("the scheduler stopped before the first token")
        _sync(self.device)
        seconds = time.perf_counter() - start
        first = next(r.output[0] for r in (*sched.running, *sched.finished) if r.output)
        while runner.step(sched, keep_logits=False) is not None:
            pass
        out = dict(s=seconds, token=int(first), storage_tokens=getattr(sched, "storage_loaded_tokens", 0),
                   cached_tokens=getattr(sched, "cached_tokens", 0))  # fmt: skip
        held = sched.leaked_slots()  # with tiers: storage drained, then device and host emptied
        if held:
            raise RuntimeError(f"the engine holds {held} slots after its request finished")
        if not getattr(sched, "storage_drained", True):
            raise RuntimeError("the engine's storage writes did not finish")
        del sched, runner, pool
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out


def measure(model: str, device: torch.device, backend: str, reps: int, prompt_len: Optional[int], pool_dtype: str, seed: int) -> dict:
    """One model's case (see the module): medians, the first tokens, and what each hit fetched."""
    setup = Setup(model, device, prompt_len, pool_dtype, seed)
    namespace = f"bench ttft {model} seed {seed} {pool_dtype}"
    ex = _examples()
    with ex["StorageSite"](ex["StorageOptions"](backend)) as site, ex["rc"].cpu_threads(setup.cfg), torch.no_grad():

        def from_storage() -> dict:
            r = setup.serve(setup.host_tier(storage=site.open(namespace)))
            if r["storage_tokens"] <= 0:
                raise RuntimeError(f"the engine fetched nothing from storage ({r['cached_tokens']} tokens cached)")
            return r

        writer = setup.serve(setup.host_tier(storage=site.open(namespace)))  # computes the prompt, writes it through
        if writer["storage_tokens"]:
            raise RuntimeError(f"the writer found {writer['storage_tokens']} tokens in a fresh store")
        setup.serve(None), from_storage()  # untimed: compilation, allocator warm-up, page cache
        times: dict = {"recompute": [], "storage": []}
        last: dict = {}
        for _ in range(reps):
            for kind, run in (("recompute", lambda: setup.serve(None)), ("storage", from_storage)):
                last[kind] = run()
                times[kind].append(last[kind]["s"])
    recompute, storage = statistics.median(times["recompute"]), statistics.median(times["storage"])
    return dict(
        model=model, describe=setup.describe(), backend=backend, device=str(device), prompt_len=setup.prompt_len,
        reps=reps, recompute_s=recompute, storage_s=storage, speedup=recompute / storage,
        storage_tokens=last["storage"]["storage_tokens"], cached_tokens=last["storage"]["cached_tokens"],
        first_token_recompute=last["recompute"]["token"], first_token_storage=last["storage"]["token"],
        times=times,
    )  # fmt: skip


def run_cases(args: Any, rep: Any, models: list[str]) -> None:
    """bench_storage.py's ``--ttft`` cases into ``rep`` (a ``report.Report``), on the GPU where there
    is one (the runners' tiny shapes on a CPU)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    pool_dtype = "fp8_e4m3" if device.type == "cuda" else "fp32"
    rep.result.update(ttft=[], ttft_skipped=[])
    for model in models:
        if rep.over_budget(f"ttft {model}"):
            continue
        try:
            case = measure(model, device, args.ttft_storage, args.ttft_reps or (1 if args.cpu_smoke else 5),
                                        args.ttft_prompt_len, pool_dtype, seed=0)  # fmt: skip
        except Refused as exc:
            rep.result["ttft_skipped"].append(f"{model}: its prefix cache takes no storage tier ({exc})")
            rep.log(f"ttft {model}: skipped, its prefix cache takes no storage tier ({exc})")
            continue
        except Exception as exc:
            rep.error(f"ttft {model}", exc)
            continue
        rep.result["ttft"].append(case)
        rep.log(f"ttft {model}: from storage {1e3 * case['storage_s']:.1f} ms ({case['storage_tokens']} tokens fetched), "
                f"recompute {1e3 * case['recompute_s']:.1f} ms: {case['speedup']:.2f}x")  # fmt: skip
        rep.save()


def markdown(cases: list[dict], skipped: list[str]) -> list[str]:
    """The report's section for the ``ttft`` cases."""
    lines = ["## Time to first token: a repeated prompt from storage against recomputing it", "",
             "A fresh engine each time (nothing on the device or in host memory): its prompt's pages prefetched from storage, "
             "loaded host -> device, the tokens after the last whole page prefilled; against a prefill of the whole prompt "
             "without a cache. Wall time from the request's arrival to its first token; medians, the two timed in alternation.", "",
             "| model | storage | prompt tokens | from storage (tokens fetched) | recompute | speedup | first token: storage / recompute |",
             "|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for c in cases:
        same = "same" if c["first_token_storage"] == c["first_token_recompute"] else "differ"
        lines.append(f"| {c['describe']} | {c['backend']} | {c['prompt_len']} | {1e3 * c['storage_s']:.1f} ms ({c['storage_tokens']}) "
                     f"| {1e3 * c['recompute_s']:.1f} ms | {c['speedup']:.2f}x "
                     f"| {c['first_token_storage']} / {c['first_token_recompute']} ({same}) |")  # fmt: skip
    lines += [f"- skipped: {s}" for s in skipped]
    return lines + [""]
