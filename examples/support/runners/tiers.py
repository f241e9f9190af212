"""The model runners' cache tiers below the device (``--prefix-cache --host-tier [--storage
file|mooncake]``) and their checks.

A pool's run with a host tier serves the prompts on a ``HiRadixCache`` (a ``HiMambaRadixCache`` for
a hybrid model, its state snapshots beside the KV) (support.runners.prefix), its host copies
written through to the storage backend. ``check`` then serves the same prompts on
fresh pools three more times: with no cache, with a device-only cache, and, with storage, as a
second engine (a fresh cache and host pool over the same store, as a restarted engine or another
one would be), whose prompts' prefixes come from storage: storage -> host -> device. The tokens of
both tiered engines must equal those of the other two runs (required for an fp32 model on an fp32
pool, whose greedy tokens the runner checks against transformers' exactly; reported for the others,
whose rounded K/V may fall the other way at a near-tie when computed in another batch), every engine's tree, allocator and host
pool must be consistent and given back, and without injected faults the second engine must have
loaded tokens from storage and from the host.

``--json PATH`` writes the runs' token checks and tier counters (``report_json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from support.runners.config import RunConfig
from support.runners.prefix import HostTier
from support.runners.results import Agreement, Report, ServeResult, compare
from support.storage import StorageSite, add_storage_arguments

#: Serves the run's prompts on a fresh pool: (prefix_cache, tiers) -> the serve's result.
ServeOn = Callable[[bool, Optional[HostTier]], ServeResult]


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    """``--host-tier`` and the storage options."""
    p.add_argument("--host-tier", action="store_true",
                   help="--prefix-cache: a HiRadixCache, whose nodes are backed up to host memory and loaded back")  # fmt: skip
    add_storage_arguments(p)


def site_for(cfg: RunConfig) -> Any:
    """The run's ``StorageSite`` as a context manager (a null one without ``--storage``)."""
    return StorageSite(cfg.storage) if cfg.storage is not None else contextlib.nullcontext(None)


def engine_tiers(cfg: RunConfig, site: Optional[StorageSite], namespace: str) -> Optional[HostTier]:
    """One engine's tiers (None without ``--host-tier``): a new backend on ``site`` under ``namespace``."""
    if not cfg.host_tier:
        return None
    return HostTier(storage=site.open(namespace) if site is not None else None)


@dataclass
class TierCheck:
    """A tiered pool run against the same prompts with no cache and with a device-only cache, and the
    second engine over the same store (None without storage)."""

    required: bool  # the tokens must be identical (an fp32 model on an fp32 pool)
    expect_hits: bool  # the second engine must load from storage and the host (storage, no faults)
    no_cache: ServeResult
    device_only: ServeResult
    second: Optional[ServeResult]
    agreements: dict[str, Agreement] = field(default_factory=dict)  # "engine 1 vs no cache", ...
    faults: dict[str, int] = field(default_factory=dict)  # injected this pool run, by kind

    @property
    def identical(self) -> bool:
        return all(a.identical for a in self.agreements.values())

    @property
    def hits(self) -> bool:
        s = self.second
        return s is not None and s.storage_loaded_tokens > 0 and s.host_loaded_tokens > 0

    @property
    def ok(self) -> bool:
        consistent = all(r.allocators_ok for r in (self.no_cache, self.device_only, self.second) if r is not None)
        return consistent and (self.identical or not self.required) and (self.hits or not self.expect_hits)


def check(cfg: RunConfig, first: ServeResult, serve_on: ServeOn, site: Optional[StorageSite], namespace: str,
          dtype: str, faults_before: dict[str, int]) -> TierCheck:  # fmt: skip
    """Serve the prompts with no cache, with a device-only cache and (with ``site``) as a second
    engine over the store ``first`` wrote to, and compare (see the module)."""
    none = serve_on(False, None)
    device = serve_on(True, None)
    second = serve_on(True, engine_tiers(cfg, site, namespace)) if site is not None else None
    required = dtype == "fp32" and cfg.model_dtype == "fp32"
    faulty = cfg.storage is not None and cfg.storage.faults > 0
    out = TierCheck(required, site is not None and not faulty, none, device, second)
    for name, run in (("engine 1", first), ("engine 2", second)):
        if run is not None:
            out.agreements[f"{name} vs no cache"] = compare(run.generations, none.generations)
            out.agreements[f"{name} vs a device-only cache"] = compare(run.generations, device.generations)
    if site is not None:
        now = site.faults()
        out.faults = {k: v - faults_before.get(k, 0) for k, v in now.items() if v != faults_before.get(k, 0)}
    return out


