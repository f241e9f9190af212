#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device tool:
#   bash scripts/gpu_check.sh [tests] [transfer] [first_call] [bench] [quick] [plans] [write_host]
#                             [host] [mla] [sim] [sim_mla] [llama] [deepseek] [llama_bench]
#                             [trace] [kernel_tests] [sim_calibrate]
#                             [transfer_tests] [transfer_bench] [probe_host] [host_bidir]
#                             [host_links] [host_kernel] [transfer_latency] [host_tests]
#                             [host_calls] [qwen] [qwen_bench] [state] [state_bench]
#                             [transfer_one_gpu] [transfer_direct]
# (default: tests transfer first_call bench host mla sim llama_bench). "tests" runs the whole suite
# on the GPU: the gpu-marked tests and every device-agnostic test with CUDA tensors, except the two-GPU transfer tests, which "transfer"
# runs (one at a time: each uses both GPUs) with the disaggregation example and its benchmark;
# "transfer_one_gpu" runs the one of them that needs a single GPU (two processes on it, direct path).
# Every step has a time limit (STEP_LIMIT seconds, default 420) so one hang cannot eat the call.
# Results go under $OUT (default ./gpu_out): gpu_check.log, bench.json, bench.md, bench.png (plans and
# write_host write theirs under $OUT/plans and $OUT/write_host).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on shared multi-GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages="${*:-tests transfer first_call bench host mla sim llama_bench}"
STEP_LIMIT="${STEP_LIMIT:-420}"
status=0

step() {  # step NAME CMD...: run, log, remember failures, keep going
  local name="$1"; shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  timeout "$STEP_LIMIT" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee -a "$LOG"

for stage in $stages; do
  case "$stage" in
    tests)
      # The GPU suite plus the device-agnostic suites, which run the compiled kernel on CUDA here.
      step tests python3 -m pytest -q -p no:cacheprovider -n 16 --durations=15 -rfEs tests/ \
        --deselect tests/test_gpu_transfer.py ;;
    transfer)
      step transfer_tests python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_gpu_transfer.py
      step disagg python3 examples/disagg_sim.py
      step disagg_qwen35 python3 examples/disagg_sim.py --model qwen3.5
      step transfer_bench python3 benchmarks/bench_transfer.py --out "$OUT" ;;
    transfer_one_gpu)  # sender and receiver as two processes on one GPU, through CUDA IPC
      step transfer_one_gpu python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_gpu_transfer.py -k one_gpu ;;
    transfer_direct)  # the direct path against the staged one and the NCCL ceiling, same run (two GPUs)
      step transfer_direct python3 benchmarks/bench_transfer.py --direct --out "$OUT/direct" ;;
    transfer_tests) step transfer_tests python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_gpu_transfer.py ;;
    transfer_bench) step transfer_bench python3 benchmarks/bench_transfer.py --out "$OUT" ;;
    probe_host) step probe_host python3 benchmarks/probe_transfer_host.py --out "$OUT" ;;
    host_bidir)
      step host_bidir python3 benchmarks/bench_host_tier.py --quick --stages bidirectional \
        --bidir-programs 8/16,16/16,16/32,32/32,32/64,64/64 --out "$OUT" ;;
    host) step host_bench python3 benchmarks/bench_host_tier.py --out "$OUT" ;;
    host_tests)  # the host tier's tests alone (GPU and CPU-pool ones, the MLA host pool's included)
      step host_tests python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs tests/test_host_tier.py \
        tests/test_serve_sim.py tests/test_mla.py -k "host or layer or Host" ;;
    host_calls) step host_calls python3 benchmarks/probe_host_calls.py --out "$OUT" ;;
    host_links) step host_links python3 benchmarks/probe_host_links.py --out "$OUT" ;;
    host_kernel)  # the kernel backend's transfers alone, wall and device time
      step host_kernel python3 benchmarks/bench_host_tier.py --backends kernel --stages transfers --out "$OUT/host_kernel" ;;
    transfer_latency) step transfer_latency python3 benchmarks/probe_transfer_latency.py --out "$OUT" ;;
    mla) step mla_bench python3 benchmarks/bench_mla.py --out "$OUT" ;;
    llama_bench) step llama_bench python3 benchmarks/bench_llama_runner.py --out "$OUT" ;;
    first_call) step first_call python3 benchmarks/first_call.py ;;
    sim) step sim python3 examples/serve_sim.py ;;
    llama) step llama python3 examples/llama_runner.py --config 8b-4layer --device cuda ;;
    deepseek) step deepseek python3 examples/deepseek_runner.py --config v3-mla --device cuda ;;
    qwen)  # the Qwen3.5 runner's GPU tests, then Qwen3.5-397B's layer geometry in bf16 with FP8 pools
      step qwen_tests python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_model_runners.py -k qwen
      step qwen python3 examples/qwen35_runner.py --config 397b-4layer --device cuda --model-dtype bf16 \
        --dtypes bf16 fp8_e4m3 --spec-dtypes bf16 fp8_e4m3 --page-size 64 ;;
    qwen_bench) step qwen_bench python3 benchmarks/bench_qwen35_runner.py --out "$OUT" ;;
    state)  # the state pools' tests on CUDA (MambaPool, hybrid pools, sizing)
      step state_tests python3 -m pytest -q -p no:cacheprovider -n 4 -rfEs tests/test_state_pool.py \
        tests/test_request_table.py tests/test_sizing.py tests/test_sglang_compat.py ;;
    state_bench) step state_bench python3 benchmarks/bench_state.py --out "$OUT" ;;
    sim_mla) step sim_mla python3 examples/serve_sim.py --model deepseek-v3 ;;
    bench) step bench python3 benchmarks/bench_set_kv.py --out "$OUT" ;;
    plans)  # the write's plan candidates against the one-program-per-token kernel and the ceiling
      STEP_LIMIT=600 step plans python3 benchmarks/bench_set_kv.py --sections plans --budget-s 540 --out "$OUT/plans" ;;
    write_host) step write_host python3 benchmarks/bench_set_kv.py --sections host --out "$OUT/write_host" ;;
    kernel_tests)  # the write's GPU tests alone (a quicker check than "tests")
      step kernel_tests python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs tests/test_write.py tests/test_write_oracle.py \
        tests/test_plans_and_launcher.py tests/test_launcher.py tests/test_calibration.py tests/test_compile.py tests/test_mla.py ;;
    sim_calibrate) step sim_calibrate python3 examples/serve_sim.py --calibrate ;;
    trace) step trace python3 benchmarks/trace_transfer.py --out "$OUT" ;;
    quick) step bench_quick python3 benchmarks/bench_set_kv.py --quick --out "$OUT" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
