#!/usr/bin/env bash
# Issue 22's GPU investigation, in steps that each fit one device command:
#   bash benchmarks/route_fwd.sh tune <plan.toml>...   # tune --op fwd for the plans' shapes
#   bash benchmarks/route_fwd.sh bench <name> <plan.toml>  # routed forward vs SDPA, JSON
# The database is $FLASHTUNE_DB (default .route/flashtune.db, git-ignored); it starts with
# the shipped tables imported, so attn_fwd's search warm-starts from them. Set OUT for where
# the JSON goes (default benchmarks/results).
set -u
DB=${FLASHTUNE_DB:-sqlite:///.route/flashtune.db}
mkdir -p .route
OUT=${OUT:-benchmarks/results}
ft() { python -m flashtune --db "$DB" "$@"; }
if [ ! -f "${DB#sqlite:///}" ]; then ft import flashtune/configs; fi
what=$1; shift
case $what in
  tune)
    for plan in "$@"; do
      ft tune --op fwd --plan "$plan" --trials "${TRIALS:-6}" --workers 8 --no-progress ${TUNE_ARGS:-}
    done ;;
  bench)
    name=$1; plan=$2
    ft bench --plan "$plan" --baselines sdpa_flash,sdpa_cudnn --rounds "${ROUNDS:-3}" --no-plot \
      --out "$OUT/route_fwd_${name}_h100.json" ;;
  show)
    ft show --op fwd ;;
esac
