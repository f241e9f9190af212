"""KV transfer between ranks on CPU pools over gloo (docs/contract.md, "KV transfer between ranks").

The spawned tests run many cases per process group (startup dominates): every byte of every moved
row, nothing else in either pool changed, the same error on both ranks for every mismatch and bad
argument, and the pair still in step afterwards; also through the row-copy kernel (interpreted),
re-sharding between tensor-parallel sizes on three ranks, and hybrid models whose linear-attention
state moves with the KV.
"""

from __future__ import annotations

from dataclasses import replace

from kvpool.transfer.wire import chunk_plan
from kvassert import needs_interpreter
from transfer_ranks import Case, Side, StateGeom, check_outcomes, run_cases, with_side


# --- two ranks over gloo -------------------------------------------------------------------------------------

BASE = Side()  # fp8 e4m3, 3 layers x 4 heads x 32, 200 slots, page 1: 768 bytes a token
SMALL_CHUNKS = with_side(BASE, chunk_bytes=8 * 768)  # 8 tokens a chunk: many chunks
P16 = with_side(BASE, size=256, page_size=16)


def _pair(sender: Side, receiver: Side, **kw) -> dict:
    return dict(sides={0: sender, 1: receiver}, transfers=[(0, 1)], **kw)


def _ok(name: str, sender: Side, receiver: Side, **kw) -> Case:
    return Case(name, **_pair(sender, receiver), **kw)


def _fails(name: str, error: str, text: str, sender: Side = BASE, receiver: Side = BASE, **kw) -> Case:
    return Case(name, **_pair(sender, receiver), expect=(error, text), **kw)


def _as(dtype: str, side: Side = BASE, **changes) -> Side:
    return with_side(side, dtype=dtype, **changes)


