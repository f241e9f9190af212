"""The Qwen3.5 runner's model and pools: its shapes (``QwenShape``, ``SHAPES``), the seeded
``Qwen3_5MoeForCausalLM``, the hybrid geometry (which layers are full attention), the KV and state
pools of a run (``make_pool``) and the scheduler that gives each request a state slot
(``HybridScheduler``). The layers that run over the pools are in ``support.runners.qwen35_layers``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvpool import HybridLinearKVPool, HybridReqToTokenPool, MambaCacheParams, MambaStateDType, MambaStateShape
from kvpool.checks import positive_int
from support.runners.config import RunConfig
from support.runners.formats import PoolFormat
from support.runners.scheduler import ForwardBatch, Request
from support.runners.verify import VerifyScheduling

try:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: F401  (what the layers call)
except ImportError as e:  # older transformers 5.x
    raise ImportError(
        "qwen35_runner needs a transformers with Qwen3.5 (qwen3_5_moe): pip install -U 'transformers>=5'"
    ) from e


# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class QwenShape:
    """The dimensions of a Qwen3.5-architecture (``qwen3_5_moe``) text model.

    Layer ``i`` is full attention iff ``(i + 1) % full_attention_interval == 0`` (3:1 linear:full at
    the default 4). Full attention: ``heads`` query / ``kv_heads`` KV heads of ``head_dim``, RoPE on the
    first ``partial_rotary * head_dim`` of each head. Gated DeltaNet: ``linear_k_heads`` key heads of
    ``linear_k_dim`` and ``linear_v_heads`` value heads of ``linear_v_dim``, convolution of
    ``conv_kernel`` taps over ``2 * key_dim + value_dim`` channels. MoE: ``experts`` routed experts of
    ``moe_intermediate`` (``experts_per_token`` per token) and a shared expert of ``shared_intermediate``.
    """

    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    linear_k_heads: int = 2
    linear_v_heads: int = 4
    linear_k_dim: int = 16
    linear_v_dim: int = 16
    conv_kernel: int = 4
    experts: int = 4
    experts_per_token: int = 2
    moe_intermediate: int = 32
    shared_intermediate: int = 32
    vocab: int = 128
    full_attention_interval: int = 4
    partial_rotary: float = 0.25
    rope_theta: float = 10000.0
    init_std: Optional[float] = None  # the weights' std (HF's initializer_range); None: 1 / sqrt(hidden)

    def __post_init__(self) -> None:
        for name in (
            "layers", "hidden", "heads", "kv_heads", "head_dim", "linear_k_heads", "linear_v_heads", "linear_k_dim",
            "linear_v_dim", "experts", "experts_per_token", "moe_intermediate", "shared_intermediate", "vocab",
            "full_attention_interval",
        ):  # fmt: skip
            positive_int(getattr(self, name), name)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads = {self.heads}, got {self.kv_heads}")
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(f"linear_k_heads must divide linear_v_heads = {self.linear_v_heads}, got {self.linear_k_heads}")
        if self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token must be at most experts = {self.experts}, got {self.experts_per_token}")
        if isinstance(self.conv_kernel, bool) or not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be an int >= 2, got {self.conv_kernel!r}")
        if not 2 <= self.full_attention_interval <= self.layers:
            raise ValueError(
                f"full_attention_interval must be in 2..layers = {self.layers} (at least one layer of each kind), "
                f"got {self.full_attention_interval}"
            )
        if self.init_std is not None and not self.init_std > 0:
            raise ValueError(f"init_std must be None or > 0, got {self.init_std}")
        rot = self.head_dim * self.partial_rotary
        if not (rot == int(rot) and rot >= 2 and int(rot) % 2 == 0):
            raise ValueError(
                f"partial_rotary * head_dim must be an even int >= 2 (RoPE rotates pairs), got {self.partial_rotary} "
                f"* {self.head_dim} = {rot:g}"
            )

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.layers)]

    def describe(self) -> str:
        full = self.layer_types.count("full_attention")
        return (
            f"{self.layers} layers ({self.layers - full} Gated DeltaNet, {full} gated attention), hidden "
            f"{self.hidden}, attention {self.heads} query / {self.kv_heads} KV heads x {self.head_dim} (RoPE on "
            f"{int(self.head_dim * self.partial_rotary)}), DeltaNet {self.linear_k_heads} key / {self.linear_v_heads} "
            f"value heads x {self.linear_k_dim}/{self.linear_v_dim}, conv {self.conv_kernel}, MoE {self.experts} "
            f"experts top-{self.experts_per_token} + shared, vocab {self.vocab}"
        )


SHAPES = {
    # Weights of std 0.025 (HF's default is 0.02) keep the current token's embedding strong in the
    # residual stream, so the layer-skipping draft agrees with the target on part of the tokens (random
    # weights offer nothing else to agree on), while a lost K/V row or a stale state still moves the
    # logits far beyond LOGIT_RTOL.
    "tiny": QwenShape(init_std=0.025),
    "small": QwenShape(
        layers=8, hidden=256, heads=8, kv_heads=2, head_dim=64, linear_k_heads=4, linear_v_heads=8, linear_k_dim=32,
        linear_v_dim=32, experts=8, moe_intermediate=64, shared_intermediate=64, vocab=512,
    ),
    # Qwen3.5-397B-A17B's attention (32 query / 2 KV heads x 256, RoPE on 64) and Gated DeltaNet
    # (16 key / 64 value heads x 128, conv 4) in 4 layers (3 linear, 1 full), small MoE and vocabulary.
    "397b-4layer": QwenShape(
        layers=4, hidden=4096, heads=32, kv_heads=2, head_dim=256, linear_k_heads=16, linear_v_heads=64,
        linear_k_dim=128, linear_v_dim=128, experts=8, moe_intermediate=256, shared_intermediate=256, vocab=2048,
    ),
}  # fmt: skip


def text_config(shape: QwenShape) -> Qwen3_5MoeTextConfig:
    """The HF text config of ``shape``. Weights are drawn with std ``shape.init_std``, by default
    ``1/sqrt(hidden)`` (unit-scale activations, attention far from uniform, as in the Llama runner);
    no token ends a sequence."""
    return Qwen3_5MoeTextConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_k_heads,
        linear_num_value_heads=shape.linear_v_heads,
        linear_key_head_dim=shape.linear_k_dim,
        linear_value_head_dim=shape.linear_v_dim,
        linear_conv_kernel_dim=shape.conv_kernel,
        num_experts=shape.experts,
        num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.moe_intermediate,
        shared_expert_intermediate_size=shape.shared_intermediate,
        layer_types=shape.layer_types,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default", "rope_theta": shape.rope_theta, "partial_rotary_factor": shape.partial_rotary
        },
        initializer_range=shape.init_std or shape.hidden**-0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(
    config: dict[str, Any], dtype: torch.dtype, device: str | torch.device, seed: int
) -> Qwen3_5MoeForCausalLM:
    """``Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))`` built in float32 on the CPU right
    after ``torch.manual_seed(seed)`` (what ``--json`` tells others to rebuild), then moved to
    ``device`` and ``dtype``. Its experts run HF's own loop (plain matmuls on any device and dtype,
    which ``grouped_mm`` is not); the weights are the same either way."""
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))
    model.set_experts_implementation("eager")
    return model.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class HybridGeometry:
    """What a Qwen3.5 model's KV pool must hold, and which layers are which."""

    kv_heads: int
    head_dim: int
    full_layers: tuple[int, ...]  # global ids of the full-attention layers
    linear_layers: tuple[int, ...]  # global ids of the Gated DeltaNet layers


