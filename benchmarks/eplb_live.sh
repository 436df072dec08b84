#!/bin/bash
# Live rebalancing benchmark (docs/eplb.md, "Live rebalancing"): `epmoe run --option a2a` on 4 ranks
# with EPLB off and on, over
#   1. a drifting synthetic load: zipf popularity (s = 1) whose popular set changes every 200 steps,
#      800 steps of 64 rows, OLMoE's routing shape (64 experts, top-8), 4 MoE layers;
#   2. FLAME-MoE-290M's 10 recorded decode steps (64 rows, top-6) replayed 40 times (400 steps),
#      8 MoE layers, from the full routing data beside the repository (../shared/data/traces, or the
#      folder EPMOE_TRACES names; tests/data holds only a 32-sequence excerpt of it).
# Experts are benchmark-sized (hidden 512, intermediate 256, bf16), R = 4 redundant slots,
# deepseek-guarded. "off" runs the plain placement (no redundant slots), recording the picks but
# never looking (--eplb-interval 1000000), so it reports the same per-step figures; "sync" and
# "async" rebalance (async: rank 0 computes the placement on
# a helper thread and copies travel in the background, one or two layers per chunk).
# The configurations of a load run back to back, REPEATS times (the machine is noisy); per run the
# step time is the wall time per step on rank 0 (step plus rebalancing boundary) after 50 warm-up
# steps; the table gives the median over the repeats of each run's median and p90, and their range.
# With PLOT_DIR, also writes eplb_balance_drift.svg and eplb_balance_flame.svg there
# (`epmoe plot-balance`, first repeat, off against sync and async).
# Usage: benchmarks/eplb_live.sh [BUILD_DIR] [REPEATS] [PLOT_DIR]   (BUILD_DIR holds epmoe; default build, 3)
set -euo pipefail
BUILD=${1:-build}
REPEATS=${2:-3}
PLOT_DIR=${3:-}
BIN=$(realpath "$BUILD/epmoe")
HERE=$(cd "$(dirname "$0")/.." && pwd)
TRACES=${EPMOE_TRACES:-$HERE/../shared/data/traces}
if [ ! -d "$TRACES/flame_moe_290m/decode_64seqs_pos1-10" ]; then
  echo "eplb_live: $TRACES/flame_moe_290m/decode_64seqs_pos1-10 not found; set EPMOE_TRACES to the folder of the full routing traces" >&2
  exit 1
fi
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
EPLB="--eplb --eplb-redundant 4 --eplb-policy deepseek-guarded"
OFF="--eplb --eplb-interval 1000000"  # the plain placement (no redundant slots), recorded only
DRIFT_ON="$EPLB --eplb-interval 50 --eplb-trigger threshold --eplb-threshold 0.9"
FLAME_ON="$EPLB --eplb-interval 50 --eplb-window 50"

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for repeat in $(seq 1 "$REPEATS"); do
  $RUN $DRIFT $OFF > "$WORK/drift_off_$repeat.json"
  $RUN $DRIFT $DRIFT_ON > "$WORK/drift_sync_$repeat.json"
  $RUN $DRIFT $DRIFT_ON --eplb-async --eplb-layers-per-chunk 1 > "$WORK/drift_async_$repeat.json"
  $RUN $FLAME $OFF > "$WORK/flame_off_$repeat.json"
  $RUN $FLAME $FLAME_ON > "$WORK/flame_sync_$repeat.json"
  $RUN $FLAME $FLAME_ON --eplb-async --eplb-layers-per-chunk 2 > "$WORK/flame_async_$repeat.json"
  echo "repeat $repeat done, load average $(cut -d' ' -f1-3 /proc/loadavg)"
done

python3 - "$WORK" "$REPEATS" <<'PY'
import json, statistics, sys
work, repeats = sys.argv[1], int(sys.argv[2])
WARMUP = 50
def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]
print(f"{'run':12s} {'step ms median':>22s} {'step ms p90':>22s}  {'rebal.':>6s} {'MB moved':>8s} "
      f"{'stall ms':>15s} {'placement ms':>12s} {'picks bal.':>10s} {'bytes bal.':>10s}")
for name in ["drift_off", "drift_sync", "drift_async", "flame_off", "flame_sync", "flame_async"]:
    medians, p90s, counts, moved, stalls, computes, picks, bytes_ = [], [], [], [], [], [], [], []
    for r in range(1, repeats + 1):
        o = json.load(open(f"{work}/{name}_{r}.json"))["options"][0]
        e = o["eplb"]
        wall = e["wall_ms_per_step"][WARMUP:]
        medians.append(statistics.median(wall))
        p90s.append(quantile(wall, 0.9))
        counts.append(len(e["rebalances"]))
        moved.append(e["bytes_moved_total"] / 1e6)
        stalls += [x["stall_ms_max_rank"] for x in e["rebalances"]]
        computes += [x["compute_ms"] for x in e["rebalances"]]
        picks.append(o["balancedness_picks"])
        bytes_.append(o["balancedness_bytes"])
    med = statistics.median
    spread = lambda v: f"{med(v):6.2f} ({min(v):5.1f}-{max(v):5.1f})"
    print(f"{name:12s} {spread(medians):>22s} {spread(p90s):>22s}  {med(counts):6.0f} {med(moved):8.0f} "
          f"{(f'{med(stalls):.0f} ({min(stalls):.0f}-{max(stalls):.0f})' if stalls else '-'):>15s} "
          f"{(med(computes) if computes else 0):12.1f} "
          f"{med(picks):10.3f} {med(bytes_):10.3f}")
first = json.load(open(f"{work}/drift_sync_1.json"))["options"][0]["eplb"]["rebalances"]
print("drift sync, first repeat: rebalances decided at", [r["decided_at_step"] for r in first],
      "window balancedness before/after", [(round(r["balancedness_before"], 3), round(r["balancedness_after"], 3)) for r in first])
first = json.load(open(f"{work}/drift_async_1.json"))["options"][0]["eplb"]["rebalances"]
print("drift async, first repeat: decided/placement ready/installed at",
      [(r["decided_at_step"], r["placement_ready_at_step"], r["installed_at_step"]) for r in first])
PY
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

if [ -n "$PLOT_DIR" ]; then
  "$BIN" plot-balance "$PLOT_DIR/eplb_balance_drift.svg" --smooth 25 \
    --title "drifting zipf load (drift every 200 steps)" \
    --run "EPLB off=$WORK/drift_off_1.json" --run "EPLB threshold 0.9, sync=$WORK/drift_sync_1.json" \
    --run "EPLB threshold 0.9, async=$WORK/drift_async_1.json"
  "$BIN" plot-balance "$PLOT_DIR/eplb_balance_flame.svg" --smooth 10 \
    --title "FLAME-MoE-290M decode steps, looped" \
    --run "EPLB off=$WORK/flame_off_1.json" --run "EPLB interval 50, sync=$WORK/flame_sync_1.json" \
    --run "EPLB interval 50, async=$WORK/flame_async_1.json"
fi