ODD = Side(dtype="bf16", layers=2, start_layer=5, heads=3, head_dim=96, v_head_dim=64, size=50, page_size=4)
ODD_P16 = with_side(ODD, page_size=16, size=64)
SENDER_HAS = "mismatch: the sender's pool has "
# MLA pools (DeepSeek-V3's 512 + 64 rows; an odd 40 + 24 one): one head, the latent part as K, the
# rotary part as V.
MLA = Side(mla=True, layers=2, heads=1, head_dim=512, v_head_dim=64, size=100)
MLA_SMALL_CHUNKS = with_side(MLA, chunk_bytes=8 * 2 * 576)
MLA_P16 = with_side(MLA, size=112, page_size=16)
MLA_ODD = Side(mla=True, dtype="bf16", layers=2, start_layer=5, heads=1, head_dim=40, v_head_dim=24, size=50)
TWO_RANK_CASES = [
    _ok("fp8_many_chunks_page1_to_page16", SMALL_CHUNKS, P16),
    _ok("bf16_odd_geometry_layers_5_6", ODD, ODD_P16, tokens=7),
    _ok("fp32_one_token", _as("fp32"), _as("fp32"), tokens=1),
    _ok("e5m2_no_tokens", _as("fp8_e5m2"), _as("fp8_e5m2"), tokens=0),
    _ok("fp16_int32_loc_sender_repeats_slots", _as("fp16"), _as("fp16", chunk_bytes=5 * 1536),
        loc_dtype="int32", duplicates=True),  # fmt: skip
    _ok("numpy_loc", BASE, BASE, loc_dtype="numpy"),
    _ok("whole_pool_every_slot", with_side(BASE, size=63), with_side(SMALL_CHUNKS, size=63), tokens=64),
    Case("rank1_sends_to_rank0", sides={0: P16, 1: SMALL_CHUNKS}, transfers=[(1, 0)]),
    Case("three_in_a_row_both_ways", sides={0: SMALL_CHUNKS, 1: BASE}, transfers=[(0, 1), (1, 0), (0, 1)]),
    _fails("dtype", "ValueError", "dtype " + SENDER_HAS + "dtype=torch.float8_e4m3fn, the receiver's has "
           "dtype=torch.bfloat16", receiver=_as("bf16")),  # fmt: skip
    _fails("layer_count", "ValueError", "layers " + SENDER_HAS + "layers=[0, 2], the receiver's has layers=[0, 1]",
           receiver=with_side(BASE, layers=2)),  # fmt: skip
    _fails("start_layer", "ValueError", "layers mismatch", receiver=with_side(BASE, start_layer=1)),
    _fails("head_dim", "ValueError", "head_dim " + SENDER_HAS + "head_dim=32, the receiver's has head_dim=64",
           receiver=with_side(BASE, head_dim=64)),  # fmt: skip
    _fails("v_head_dim", "ValueError", "v_head_dim mismatch", receiver=with_side(BASE, v_head_dim=16)),
    _fails("head_count", "ValueError", "total_heads " + SENDER_HAS + "total_heads=4, the receiver's has "
           "total_heads=2", receiver=with_side(BASE, heads=2)),  # fmt: skip
    _fails("token_count", "ValueError", "tokens " + SENDER_HAS + "tokens=37, the receiver's has tokens=36",
           recv_tokens=36),  # fmt: skip
    _fails("both_send", "ValueError", "role mismatch: rank 0 is a sender and rank 1 is a sender",
           tamper={1: "as_sender"}),  # fmt: skip
    _fails("both_receive", "ValueError", "role mismatch", tamper={0: "as_receiver"}),
    _fails("sender_slot_past_the_end", "IndexError", "the sender's loc[18] = 201 is outside its pool's slots [0, 201)",
           tamper={0: "oob"}),  # fmt: skip
    _fails("receiver_negative_slot", "IndexError", "the receiver's loc[0] = -1 is outside its pool's slots [0, 272)",
           receiver=P16, tamper={1: "neg"}),  # fmt: skip
    _fails("receiver_float_loc", "ValueError", "the receiver's loc must be int32 or int64, got torch.float32",
           tamper={1: "float"}),  # fmt: skip
    _fails("sender_2d_loc", "ValueError", "the sender's loc must be 1-D [T], got shape (1, 37)", tamper={0: "2d"}),
    _fails("sender_list_loc", "TypeError", "got list", tamper={0: "list"}),
    _fails("receiver_device_loc", "ValueError", "host indices", tamper={1: "cuda"}),
    _ok("mla_fp8_deepseek_rows_many_chunks_page1_to_page16", MLA_SMALL_CHUNKS, MLA_P16),
    _ok("mla_bf16_odd_rows_layers_5_6", MLA_ODD, with_side(MLA_ODD, page_size=4, size=60), tokens=9),
    _fails("mla_kv_lora_rank", "ValueError", "head_dim " + SENDER_HAS + "head_dim=512, the receiver's has head_dim=256",
           sender=MLA, receiver=with_side(MLA, head_dim=256)),  # fmt: skip
    _fails("bad_slot_reported_before_geometry", "IndexError", "the sender's loc[18]", receiver=_as("bf16"),
           tamper={0: "oob"}),  # fmt: skip
    _ok("still_in_step_after_the_errors", SMALL_CHUNKS, P16),
]


def test_two_ranks_move_exact_bytes_and_fail_alike(tmp_path):
    outcomes = run_cases(TWO_RANK_CASES, world=2, out=tmp_path)
    check_outcomes(TWO_RANK_CASES, outcomes, world=2)
    multi = outcomes[1]["fp8_many_chunks_page1_to_page16"]["transfers"][0]
    assert multi["tokens"] == 37 and multi["nbytes"] == 37 * 768, multi
    assert multi["chunks"] == len(chunk_plan(37, 8)) >= 3, multi  # both staging halves reused
    assert outcomes[0]["e5m2_no_tokens"]["transfers"][0]["chunks"] == 0


KERNEL_CASES = [  # the Triton kernel (interpreted) on the staging bands and head-sliced pool tables
    _ok("kernel_fp8_many_chunks", SMALL_CHUNKS, P16, tokens=21),
    _ok("kernel_bf16_odd_geometry", ODD, ODD_P16, tokens=5),
    _ok("kernel_mla_fp8_rows", MLA_SMALL_CHUNKS, MLA_P16, tokens=11),
    _ok("kernel_heads_2_to_4_of_4", BASE, Side(heads=2, head_start=2, total_heads=4, chunk_bytes=4 * 384), tokens=9),
]


@needs_interpreter
def test_two_ranks_through_the_copy_kernel(tmp_path):
    outcomes = run_cases(KERNEL_CASES, world=2, out=tmp_path, kernel=True)
    check_outcomes(KERNEL_CASES, outcomes, world=2)


# --- three ranks: tensor-parallel re-sharding --------------------------------------------------------------

