#!/usr/bin/env bash
# Everything that needs a GPU, in four stages (default: tests bench examples):
#
#   tests     the whole suite on the GPU (the gpu-marked tests, and every device-agnostic test with
#             CUDA tensors) but the two-GPU transfer tests, then the transfer tests that run both
#             processes on one GPU; pytest -v output goes to $OUT/tests.log as it runs, so a run cut
#             short still names every test that finished and how.
#   bench     every one-GPU benchmark, one after another, each under its own time budget (--budget-s,
#             and a timeout a little past it): the write (host time, sizes, moves), the write's plan
#             sweep, its sliding-window layer, its FP4 / NVFP4 / per-token-head FP8 formats, the MLA
#             write, the host tier, the Llama and Qwen3.5 runners, the first call, the state pool, the
#             allocators (against SGLang's where its wheel is at $SGLANG_WHEEL, default
#             .sgl/sglang-0.5.9-py3-none-any.whl), the storage backends on this host's disk and cores,
#             and the time to first token from storage against recomputing.
#             Reports go to $WORK/bench/NAME.{json,md,png} and all of them into $OUT/bench.tar.gz.
#             The quick plan sweep takes under 10 minutes; FULL=1 runs the full one.
#   examples  the examples on CUDA: the serving simulation (MHA, MLA, hybrid, calibration), the
#             Llama, DeepSeek-V3, Qwen3.5, Gemma 3 and gpt-oss runners.
#   transfer  two GPUs: the transfer tests, the disaggregation example (Llama and Qwen3.5 geometries)
#             and the transfer benchmark, both paths (staged and CUDA IPC; reports into
#             $OUT/transfer.tar.gz).
#
# Usage: bash scripts/gpu_check.sh [tests] [bench] [examples] [transfer]
# $OUT (default ./gpu_out) receives at most gpu_check.log, tests.log and the two tarballs; $WORK
# (default ./gpu_work) holds the reports before they are packed. Time limits, so one hang cannot stop
# the rest: TESTS_LIMIT (default 420 s) for the suite, ONE_GPU_LIMIT (150 s) for the one-GPU transfer
# tests, STEP_LIMIT (420 s) for each example and transfer step; each benchmark gets its budget and a
# minute more.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check.sh: no CUDA device visible to python3's torch; run it on a GPU machine (the CPU tests: python -m pytest -q -rs -n auto)" >&2
  exit 1
fi
OUT="${OUT:-gpu_out}"
WORK="${WORK:-gpu_work}"
mkdir -p "$OUT" "$WORK"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on shared multi-GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP_LIMIT="${STEP_LIMIT:-420}"
TWO_GPU_TESTS="tests/test_gpu_transfer.py"
# Transfer tests whose two-GPU cases (NCCL, CUDA IPC) skip on one GPU; the transfer stage runs them.
TWO_GPU_CASES="tests/test_transfer_scaled_pools.py tests/test_swa_transfer_between_ranks.py"
status=0

