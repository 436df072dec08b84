#!/usr/bin/env bash
# Builds the trace and safetensors readers' libFuzzer targets (clang, ASan + UBSan) in build-fuzz/ and
# runs each for a bounded time from a seed corpus (real trace excerpts, small safetensors files).
# Fails on any crash, sanitizer report or failed consistency check.
# Usage: tests/fuzz/run_fuzzers.sh [SECONDS_PER_TARGET] (default 8).
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-8}"
build="${EPMOE_FUZZ_BUILD_DIR:-build-fuzz}"
traces="$(pwd)/tests/data"
if ! command -v clang++ >/dev/null; then
  echo "run_fuzzers: clang++ not found (scripts/setup installs it)" >&2
  exit 1
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O1 -gline-tables-only" -DCMAKE_CXX_COMPILER=clang++ \
  -DEPMOE_FUZZ=ON -DEPMOE_BUILD_TESTS=OFF -DEPMOE_BUILD_BENCHMARKS=OFF >/dev/null
targets=(trace_binary_fuzz trace_flame_csv_fuzz trace_topk_csv_fuzz trace_jsonl_fuzz trace_expert_counts_csv_fuzz
         trace_sglang_json_fuzz trace_counts_csv_fuzz safetensors_file_fuzz)
cmake --build "$build" -j "${EPMOE_FUZZ_JOBS:-2}" --target trace_fuzz_seeds safetensors_fuzz_seeds "${targets[@]}"
corpus="$build/fuzz-corpus"
rm -rf "$corpus"
"$build/tests/fuzz/trace_fuzz_seeds" "$corpus" "$traces"
"$build/tests/fuzz/safetensors_fuzz_seeds" "$corpus"
for target in "${targets[@]}"; do
  mkdir -p "$corpus/$target"
  echo "run_fuzzers: $target for ${seconds}s"
  # Findings are written under $build/findings/; the log's last lines say what failed.
  mkdir -p "$build/findings"
  # A fixed seed and run count make a CI run repeatable: a finding shows up in every run until it is
  # fixed, not by chance. The time limit still bounds a slow machine.
  if ! "$build/tests/fuzz/$target" -seed=1 -runs="${EPMOE_FUZZ_RUNS:-40000}" -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
      -artifact_prefix="$build/findings/$target-" "$corpus/$target" >"$build/findings/$target.log" 2>&1; then
    tail -n 40 "$build/findings/$target.log" >&2
    echo "run_fuzzers: $target FAILED (log: $build/findings/$target.log)" >&2
    exit 1
  fi
  grep -E "^stat::number_of_executed_units" "$build/findings/$target.log" || true
done
echo "run_fuzzers: all ${#targets[@]} targets ran ${seconds}s each without findings"
