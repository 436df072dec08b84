#!/usr/bin/env python3
"""a2a across nodes on the cluster on this machine (scripts/cluster): step time, exposed exchange
time and inter-node bytes of each a2a variant, with the planner's prediction beside each.

For every link rate (--gbit), a 2-node cluster is made; on it, 2 nodes x 2 ranks and 2 nodes x 1
rank run `epmoe run --option a2a` at each batch (--tokens, rows per step over all ranks) for every
variant (--variants: flat and two-level exchange, normal and low-latency mode, with TBO or SBO).
The variants' runs are interleaved (one run of each, --repeats times) and each figure is the median
over runs of epmoe run's own median over its timed steps, which follow --warmup steps left out
(the first steps pay one-time costs: at T = 1024 on 2 x 1 the first was 2 - 4 times the rest).
Exposed exchange = the time a rank waits on the exchange: the step less its compute stages (route,
pack, experts, unpack, shared), which with TBO counts only what neither micro-batch's compute hides. The planner's line for each run
comes from `epmoe plan --hardware PROFILE` with the same shape and variant, where PROFILE is this
machine measured first (`epmoe calibrate --formats` of the run's weight format, unless --base gives
it) with its links measured on the cluster at the run's layout (`epmoe calibrate --links
--link-gbit` under scripts/cluster mpirun), unless --profile gives the whole profile. Needs root (network namespaces).
--save keeps every run's report and the profiles; --replan reprices them with the current planner
without running anything (on the saved profiles, on --profile, or with the links measured again).

    benchmarks/cluster_bench.py build                 # the full table (about 8 minutes, calibration included)
    benchmarks/cluster_bench.py build --gbit 1 --tokens 16 --repeats 1   # a quick look
    benchmarks/cluster_bench.py build --base machine.json --save runs.json      # measure and keep
    benchmarks/cluster_bench.py build --replan runs.json                        # reprice (seconds)
    benchmarks/cluster_bench.py build --replan runs.json --relink --base new.json --save runs2.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "scripts", "cluster")

# name -> epmoe run flags (the planner takes the same ones).
VARIANTS = {
    "flat": ["--a2a-levels", "flat", "--a2a-mode", "normal"],
    "two-level": ["--a2a-levels", "two-level", "--a2a-mode", "normal"],
    "low-latency": ["--a2a-levels", "flat", "--a2a-mode", "low-latency"],
    "flat+tbo": ["--a2a-levels", "flat", "--a2a-mode", "normal", "--tbo"],
    "flat+sbo": ["--a2a-levels", "flat", "--a2a-mode", "normal", "--sbo"],
    "two-level+tbo": ["--a2a-levels", "two-level", "--a2a-mode", "normal", "--tbo"],
    # Not in the default list: SBO with two levels, and what drives the exchanges' progress.
    "two-level+sbo": ["--a2a-levels", "two-level", "--a2a-mode", "normal", "--sbo"],
    "flat+poll": ["--a2a-levels", "flat", "--a2a-mode", "normal", "--a2a-progress", "poll"],
    "flat+thread": ["--a2a-levels", "flat", "--a2a-mode", "normal", "--a2a-progress", "thread"],
    "flat+sbo+poll": ["--a2a-levels", "flat", "--a2a-mode", "normal", "--sbo", "--a2a-progress", "poll"],
    "flat+sbo+thread": ["--a2a-levels", "flat", "--a2a-mode", "normal", "--sbo", "--a2a-progress", "thread"],
}
DEFAULT_VARIANTS = ["flat", "two-level", "low-latency", "flat+tbo", "flat+sbo", "two-level+tbo"]


def run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        sys.exit(f"cluster_bench: {' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-2000:]}"
                 f"{result.stderr[-2000:]}")
    return result.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build", help="build folder holding epmoe")
    parser.add_argument("--gbit", type=float, nargs="+", default=[1, 5], help="link rates, Gbit/s")
    parser.add_argument("--layouts", nargs="+", default=["2x2", "2x1"], help="NODESxRANKS_PER_NODE")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 1024], help="rows per step")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each variant")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run before the timed ones, left out")
    parser.add_argument("--model", nargs="+", default=["--model", "deepseek-v2-lite", "--hidden", "1024",
                                                       "--intermediate", "512", "--weight-format", "bf16",
                                                       "--layers", "2"],
                        help="epmoe run's model flags (also given to epmoe plan)")
    parser.add_argument("--profile", help="hardware profile for the planner (default: calibrated here)")
    parser.add_argument("--base", help="profile of this machine to measure the links onto (default: `epmoe "
                        "calibrate` of the run's weight format, about a minute)")
    parser.add_argument("--name", default="cbench", help="cluster name")
    parser.add_argument("--save", help="write the measured runs and the profiles they are priced with to this "
                        "JSON file (with --replan: the runs again, with the profiles now used)")
    parser.add_argument("--replan", help="run nothing: reprice the runs a --save wrote with the current planner "
                        "(on the profiles saved with them, --profile, or links measured again with "
                        "--relink) and print the table")
    parser.add_argument("--relink", action="store_true", help="with --replan: measure the links again on a "
                        "cluster onto --base (a minute per link rate and layout; needs root)")
    args = parser.parse_args()
    epmoe = os.path.join(os.path.abspath(args.build), "epmoe")
    if args.relink and not args.replan:
        parser.error("--relink reprices saved runs: give --replan FILE")
    if args.replan:
        try:
            with open(args.replan) as f:
                saved = json.load(f)
            measured, profiles, model = saved["runs"], saved["profiles"], saved["model"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"cluster_bench: --replan {args.replan}: not the runs a --save wrote ({e!r})")
        if args.relink:
            profiles = measure_links(epmoe, args, sorted({(m["gbit"], m["layout"]) for m in measured}),
                                     base_profile(epmoe, args, model))
    else:
        measured, profiles, model = measure(epmoe, args)
    if args.profile:
        with open(args.profile) as f:
            profiles = {key: json.load(f) for key in profiles}
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"model": model, "profiles": profiles, "runs": measured}, f)
    print_table(epmoe, model, measured, profiles)


def profile_key(gbit, layout):
    return f"{gbit:g}/{layout}"


def base_profile(epmoe, args, model):
    """--base, or this machine calibrated now for the model's weight format."""
    if args.base:
        return args.base
    weight_format = model[model.index("--weight-format") + 1] if "--weight-format" in model else "fp32"
    base = temporary_json("cluster_bench_machine_")
    run([epmoe, "calibrate", "--formats", weight_format, "--out", base])
    return base