FULL = Side(heads=4, total_heads=4, chunk_bytes=6 * 768)
LOW = Side(heads=2, head_start=0, total_heads=4, page_size=16, size=256)
HIGH = Side(heads=2, head_start=2, total_heads=4, chunk_bytes=3 * 384)
TP2 = {1: LOW, 2: HIGH}
RESHARD_CASES = [
    Case("tp1_to_tp2", sides={0: FULL, **TP2}, transfers=[(0, 1), (0, 2)]),
    Case("tp2_to_tp1_same_slots", sides={0: with_side(FULL, page_size=16, size=256), **TP2},
         transfers=[(1, 0), (2, 0)], same_slots=True),  # fmt: skip
    Case("partial_overlap_heads_1_to_3", transfers=[(0, 2)],
         sides={0: Side(heads=3, head_start=1, total_heads=4), 2: Side(heads=2, head_start=0, total_heads=4)}),  # fmt: skip
    Case("subgroup_0_2", sides={0: LOW, 2: with_side(FULL, chunk_bytes=None)}, transfers=[(0, 2)], group=(0, 2)),
    Case("disjoint_heads", sides=TP2, transfers=[(1, 2)],
         expect=("ValueError", "heads " + SENDER_HAS + "heads=[0, 2], the receiver's has heads=[2, 4]")),  # fmt: skip
    Case("model_head_count", sides={0: FULL, 2: with_side(HIGH, total_heads=8)}, transfers=[(0, 2)],
         expect=("ValueError", "total_heads mismatch")),  # fmt: skip
    Case("tp1_to_tp2_again", sides={0: FULL, **TP2}, transfers=[(0, 2), (0, 1)]),
]


def test_three_ranks_reshard_heads_between_tp_sizes(tmp_path):
    outcomes = run_cases(RESHARD_CASES, world=3, out=tmp_path)
    check_outcomes(RESHARD_CASES, outcomes, world=3)
    sent = outcomes[0]["tp1_to_tp2"]["transfers"]
    assert [t["heads"] for t in sent] == [[0, 2], [2, 4]]
    assert outcomes[2]["partial_overlap_heads_1_to_3"]["transfers"][0]["heads"] == [1, 2]


# --- hybrid models: the linear-attention state -----------------------------------------------------------

G = StateGeom()  # GDN bands "kkv": 2 key heads x 8, 4 value heads x 4, conv (48, 3) bf16, SSM (4, 4, 8) fp32
HYB = Side(state=G, size=120)  # 3 full-attention layers (3, 7, 11) beside the 5 linear ones
WHOLE = with_side(HYB, state=replace(G, bands=None))
# 1 KiB chunks: one token (768 bytes) or one layer's conv window and SSM state (288 + 512) each.
HYB_SMALL = with_side(HYB, chunk_bytes=1024)
WHOLE_SMALL = with_side(WHOLE, chunk_bytes=1024)
MAMBA2_SIDE = with_side(HYB, state=replace(G, bands="vkk", conv_dtype="fp16", ssm_dtype="bf16"))
ODD_STATE = with_side(HYB, state=replace(G, k_heads=1, v_heads=3, k_dim=5, v_dim=3, conv_kernel=2, slots=7,
                                         linear=(0, 2, 5, 9)))  # fmt: skip


def _state_pair(name: str, sender: Side, receiver: Side, **kw) -> Case:
    kw.setdefault("states", 3)
    return Case(name, **_pair(sender, receiver), **kw)