# --- the summary and --json ------------------------------------------------------------------------


def engine_line(label: str, s: ServeResult) -> str:
    line = (
        f"    {label:<11} {s.cached_tokens} of {s.prompt_tokens} prompt tokens cached: "
        f"{s.cached_tokens - s.host_loaded_tokens} on the device, {s.host_loaded_tokens} loaded back from the host "
        f"({s.storage_loaded_tokens} of them fetched from storage)"
    )
    if s.host_loaded_states is not None:
        line += f", with {s.host_loaded_states} state snapshots loaded back beside their KV"
    st = s.storage
    if st:
        line += (
            f"; storage: {st['pages_written']} pages written, {st['pages_read']} read, {st['write_failures']} write and "
            f"{st['prefetch_failures']} prefetch failures, {st['writes_skipped']} pages skipped backing off"
        )
        if "states_written" in st:  # a hybrid model's state snapshots, stored beside their KV
            line += f", {st['states_written']} state snapshots written, {st['states_read']} read"
    return line


def tier_lines(first: ServeResult, t: TierCheck) -> list[str]:
    """The summary's lines for one pool run's tiers."""
    lines = [engine_line("engine 1", first)]
    if t.second is not None:
        lines.append(engine_line("engine 2", t.second) + " (a fresh cache and host pool over the same store)")
    differ = [name for name, a in t.agreements.items() if not a.identical]
    if not differ:
        lines.append(f"    tiers       tokens identical: {', '.join(t.agreements)}")
    else:
        why = "FAILED" if t.required else "differ (reported only: a rounded K/V may fall the other way in another batch)"
        lines.append(f"    tiers       tokens {why}: {', '.join(differ)}")
    if t.expect_hits and not t.hits:
        lines.append("    tiers       FAILED: engine 2 loaded nothing from storage and the host")
    for name, r in (("no cache", t.no_cache), ("device-only cache", t.device_only), ("engine 2", t.second)):
        if r is not None and not r.allocators_ok:
            lines.append(f"    tiers       FAILED: the {name} run's allocators: {r.integrity_error or f'{r.leaked_slots} slots held'}")
    if t.faults:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(t.faults.items()))
        held = "; no data lost, every tree consistent" if t.ok else ""
        lines.append(f"    faults      {sum(t.faults.values())} injected into storage calls ({kinds}){held}")
    return lines


def _counters(s: ServeResult) -> dict[str, Any]:
    return {
        "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens, "host_loaded_tokens": s.host_loaded_tokens,
        "storage_loaded_tokens": s.storage_loaded_tokens, "host_loaded_states": s.host_loaded_states,
        "storage": dict(s.storage), "allocators_ok": s.allocators_ok,
    }  # fmt: skip


def report_json(rep: Report) -> dict[str, Any]:
    """The report's runs as JSON: each pool's token agreement with HF, cache counters and tier checks."""
    cfg = rep.config
    runs = []
    for r in rep.runs:
        entry: dict[str, Any] = {"dtype": r.dtype, "scales": r.scales, "tokens_identical_to_hf": r.vs_hf.identical,
                                 **_counters(r.result)}  # fmt: skip
        t = getattr(r, "tiers", None)
        if t is not None:
            entry["tiers"] = {
                "ok": t.ok, "tokens_required_identical": t.required,
                "tokens_identical": {name: a.identical for name, a in t.agreements.items()},
                "second_engine": _counters(t.second) if t.second is not None else None, "faults": dict(t.faults),
            }  # fmt: skip
        runs.append(entry)
    storage = dataclasses.asdict(cfg.storage) if cfg.storage is not None else None
    return {"program": rep.program, "model": rep.model_name, "seed": cfg.seed, "prefix_cache": cfg.prefix_cache,
            "host_tier": cfg.host_tier, "storage": storage, "ok": rep.ok, "runs": runs}  # fmt: skip


def write_json(rep: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report_json(rep), f, indent=1)
