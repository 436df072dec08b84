#!/usr/bin/env bash
# Multi-node tests on the cluster on one machine (scripts/cluster): 2 nodes over shaped links,
# every option checked against the single-process layer with 2 ranks per node and 1 (and a2a with
# two levels, low-latency, TBO and SBO), a node whose link goes down mid-run ending the job (named
# with its ranks) with nothing left running, and the cluster gone afterwards. Exits 77 (ctest: skipped) where network namespaces cannot be made.
# Usage: tests/cluster/cluster_test.sh BUILD_DIR
set -euo pipefail
build="$(cd "$1" && pwd)"
scripts="$(cd "$(dirname "$0")/../../scripts" && pwd)"
epmoe="$build/epmoe"
name="ct$$"
name="${name:0:10}"
if ! probe=$("$scripts/cluster" up --name "$name" --nodes 2 --link-gbit 5 2>&1); then
  if echo "$probe" | grep -qE "needs root|does not allow network namespaces|is missing"; then
    echo "SKIPPED: $probe"
    exit 77
  fi
  echo "$probe"
  exit 1
fi
trap '"$scripts/cluster" down --name "$name" >/dev/null' EXIT
failures=0
fail() {
  echo "FAILED: $*"
  failures=$((failures + 1))
}
out="$(mktemp)"
small=(--model qwen3-30b-a3b --hidden 256 --intermediate 128 --layers 2 --steps 2 --tokens 64 --comm-timeout 60)

"$scripts/cluster" status --name "$name" >"$out"
grep -q "2 node(s)" "$out" && [ "$(grep -c 'qdisc tbf' "$out")" -eq 2 ] || fail "status: $(cat "$out")"

# Two nodes of two ranks, then two nodes of one: every option matches the single-process layer,
# over Open MPI's TCP transport and (dwdp included, which needs one-sided MPI) over UCX.
run_checked() {  # ranks, what, mpirun flags and epmoe run flags...
  local ranks="$1" what="$2"
  shift 2
  if "$scripts/cluster" mpirun --name "$name" "$@" >"$out" 2>&1; then
    grep -q "$ranks ranks on 2 nodes" "$out" || fail "$what: not reported on 2 nodes: $(head -3 "$out")"
    grep -q "check: every option matches" "$out" || fail "$what: no check line: $(tail -3 "$out")"
  else
    fail "$what: $(grep -v '^\[' "$out" | tail -5)"
  fi
}
for ranks in 4 2; do
  run_checked "$ranks" "$ranks ranks over TCP" -np "$ranks" "$epmoe" run "${small[@]}" --check \
    --option sliced,whole,hybrid,a2a
  run_checked "$ranks" "$ranks ranks over UCX" --ucx -np "$ranks" "$epmoe" run "${small[@]}" --check --option all
done
# a2a's exchanges across the nodes: two levels, low-latency, and both overlaps, each checked.
for variant in "--a2a-levels two-level" "--a2a-mode low-latency" "--a2a-levels two-level --tbo --sbo" \
  "--a2a-mode low-latency --tbo --sbo"; do
  # shellcheck disable=SC2086
  run_checked 4 "a2a $variant" -np 4 "$epmoe" run "${small[@]}" --check --option a2a $variant
done
# dwdp over TCP is refused with the reason, not aborted by MPI.
if "$scripts/cluster" mpirun --name "$name" -np 2 "$epmoe" run "${small[@]}" --option dwdp >"$out" 2>&1; then
  fail "dwdp ran across nodes without a one-sided transport"
fi
grep -q "no one-sided transport between these nodes" "$out" || fail "dwdp over TCP: $(grep -v '^\[' "$out" | tail -3)"

# Node 1's link goes down mid-run: the job ends within the communication timeout, naming the node
# and its ranks, and leaves no process on any node.
start=$(date +%s)
( sleep 6; "$scripts/cluster" link --name "$name" 1 down ) &
if timeout 120 "$scripts/cluster" mpirun --name "$name" -np 4 "$epmoe" run --model qwen3-30b-a3b --hidden 256 \
  --intermediate 128 --tokens 64 --option a2a --steps 100000 --comm-timeout 10 >"$out" 2>&1; then
  fail "a run whose node lost its link succeeded"
fi
wait
elapsed=$(( $(date +%s) - start - 6 ))
[ "$elapsed" -le 20 ] || fail "the run ended ${elapsed} s after the link went down (timeout 10 s)"
grep -q "node 1" "$out" && grep -qE "ranks 2(-|, )3" "$out" || fail "node 1 and ranks 2, 3 not named: $(tail -5 "$out")"
for ns in "$name-n0" "$name-n1"; do
  [ -z "$(ip netns pids "$ns")" ] || fail "processes left on $ns: $(ip netns pids "$ns" | xargs ps -o cmd= -p)"
done

"$scripts/cluster" down --name "$name" >/dev/null
trap - EXIT
! ip netns list | grep -q "^$name-" || fail "namespaces left after down: $(ip netns list | grep "^$name-")"
rm -f "$out"
[ "$failures" -eq 0 ] && echo "cluster tests passed" || exit 1