HYBRID_CASES = [
    _state_pair("whole_state_many_chunks", WHOLE_SMALL, with_side(WHOLE, page_size=4), tokens=21),
    _state_pair("gdn_bands_many_chunks", HYB_SMALL, with_side(HYB, page_size=16, size=128), tokens=13),
    _state_pair("mamba2_bands_fp16_conv_bf16_ssm", MAMBA2_SIDE, MAMBA2_SIDE, states=1),
    _state_pair("odd_state_geometry", ODD_STATE, ODD_STATE, states=8, tokens=5),
    _state_pair("states_only_no_tokens", HYB, HYB, tokens=0, states=2),
    _state_pair("kv_only_between_hybrid_pools", HYB, HYB, states=0),
    Case("hybrid_both_ways", sides={0: HYB_SMALL, 1: HYB}, transfers=[(0, 1), (1, 0)], states=2),
    _fails("conv_dtype", "ValueError", "conv_dtype " + SENDER_HAS + "conv_dtype=torch.bfloat16, the receiver's "
           "has conv_dtype=torch.float16", HYB, with_side(HYB, state=replace(G, conv_dtype="fp16")), states=1),  # fmt: skip
    _fails("ssm_dtype", "ValueError", "ssm_dtype mismatch", HYB, with_side(HYB, state=replace(G, ssm_dtype="bf16")),
           states=1),  # fmt: skip
    _fails("linear_layers", "ValueError", "linear_layers " + SENDER_HAS + "linear_layers=5 ids in [0, 5], the "
           "receiver's has linear_layers=4 ids in [0, 5]", HYB, with_side(HYB, state=replace(G, linear=(0, 1, 4, 5))),
           states=1),  # fmt: skip
    _fails("conv_bands", "ValueError", "conv_bands " + SENDER_HAS + "conv_bands=('kkv',), the receiver's has "
           "conv_bands=None", HYB, WHOLE, states=1),  # fmt: skip
    _fails("ssm_head_dim", "ValueError", "ssm_k_head_dim mismatch", HYB, with_side(HYB, state=replace(G, k_dim=4)),
           states=1),  # fmt: skip
    _fails("whole_conv_shape", "ValueError", "conv " + SENDER_HAS + "conv=[(48, 3)], the receiver's has "
           "conv=[(48, 2)]", WHOLE, with_side(WHOLE, state=replace(WHOLE.state, conv_kernel=3)), states=1),  # fmt: skip
    _fails("state_count", "ValueError", "states " + SENDER_HAS + "states=3, the receiver's has states=2",
           HYB, HYB, states=3, recv_states=2),  # fmt: skip
    _fails("states_to_a_pool_without_state", "ValueError", "states mismatch: the sender's pool has states=2, the "
           "receiver's has states=0 (slots in state_slots); the receiver's pool has no linear-attention state",
           HYB, Side(hybrid=True), states=2, tokens=4),  # fmt: skip
    _fails("state_slots_for_a_plain_pool", "ValueError", "the receiver's state_slots need a pool with "
           "linear-attention state", BASE, BASE, tamper={1: "state_given"}),  # fmt: skip
    _fails("sender_state_slot_past_the_end", "IndexError", "the sender's state_slots[2] = 13 is outside its state "
           "pool's slots [0, 13)", HYB, HYB, states=3, tamper={0: "state_oob"}),  # fmt: skip
    _fails("receiver_negative_state_slot", "IndexError", "the receiver's state_slots[0] = -1", HYB, HYB, states=3,
           tamper={1: "state_neg"}),  # fmt: skip
    _fails("receiver_float_state_slots", "ValueError", "the receiver's state_slots must be int32 or int64, got "
           "torch.float32", HYB, HYB, states=3, tamper={1: "state_float"}),  # fmt: skip
    _fails("hybrid_layer_ids_against_consecutive_ones", "ValueError", "layers " + SENDER_HAS + "layers=3 ids in "
           "[3, 11], the receiver's has layers=9 ids in [3, 11] (the KV layer ids differ)", HYB,
           Side(layers=9, start_layer=3), tokens=4),  # fmt: skip
    _state_pair("hybrid_still_in_step", HYB_SMALL, HYB, states=2),
]


def test_two_ranks_move_states_with_the_kv_and_fail_alike(tmp_path):
    outcomes = run_cases(HYBRID_CASES, world=2, out=tmp_path)
    check_outcomes(HYBRID_CASES, outcomes, world=2)
    many = outcomes[1]["whole_state_many_chunks"]["transfers"][0]
    assert many["states"] == 3 and many["state_nbytes"] == 3 * 5 * (288 + 512), many
    assert many["nbytes"] == 21 * 768 + many["state_nbytes"], many
    assert many["chunks"] == 21 + 5 * 3, many  # 1 token a chunk; one layer's (conv, SSM) of one slot a chunk
    only = outcomes[0]["states_only_no_tokens"]["transfers"][0]
    assert only["tokens"] == 0 and only["states"] == 2 and only["chunks"] >= 1, only
    assert outcomes[1]["kv_only_between_hybrid_pools"]["transfers"][0]["state_nbytes"] == 0
    assert all(t["path"] == "staged" and "host memory" in t["path_reason"] for o in outcomes
               for c in o.values() if c.get("outcome") == "ok" for t in c["transfers"])  # fmt: skip


