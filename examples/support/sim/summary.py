"""serve_sim's summary of a run (``format_summary``)."""

from __future__ import annotations

from support.sim import calibration, sliding
from support.sim.config import HYBRID_MODEL, MLA_MODELS
from support.sim.formats import format_name
from support.sim.result import SimResult

def format_summary(res: SimResult) -> str:
    cfg = res.config
    allocator = "TokenToKVPoolAllocator"
    if cfg.page_size > 1:
        allocator = f"PagedTokenToKVPoolAllocator(page_size={cfg.page_size})"
    if res.swa is not None:
        allocator = f"SWATokenToKVPoolAllocator(page_size={cfg.page_size})"
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
    pool = (
        f"  pool            {res.pool_size} slots ({res.bytes_per_token} B/token, {2**30 // res.bytes_per_token:,} tokens/GiB, "
        f"{cfg.kv_budget_mib:g} MiB budget), "
        f"{cfg.max_running} request rows"
    )
    if res.swa is not None:
        shape, pool = sliding.shape_and_pool_lines(res)
    kv_layers = cfg.layers // 4 if cfg.model == HYBRID_MODEL else cfg.layers  # the layers that keep K/V
    lines = [
        f"kvpool serve_sim: {cfg.requests} requests, {cfg.layers} layers x {shape}, "
        f"{format_name(cfg)} pool on {res.device}, {allocator}, seed {cfg.seed}",
        pool,
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
        f"byte-equal to {'the reference quantizer, codes and scales' if cfg.scaled_format else 'kvpool.quantize'}"
    )
    if res.swa is not None:
        check += f" (sliding layers: the {res.swa.checked_tokens} tokens whose SWA rows they held, every window whole)"
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
    if res.swa is not None:
        lines += sliding.summary_lines(res)
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
        lines += calibration.format_calibration(res.calibration, parts)
    if not res.ok and cfg.corrupt:
        lines.append("  expected        --corrupt flipped one stored byte on purpose: the FAIL below is the check catching it")
    lines.append("PASS" if res.ok else "FAIL")
    return "\n".join(lines)