step() {  # step NAME LIMIT CMD...: run under a time limit, log, remember a failure, go on
  local name="$1" limit="$2"; shift 2
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

bench() {  # bench NAME BUDGET SCRIPT ARGS...: one benchmark, its report under $WORK/bench/NAME.*
  local name="$1" budget="$2" script="$3"; shift 3
  step "bench $name" $((budget + 60)) python3 "benchmarks/$script" --out "$WORK/bench" --name "$name" --budget-s "$budget" "$@"
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee -a "$LOG"

for stage in ${*:-tests bench examples}; do
  case "$stage" in
    tests)  # the log, not the console, gets pytest's lines (one per test); its summary goes to both
      echo "=== tests ($(date -u +%H:%M:%S)): pytest -v, one line per test in $OUT/tests.log" | tee -a "$LOG"
      timeout "${TESTS_LIMIT:-420}" python3 -m pytest -v -p no:cacheprovider -n 16 -rfEs tests/ --deselect "$TWO_GPU_TESTS" \
        > "$OUT/tests.log" 2>&1
      rc=$?
      timeout "${ONE_GPU_LIMIT:-150}" python3 -m pytest -v -p no:cacheprovider -rfEs "$TWO_GPU_TESTS" -k one_gpu >> "$OUT/tests.log" 2>&1
      rc_one=$?
      [ "$rc" -ne 0 ] || rc=$rc_one
      grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | tee -a "$LOG"
      tail -n 5 "$OUT/tests.log" | tee -a "$LOG"
      echo "=== tests exit $rc$([ "$rc" -eq 124 ] && echo ' (time limit: tests.log lists every test that finished)')" | tee -a "$LOG"
      [ "$rc" -eq 0 ] || status=1 ;;
    bench)
      if [ "${FULL:-0}" = 1 ]; then quick=(); plans=(); else quick=(--quick); plans=(--quick); fi
      rm -rf "$WORK/bench"; mkdir -p "$WORK/bench"
      bench write 80 bench_write.py "${quick[@]}" --sections host,write,moves
      bench write-plans 70 bench_write.py "${plans[@]}" --sections host,plans
      bench write-swa 50 bench_write.py "${quick[@]}" --sections swa
      bench write-formats 120 bench_write.py "${quick[@]}" --sections formats
      bench mla 35 bench_mla.py "${quick[@]}"
      bench host-tier 90 bench_host_tier.py "${quick[@]}"
      bench runner-llama 45 bench_runner.py --model llama --batches 1 16 64 --steps 40 --warmup 5 --profile-steps 5
      bench runner-qwen3.5 45 bench_runner.py --model qwen3.5 --batches 1 8 --spec-widths 4 --steps 10 --warmup 2 --profile-steps 0
      bench first-call 30 bench_first_call.py
      bench state 25 bench_state.py
      sglang=(); [ -f "${SGLANG_WHEEL:-.sgl/sglang-0.5.9-py3-none-any.whl}" ] && sglang=(--sglang-wheel "${SGLANG_WHEEL:-.sgl/sglang-0.5.9-py3-none-any.whl}")
      bench allocators 150 bench_allocators.py "${quick[@]}" "${sglang[@]}"
      bench storage 90 bench_storage.py "${quick[@]}"
      bench storage-ttft 120 bench_storage.py --backends none --ttft llama,qwen3.5
      tar -czf "$OUT/bench.tar.gz" -C "$WORK" bench && echo "=== reports: $OUT/bench.tar.gz ($(ls "$WORK/bench" | wc -l) files)" | tee -a "$LOG" ;;
    examples)
      step serve_sim "$STEP_LIMIT" python3 examples/serve_sim.py
      step serve_sim_mla "$STEP_LIMIT" python3 examples/serve_sim.py --model deepseek-v3
      step serve_sim_qwen35 "$STEP_LIMIT" python3 examples/serve_sim.py --model qwen3.5
      step serve_sim_gpt_oss "$STEP_LIMIT" python3 examples/serve_sim.py --model gpt-oss --spec-decode 4
      step serve_sim_gemma3 "$STEP_LIMIT" python3 examples/serve_sim.py --model gemma3
      step serve_sim_calibrate "$STEP_LIMIT" python3 examples/serve_sim.py --calibrate
      step llama_runner "$STEP_LIMIT" python3 examples/llama_runner.py --config 8b-4layer --device cuda
      step deepseek_runner "$STEP_LIMIT" python3 examples/deepseek_runner.py --config v3-mla --device cuda
      step gemma3_runner "$STEP_LIMIT" python3 examples/gemma3_runner.py --config small --device cuda
      step gpt_oss_runner "$STEP_LIMIT" python3 examples/gpt_oss_runner.py --config small --device cuda
      step qwen35_runner "$STEP_LIMIT" python3 examples/qwen35_runner.py --config 397b-4layer --device cuda --model-dtype bf16 \
        --dtypes bf16 fp8_e4m3 --spec-dtypes bf16 fp8_e4m3 --page-size 64 ;;
    transfer)  # one test at a time: each uses both GPUs
      step transfer_tests "$STEP_LIMIT" python3 -m pytest -v -p no:cacheprovider -rfEs "$TWO_GPU_TESTS" $TWO_GPU_CASES
      step disagg "$STEP_LIMIT" python3 examples/disagg_sim.py
      step disagg_qwen35 "$STEP_LIMIT" python3 examples/disagg_sim.py --model qwen3.5
      rm -rf "$WORK/transfer"; mkdir -p "$WORK/transfer"
      step transfer_bench "$STEP_LIMIT" python3 benchmarks/bench_transfer.py --quick --out "$WORK/transfer"
      tar -czf "$OUT/transfer.tar.gz" -C "$WORK" transfer ;;
    *) echo "unknown stage $stage (stages: tests bench examples transfer)" | tee -a "$LOG"; status=1 ;;
  esac
done
exit $status