HYBRID_KERNEL_CASES = [  # state bands and staging through the Triton kernel (interpreted)
    _state_pair("kernel_gdn_bands_many_chunks", HYB_SMALL, with_side(HYB, page_size=4), tokens=5, states=2),
    _state_pair("kernel_whole_state", WHOLE, WHOLE, tokens=3, states=2),
]


@needs_interpreter
def test_two_ranks_move_states_through_the_copy_kernel(tmp_path):
    outcomes = run_cases(HYBRID_KERNEL_CASES, world=2, out=tmp_path, kernel=True)
    check_outcomes(HYBRID_KERNEL_CASES, outcomes, world=2)


# Tensor-parallel re-sharding of the state: 4 key heads x 8 and 8 value heads x 4 in all, GDN bands.
SG_FULL = replace(G, k_heads=4, v_heads=8)
SG_LOW = replace(G, k_heads=2, v_heads=4, total_k=4, total_v=8)
SG_HIGH = replace(SG_LOW, k_start=2, v_start=4, slots=9)
S_FULL, S_LOW, S_HIGH = Side(state=SG_FULL, size=120), Side(state=SG_LOW, size=120), Side(state=SG_HIGH, size=120)
# Two key heads over four ranks: each rank holds the key head its two value heads use.
SG_REPL = replace(G, k_heads=2, v_heads=8, total_k=2, total_v=8)
SG_R1 = replace(G, k_heads=1, v_heads=2, v_start=2, k_start=0, total_k=2, total_v=8)
SG_R2 = replace(SG_R1, v_start=4, k_start=1)
M2 = replace(SG_FULL, bands="vkk")
STATE_RESHARD_CASES = [
    Case("state_tp1_to_tp2_with_kv_heads", sides={0: with_side(S_FULL, heads=4),
         1: with_side(S_LOW, heads=2, total_heads=4), 2: with_side(S_HIGH, heads=2, head_start=2, total_heads=4)},
         transfers=[(0, 1), (0, 2)], states=3, tokens=11),  # fmt: skip
    Case("state_tp2_to_tp1_same_slots", sides={0: S_FULL, 1: S_LOW, 2: S_HIGH}, transfers=[(1, 0), (2, 0)],
         states=2, same_slots=True),  # fmt: skip
    Case("state_mamba2_tp1_to_tp2", sides={0: Side(state=M2), 1: Side(state=replace(SG_LOW, bands="vkk")),
         2: Side(state=replace(SG_HIGH, bands="vkk"))}, transfers=[(0, 1), (0, 2)], states=2),  # fmt: skip
    Case("state_replicated_key_heads", sides={0: Side(state=SG_REPL), 1: Side(state=SG_R1), 2: Side(state=SG_R2)},
         transfers=[(0, 1), (0, 2), (1, 0)], states=2, tokens=3),  # fmt: skip
    Case("state_disjoint_value_heads", sides={1: S_LOW, 2: S_HIGH}, transfers=[(1, 2)], states=1,
         expect=("ValueError", "v_heads " + SENDER_HAS + "v_heads=[0, 4], the receiver's has v_heads=[4, 8]")),  # fmt: skip
    Case("state_model_value_heads", sides={0: S_FULL, 2: with_side(S_HIGH, state=replace(SG_HIGH, total_v=16))},
         transfers=[(0, 2)], states=1, expect=("ValueError", "total_v_heads mismatch")),  # fmt: skip
    Case("state_tp1_to_tp2_again", sides={0: S_FULL, 1: S_LOW, 2: S_HIGH}, transfers=[(0, 2), (0, 1)], states=1),
]


def test_three_ranks_reshard_the_state_between_tp_sizes(tmp_path):
    outcomes = run_cases(STATE_RESHARD_CASES, world=3, out=tmp_path)
    check_outcomes(STATE_RESHARD_CASES, outcomes, world=3)
    sent = outcomes[0]["state_tp1_to_tp2_with_kv_heads"]["transfers"]
    # Half the key and value heads of each layer: (2 x 8 q + 2 x 8 k + 4 x 4 v channels) x 3 columns x
    # 2 bytes of convolution window and 4 x 4 x 8 x 4 bytes of SSM state, 5 layers, 3 slots.
    assert [t["state_nbytes"] for t in sent] == [3 * 5 * (288 + 512)] * 2, sent