def hybrid_geometry(model: Qwen3_5MoeForCausalLM) -> HybridGeometry:
    c = model.config
    return HybridGeometry(
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        full_layers=tuple(i for i, t in enumerate(c.layer_types) if t == "full_attention"),
        linear_layers=tuple(i for i, t in enumerate(c.layer_types) if t == "linear_attention"),
    )


# --- the pools ------------------------------------------------------------------------------------


@dataclass
class HybridPools:
    """The pools one engine process keeps for a hybrid model: ``kv``, a ``HybridLinearKVPool`` (the
    full-attention layers' K/V under global layer ids), and ``table``, a ``HybridReqToTokenPool`` (the
    request table, each request's state slot in ``table.mamba_pool``, a ``MambaPool``, which
    ``kv.mamba_pool`` names too). It stands where the shared code expects a KV pool: size, page size,
    dtype, device, path counts and calibration are the KV pool's."""

    kv: HybridLinearKVPool
    table: HybridReqToTokenPool

    def __getattr__(self, name: str) -> Any:  # size, page_size, dtype, device, stats, calibration
        return getattr(self.kv, name)


def state_params(model: Qwen3_5MoeForCausalLM) -> MambaCacheParams:
    """The state a ``MambaPool`` holds for ``model``'s linear layers: the window in the model's dtype
    (what HF's cache keeps), the recurrent state in float32."""
    c = model.config
    shape = MambaStateShape.gated_delta_net(
        num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads, head_k_dim=c.linear_key_head_dim,
        head_v_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
    )  # fmt: skip
    return MambaCacheParams(shape, hybrid_geometry(model).linear_layers, MambaStateDType(model.dtype, torch.float32))