def measure_links(epmoe, args, points, base):
    """{profile_key: profile} with the links measured at each (gbit, layout) of `points`."""
    profiles = {}
    for gbit in sorted({g for g, _ in points}):
        run([CLUSTER, "up", "--name", args.name, "--nodes", "2", "--link-gbit", str(gbit)])
        try:
            for layout in sorted({l for g, l in points if g == gbit}):
                nodes, per_node = (int(x) for x in layout.split("x"))
                with open(calibrate(epmoe, args.name, gbit, nodes * per_node, base)) as f:
                    profiles[profile_key(gbit, layout)] = json.load(f)
        finally:
            run([CLUSTER, "down", "--name", args.name])
    return profiles


def measure(epmoe, args):
    """Every run's `epmoe run` report, grouped by (gbit, layout, tokens, variant), with the profile of
    each link rate and layout (its links measured on the cluster)."""
    measured, profiles = [], {}
    base = None if args.profile else base_profile(epmoe, args, args.model)
    for gbit in args.gbit:
        run([CLUSTER, "up", "--name", args.name, "--nodes", "2", "--link-gbit", str(gbit)])
        try:
            for layout in args.layouts:
                nodes, per_node = (int(x) for x in layout.split("x"))
                ranks = nodes * per_node
                with open(args.profile or calibrate(epmoe, args.name, gbit, ranks, base)) as f:
                    profiles[profile_key(gbit, layout)] = json.load(f)
                for tokens in args.tokens:
                    figures = {v: [] for v in args.variants}
                    for _ in range(args.repeats):
                        for variant in args.variants:
                            out = run([CLUSTER, "mpirun", "--name", args.name, "-np", str(ranks), epmoe, "run",
                                       "--option", "a2a", "--tokens", str(tokens), "--steps", str(args.steps),
                                       "--warmup", str(args.warmup), "--format", "json", *args.model,
                                       *VARIANTS[variant]])
                            figures[variant].append(json.loads(out)["options"][0])
                    for variant in args.variants:
                        measured.append({"gbit": gbit, "layout": layout, "tokens": tokens, "variant": variant,
                                         "runs": figures[variant]})
                        print(json.dumps(summarize(measured[-1])), file=sys.stderr)
        finally:
            run([CLUSTER, "down", "--name", args.name])
    return measured, profiles, args.model


def summarize(point):
    """One table line's measured figures: medians over runs of each run's median over steps."""
    runs = point["runs"]
    med = lambda f: statistics.median(f(r) for r in runs)
    return {
        "gbit": point["gbit"], "layout": point["layout"], "tokens": point["tokens"], "variant": point["variant"],
        "step_ms": med(lambda r: r["step_ms_median"]),
        "exposed_ms": med(exposed),
        "experts_ms": med(lambda r: r["stage_ms_median"]["experts"]),
        "inter_node_kb": med(lambda r: r["inter_node_bytes_sent_per_rank_step"]) / 1e3,
    }


