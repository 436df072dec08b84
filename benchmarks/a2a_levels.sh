#!/bin/bash
# Flat against two-level a2a exchange (docs/architecture.md, "The a2a exchange", "Levels: flat and
# two levels"): `epmoe run --option a2a` on 4 ranks modeled as 2 nodes of 2 (--ranks-per-node 2), at
# T = 16 (decode) and T = 256 (prefill chunk), outputs one per pick and with --partial-sums.
# Experts are small (hidden 2048, intermediate 128, fp32) so that the exchange is a visible part of
# the step. The two levels of a configuration run back to back, REPEATS times (the machine is
# noisy); the table gives the median over the repeats of each run's median step time, dispatch and
# combine time (mean over ranks), and bytes sent per rank and step, all and to the other node.
# On one machine every "link" is shared memory, so the bytes are what carries over to a cluster.
# Usage: benchmarks/a2a_levels.sh [BUILD_DIR] [REPEATS]   (BUILD_DIR holds epmoe; default build, 3)
set -euo pipefail
BUILD=${1:-build}
REPEATS=${2:-3}
BIN=$(realpath "$BUILD/epmoe")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
RUN="mpirun --oversubscribe --bind-to none -np 4 $BIN run --option a2a --ranks-per-node 2 --hidden 2048
  --intermediate 128 --layers 2 --steps 20 --no-progress --format json"

for tokens in 16 256; do
  for combine in per-pick partial; do
    flag=""
    [ "$combine" = partial ] && flag=--partial-sums
    for repeat in $(seq "$REPEATS"); do
      for levels in flat two-level; do
        $RUN --tokens "$tokens" --a2a-levels "$levels" $flag > "$WORK/$tokens.$combine.$levels.$repeat.json"
      done
    done
  done
done

python3 - "$WORK" <<'PY'
import glob, json, os, statistics, sys
work = sys.argv[1]
print("| T | outputs back | levels | step ms | dispatch ms | combine ms | sent per rank | to the other node |")
print("|---|---|---|---|---|---|---|---|")
for tokens in (16, 256):
    for combine in ("per-pick", "partial"):
        for levels in ("flat", "two-level"):
            runs = [json.load(open(f))["options"][0]
                    for f in sorted(glob.glob(os.path.join(work, f"{tokens}.{combine}.{levels}.*.json")))]
            med = lambda values: statistics.median(values)
            step = med([r["step_ms_median"] for r in runs])
            dispatch = med([r["stage_ms_median"]["dispatch"] for r in runs])
            combine_ms = med([r["stage_ms_median"]["combine"] for r in runs])
            sent = med([r["bytes_sent_per_rank_step"] for r in runs]) / 1e3
            inter = med([r["inter_node_bytes_sent_per_rank_step"] for r in runs]) / 1e3
            print(f"| {tokens} | {combine} | {levels} | {step:.1f} | {dispatch:.1f} | {combine_ms:.1f} | "
                  f"{sent:.0f} KB | {inter:.0f} KB |")
PY