def make_pool(
    cfg: RunConfig, model: Qwen3_5MoeForCausalLM, dtype: torch.dtype | PoolFormat, spec_steps: Optional[int] = None
) -> HybridPools:
    """A KV pool of ``dtype`` over the full-attention layers with room for ``cfg.batch`` of the longest
    requests, and a request table of ``cfg.batch`` rows with a state slot each (``spec_steps`` verify
    steps of scratch per batch position). With ``cfg.prefix_cache`` (and no ``spec_steps``) as many
    state slots again for the tree's snapshots, and with pages above one token two track slots per
    request (``enable_mamba_extra_buffer``). A ``PoolFormat`` gives the KV pool's full-attention
    part a scale per token and head (``kv_scale_mode="per_token_head"``) or SGLang's FP4 or NVFP4
    codes and block scales, its getters dequantizing to the model's dtype (not for a speculative run)."""
    g = hybrid_geometry(model)
    tracks = cfg.prefix_cache and spec_steps is None and cfg.page_size > 1
    states = cfg.batch if not cfg.prefix_cache else 2 * cfg.batch * (3 if tracks else 1)  # half for the tree's snapshots
    table = HybridReqToTokenPool(
        size=cfg.batch, mamba_size=states, max_context_len=cfg.max_context_len, device=cfg.device,
        cache_params=state_params(model), enable_mamba_extra_buffer=tracks, speculative_num_draft_tokens=spec_steps,
    )  # fmt: skip
    pages = cfg.batch * -(-cfg.max_context_len // cfg.page_size)
    kw: dict[str, Any] = {}
    if isinstance(dtype, PoolFormat):
        if spec_steps is not None:
            raise ValueError(f"dtype must be a torch dtype for a speculative run (its verify block is rounded as a "
                             f"plain or FP8 part stores it), got {dtype.name}")  # fmt: skip
        kw["out_dtype"] = next(model.parameters()).dtype  # the getters dequantize to the model's dtype
        if dtype.kind == "token_head":
            dtype, kw["kv_scale_mode"] = dtype.fp8, "per_token_head"  # type: ignore[assignment]
        else:  # SGLang's FP4 (exponent scales) or NVFP4 (global scales 1.0)
            kw["fp4_format"] = "fp4_mx_block16" if dtype.kind == "fp4" else "nvfp4"
            dtype = "fp4_e2m1"  # type: ignore[assignment]
    kv = HybridLinearKVPool(
        pages * cfg.page_size, dtype, cfg.page_size, g.kv_heads, g.head_dim, g.full_layers, False, cfg.device,
        table.mamba_pool, **kw,
    )  # fmt: skip
    return HybridPools(kv, table)


# --- the scheduler ---------------------------------------------------------------------------------


class HybridScheduler(VerifyScheduling):
    """The shared scheduler over a hybrid model's pools (each request holds a table row and a state
    slot), and (``verify_width``) verify steps in place of decode steps (``VerifyScheduling``): each
    decoding request gets ``min(verify_width, tokens it still makes)`` slots, for its last token and
    its drafts."""

    def __init__(
        self, pools: HybridPools, max_running: int, max_context_len: int, chunk_size: Optional[int],
        verify_width: Optional[int] = None,
    ) -> None:  # fmt: skip
        self.pools = pools
        super().__init__(pools, max_running, max_context_len, chunk_size)  # type: ignore[arg-type]
        self.verify_width = verify_width

    def _make_allocator(self, pool: HybridPools) -> Any:
        """The shared allocator over the ``HybridLinearKVPool`` itself (what a ``HiMambaRadixCache``
        finds its device pool through)."""
        return super()._make_allocator(pool.kv)

    def _make_table(self, max_running: int, max_context_len: int, device: torch.device) -> HybridReqToTokenPool:
        table = self.pools.table
        if max_context_len > table.max_context_len or max_running > table.size:
            raise ValueError(
                f"the pools' table has {table.size} rows of {table.max_context_len} tokens, the scheduler needs "
                f"{max_running} of {max_context_len}"
            )
        return table

    def _give_back_row(self, r: Request) -> None:
        self.table.free_mamba_cache(r.row)
        super()._give_back_row(r)

    def metadata(self, reqs: list[Request], *args: Any, **kwargs: Any) -> ForwardBatch:
        batch = super().metadata(reqs, *args, **kwargs)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=self.device)
        batch.state_slots = self.table.get_mamba_indices(rows).to(torch.int64)
        return batch

    def slots_in_use(self) -> int:
        state = self.table.mamba_pool
        return super().slots_in_use() + (state.size - state.available_size())