def print_table(epmoe, model, measured, profiles):
    rows = []
    for point in measured:
        row = summarize(point)
        nodes, per_node = (int(x) for x in point["layout"].split("x"))
        profile = temporary_json("cluster_bench_profile_")
        with open(profile, "w") as f:
            json.dump(profiles[profile_key(point["gbit"], point["layout"])], f)
        plan = predict(epmoe, profile, model, nodes * per_node, point["tokens"], point["variant"])
        os.remove(profile)
        row["plan_step_ms"], row["plan_exposed_ms"] = plan.get("step_ms"), plan.get("exposed_ms")
        rows.append(row)
    print("| link | nodes x ranks | T | variant | step ms | exposed exchange ms | experts ms | inter-node KB/rank/step |"
          " planner step ms | planner exposed ms | planner / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['plan_step_ms'] / r['step_ms']:.2f}" if r["plan_step_ms"] else "-"
        plan_step = f"{r['plan_step_ms']:.1f}" if r["plan_step_ms"] else "-"
        plan_exposed = f"{r['plan_exposed_ms']:.1f}" if r["plan_exposed_ms"] is not None else "-"
        print(f"| {r['gbit']:g} Gbit/s | {r['layout']} | {r['tokens']} | {r['variant']} | {r['step_ms']:.1f} |"
              f" {r['exposed_ms']:.1f} | {r['experts_ms']:.1f} | {r['inter_node_kb']:.0f} | {plan_step} |"
              f" {plan_exposed} | {ratio} |")
    ratios = [r["plan_step_ms"] / r["step_ms"] for r in rows if r["plan_step_ms"]]
    if ratios:
        within = sum(1 for x in ratios if 0.75 <= x <= 1.25)
        print(f"\nplanner within 25% of the measured step in {within} of {len(rows)} lines (planner / measured "
              f"{min(ratios):.2f} - {max(ratios):.2f}, median {statistics.median(ratios):.2f})")


def exposed(report):
    """Time a rank waits on the exchange: the step less its compute stages (with TBO the two lanes'
    exchanges overlap the other's compute, so their own dispatch and combine stages overstate it)."""
    stages = report["stage_ms_median"]
    compute = sum(stages[s] for s in ("route", "pack", "experts", "unpack", "shared"))
    return max(0.0, report["step_ms_median"] - compute)


def temporary_json(prefix):
    handle, path = tempfile.mkstemp(suffix=".json", prefix=prefix)
    os.close(handle)
    return path


def calibrate(epmoe, name, gbit, ranks, base):
    """`base` with the cluster's links measured by `ranks` ranks (the run's layout: the planner takes
    the ranks per node and each rank's share of its node's link from it); a temporary file."""
    path = temporary_json("cluster_bench_links_")
    run([CLUSTER, "mpirun", "--name", name, "-np", str(ranks), epmoe, "calibrate", "--links", "--link-gbit", str(gbit),
         "--base", base, "--out", path])
    return path


def predict(epmoe, profile, model_flags, ranks, tokens, variant):
    """The planner's step and exposed exchange time for one run, in ms (empty when it has none)."""
    # epmoe plan names the weight format --weights and prices one MoE layer: the run's --layers of
    # them make its step. It returns a2a's outputs one per pick, as epmoe run does by default.
    plan_model, layers = [], 1
    for flag, value in zip(model_flags[::2], model_flags[1::2]):
        if flag == "--layers":
            layers = int(value)
        elif flag == "--weight-format":
            plan_model += ["--weights", value]
        else:
            plan_model += [flag, value]
    # The planner prices the exchange, not what drives its progress.
    run_flags = VARIANTS[variant]
    if "--a2a-progress" in run_flags:
        at = run_flags.index("--a2a-progress")
        run_flags = run_flags[:at] + run_flags[at + 2:]
    flags = [f for f in run_flags if f not in ("--tbo", "--sbo")]
    want_tbo, want_sbo = "--tbo" in VARIANTS[variant], "--sbo" in VARIANTS[variant]
    out = run([epmoe, "plan", "--hardware", profile, *plan_model, "--options", "a2a", "--gpus", str(ranks),
               "--batch", str(tokens), "--a2a-combine", "per-pick", "--format", "json", *flags,
               *(["--tbo"] if want_tbo else []), *(["--sbo"] if want_sbo else [])])
    for cost in json.loads(out)["costs"]:
        a2a = cost.get("a2a", {})
        if cost.get("applicable") and a2a.get("tbo") == want_tbo and a2a.get("sbo") == want_sbo:
            return {"step_ms": cost["layer_us"] * layers / 1e3, "exposed_ms": cost["exposed_comm_us"] * layers / 1e3}
    return {}


if __name__ == "__main__":
    main()
