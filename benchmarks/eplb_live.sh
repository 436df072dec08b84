#!/bin/bash
# Live rebalancing benchmark (docs/eplb.md, "Live rebalancing"): `epmoe run --option a2a` on 4 ranks
# with EPLB off and on, over
#   1. a drifting synthetic load: zipf popularity (s = 1) whose popular set changes every 200 steps,
#      800 steps of 64 rows, OLMoE's routing shape (64 experts, top-8), 4 MoE layers;
#   2. FLAME-MoE-290M's 10 recorded decode steps (64 rows, top-6) replayed 40 times (400 steps),
#      8 MoE layers, from ../shared/data/traces (read in place, never copied into the repository).
# Experts are benchmark-sized (hidden 512, intermediate 256, bf16). Prints one line per run.
# Usage: benchmarks/eplb_live.sh [BUILD_DIR]   (BUILD_DIR holds the epmoe binary; default build)
set -euo pipefail
BUILD=${1:-build}
BIN=$(realpath "$BUILD/epmoe")
HERE=$(cd "$(dirname "$0")/.." && pwd)
TRACES=${EPMOE_TRACES:-$HERE/../shared/data/traces}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
RUN="mpirun --oversubscribe --bind-to none -np 4 $BIN run --option a2a --weight-format bf16 --no-progress --format json"

"$BIN" trace gen "$WORK/drift.trace" --model olmoe-1b-7b --layers 4 --dist zipf --zipf-s 1.0 --drift-every 200 \
  --steps 800 --batch 64 > /dev/null
"$BIN" trace convert "$TRACES/flame_moe_290m/decode_64seqs_pos1-10" "$WORK/flame.jsonl" > /dev/null
python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
lines = open(f"{work}/flame.jsonl").read().splitlines()
with open(f"{work}/flame_loop.jsonl", "w") as out:
    out.write(lines[0] + "\n")
    records = [json.loads(line) for line in lines[1:]]
    for repeat in range(40):
        for record in records:
            out.write(json.dumps(dict(record, step=record["step"] + 10 * repeat), separators=(",", ":")) + "\n")
json.dump({"name": "flame-moe-290m-like", "description": "FLAME-MoE-290M's routing shape, benchmark-sized experts",
           "hidden": 512, "num_experts": 64, "expert_intermediate": 256, "top_k": 6, "num_shared_experts": 0,
           "shared_intermediate": 0, "num_layers": 8, "num_dense_layers": 0, "dense_intermediate": 0,
           "scoring": "softmax", "correction_bias": False, "num_expert_groups": 1, "topk_groups": 1,
           "renormalize": False, "routed_scaling": 1.0}, open(f"{work}/flame.json", "w"))
PY

DRIFT="--model olmoe-1b-7b --hidden 512 --intermediate 256 --trace $WORK/drift.trace --steps 800 --layers 4"
FLAME="--model $WORK/flame.json --trace $WORK/flame_loop.jsonl --steps 400 --layers 8"
EPLB="--eplb --eplb-interval 50 --eplb-redundant 4 --eplb-policy deepseek-guarded"
$RUN $DRIFT > "$WORK/drift_off.json"
$RUN $DRIFT $EPLB > "$WORK/drift_interval.json"
$RUN $DRIFT $EPLB --eplb-trigger threshold --eplb-threshold 0.9 > "$WORK/drift_threshold.json"
$RUN $DRIFT $EPLB --eplb-trigger threshold --eplb-threshold 0.9 --eplb-async --eplb-layers-per-chunk 1 \
  > "$WORK/drift_threshold_async.json"
$RUN $FLAME > "$WORK/flame_off.json"
$RUN $FLAME $EPLB --eplb-window 50 > "$WORK/flame_interval.json"
$RUN $FLAME $EPLB --eplb-window 50 --eplb-async --eplb-layers-per-chunk 2 > "$WORK/flame_interval_async.json"

python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
for name in ["drift_off", "drift_interval", "drift_threshold", "drift_threshold_async", "flame_off", "flame_interval",
             "flame_interval_async"]:
    o = json.load(open(f"{work}/{name}.json"))["options"][0]
    line = (f"{name:22s} step ms median {o['step_ms_median']:6.2f} p90 {o['step_ms_p90']:6.2f}  "
            f"balancedness picks {o['balancedness_picks']:.3f} bytes {o['balancedness_bytes']:.3f}")
    if "eplb" in o:
        e = o["eplb"]
        rs = e["rebalances"]
        moving = [r for r in rs if r["bytes_moved"] > 0]
        stalls = sorted(r["stall_ms_max_rank"] for r in rs)
        line += (f"  rebalances {len(rs)} at steps {[r['decided_at_step'] for r in rs]}, "
                 f"{e['bytes_moved_total'] / 1e6:.0f} MB moved "
                 f"({sum(r['remote_copies'] for r in rs) / max(1, len(moving)):.0f} copies per moving rebalance), "
                 f"stall median {stalls[len(stalls) // 2] if stalls else 0:.0f} ms (slowest rank), "
                 f"window balancedness before/after {[(round(r['balancedness_before'], 3), round(r['balancedness_after'], 3)) for r in rs][:4]}")
    print(line)
PY
