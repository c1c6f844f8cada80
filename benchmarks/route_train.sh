#!/usr/bin/env bash
# The train op on the GPU (issue 22), in steps that each fit one device command:
#   bash benchmarks/route_train.sh tune <plan.toml>...     # tune --op train for the plans' shapes
#   bash benchmarks/route_train.sh bench <name> <plan.toml>  # routed training step vs SDPA, JSON
#   bash benchmarks/route_train.sh show                     # the stored train choices
# The database is $FLASHTUNE_DB (default .route/flashtune.db, git-ignored; the forward's
# searches of route_fwd.sh warm-start the pairs' forwards). TRIALS (per template), TUNE_ARGS
# (e.g. "--impl attn_fwd": the Gluon forward's stored best still takes part), ROUNDS; OUT
# is where the JSON goes (default benchmarks/results).
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
      ft tune --op train --plan "$plan" --trials "${TRIALS:-6}" --workers 8 --no-progress ${TUNE_ARGS:-}
    done ;;
  bench)
    name=$1; plan=$2
    ft bench --train --plan "$plan" --baselines sdpa_flash,sdpa_cudnn --rounds "${ROUNDS:-3}" \
      --no-plot --out "$OUT/route_train_${name}_h100.json" ;;
  show)
    ft show --op train ;;
esac
