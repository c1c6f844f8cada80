#!/usr/bin/env bash
# Issue 26's target, on one GPU: shapes that no plan names, served by the shipped tables
# (the nearest entry) against the same shapes tuned exactly, each run beside SDPA flash and
# cuDNN, so the two are compared as ratios to cuDNN of their own run.
#
#   bash benchmarks/ship_check.sh OUTDIR PLAN NAME [STOP_AFTER]
#
# 1. `bench --plan PLAN` with no tuning database (a fresh install: flashtune/configs only)
#    -> OUTDIR/ship_nearest_NAME.json;
# 2. `tune --op OP --plan PLAN` into a new database, for at most STOP_AFTER seconds
#    (default 240; `--stop-after`, so a command's limit is kept);
# 3. `bench --plan PLAN` with that database -> OUTDIR/ship_exact_NAME.json;
# 4. a table of the shapes step 2 tuned: each run's flashtune time over its cuDNN time (over
#    flashtune's template default where no SDPA backend serves the shape), and
#    nearest over exact (within 5% is the target, counted over the held-out shapes: one that
#    the shipped tables hold already is listed as a control) -> OUTDIR/ship_check_NAME.json.
#
# OP: fwd (default), train (`bench --train`: the training step the train op chose) or
# decode (a plan of one-query steps, `seqlen = 1` with `kv_seqlen`: `flashtune.attention`
# routes them by the decode op's choices);
# BASELINES (default sdpa_flash,sdpa_cudnn) and ANCHOR (default sdpa_cudnn, the baseline
# each run's ratio is taken to); TUNE_ARGS and BENCH_ARGS: more options (`--interpret`
# with a tiny plan and ANCHOR=sdpa_flash is how it is tested on a CPU); TRIALS, ROUNDS;
# CHECK_DB: the exact tuning's SQLite file (default: one in a temporary folder, gone with the
# command). A path in the project's git-ignored `.ship/` stays on a warm device machine, so
# the same command run again goes on with the shapes STOP_AFTER left untuned.
set -u
out=${1:?usage: ship_check.sh OUTDIR PLAN NAME [STOP_AFTER]}
plan=${2:?usage: ship_check.sh OUTDIR PLAN NAME [STOP_AFTER]}
name=${3:?usage: ship_check.sh OUTDIR PLAN NAME [STOP_AFTER]}
stop=${4:-240}
op=${OP:-fwd}
anchor=${ANCHOR:-sdpa_cudnn}
case $op in
  fwd) train=() ;;
  train) train=(--train) ;;
  decode) train=() ;;  # one-query steps: bench's forward of them routes by the decode op
  *) echo "ship_check: OP is fwd, train or decode, got $op" >&2; exit 2 ;;
esac
work=$(mktemp -d)
db=$(realpath -m "${CHECK_DB:-$work/exact.db}")
mkdir -p "$out" "$(dirname "$db")"
bench() {  # OUTFILE [flashtune options]
    local file=$1; shift
    # shellcheck disable=SC2086
    python -m flashtune "$@" bench --plan "$plan" "${train[@]}" \
        --baselines "${BASELINES:-sdpa_flash,sdpa_cudnn}" --rounds "${ROUNDS:-3}" --no-plot \
        --out "$file" ${BENCH_ARGS:-} 2>&1 | tail -n 14
}
echo "== 1. shipped tables only (nearest entry): no database, no config folder"
XDG_CACHE_HOME=$work/cache FLASHTUNE_DB='' FLASHTUNE_CONFIG_DIR='' \
    bench "$out/ship_nearest_$name.json"
echo "== 2. tune --op $op for the plan's shapes (stop after $stop s)"
# shellcheck disable=SC2086
timeout -s TERM -k 30 $(( stop + 120 )) python -m flashtune --db "sqlite:///$db" \
    tune --op "$op" --plan "$plan" --trials "${TRIALS:-6}" --timeout 40 --patience 6 \
    --no-progress --skip-tuned --stop-after "$stop" ${TUNE_ARGS:-} 2>&1 \
    | grep -v "skipped:" | tail -n 14
echo "== 3. tuned exactly"
bench "$out/ship_exact_$name.json" --db "sqlite:///$db"
echo "== 4. nearest against exact"
python - "$out/ship_nearest_$name.json" "$out/ship_exact_$name.json" \
    "$out/ship_check_$name.json" "$op" "$anchor" <<'PY'
import json, math, os, sys

near, exact = (json.load(open(p)) for p in sys.argv[1:3])
op, anchor = sys.argv[4:6]
by_label = {r["label"]: r for r in near["rows"]}
rows = []

def timed(row, name):
    return "median_ms" in row.get(name, {})


for e in exact["rows"]:
    n = by_label.get(e["label"])
    if n is None or e.get("source") != "exact":
        continue
    # a shape no SDPA backend serves (softcap, a window) is anchored to flashtune's own
    # template default, timed in both runs the same way
    base = next((a for a in (anchor, "flashtune_default") if timed(e, a) and timed(n, a)), None)
    if base is None or not (timed(e, "flashtune") and timed(n, "flashtune")):
        continue
    vs_n = n["flashtune"]["median_ms"] / n[base]["median_ms"]
    vs_e = e["flashtune"]["median_ms"] / e[base]["median_ms"]
    # a shape the shipped tables hold already ("exact" with no database) is no held-out
    # shape: both runs serve the same entry, so it is listed as a control, not counted
    rows.append({"label": e["label"], "nearest": n["implementation"], "nearest_source": n["source"],
                 "exact": e["implementation"], "anchor": base, "nearest_over_anchor": vs_n,
                 "exact_over_anchor": vs_e, "nearest_over_exact": vs_n / vs_e,
                 "held_out": n["source"] != "exact"})
print(f"{'shape':<52} {'nearest (source)':<30} {'exact':<16} near/{anchor} exact/{anchor} "
      f"near/exact")
for r in rows:
    print(f"{r['label']:<52} {r['nearest'] + ' (' + r['nearest_source'] + ')':<30} "
          f"{r['exact']:<16} {r['nearest_over_anchor']:10.3f} {r['exact_over_anchor']:11.3f} "
          f"{r['nearest_over_exact']:10.3f}" + ("" if r["held_out"] else "  (shipped: a control)")
          + ("" if r["anchor"] == anchor else f"  (anchor: {r['anchor']})"))
held = [r["nearest_over_exact"] for r in rows if r["held_out"]]
worst = max(held, default=math.nan)
geo = math.exp(sum(math.log(x) for x in held) / len(held)) if held else math.nan
print(f"{len(held)} held-out shapes tuned exactly: nearest/exact time geomean {geo:.3f}, worst "
      f"{worst:.3f} (target: every one <= 1.05); {len(rows) - len(held)} shipped shape(s) as "
      f"controls")
json.dump({"benchmark": "ship_check", "op": op, "anchor": anchor, "device": exact.get("device"),
           "nearest": os.path.basename(sys.argv[1]),
           "exact": os.path.basename(sys.argv[2]), "rows": rows, "held_out": len(held),
           "geomean_nearest_over_exact": geo,
           "worst_nearest_over_exact": worst}, open(sys.argv[3], "w"), indent=1)
PY
rm -rf "$work"
