#!/usr/bin/env bash
# Issue 26's shipped tables, made over as many timed device commands as they take: the three
# packaged plans (flashtune/plans/shipped-{fwd,train,decode}.toml) tuned with `tune --op`
# on every GPU of the machine (`--gpus`), resumably (`--skip-tuned`), into one SQLite
# database that travels between commands.
#
#   bash benchmarks/ship_tables.sh tune OUTDIR     # this command's share, then a copy of the
#                                                  # database in OUTDIR/ship.db
#   bash benchmarks/ship_tables.sh export OUTDIR   # the tables, OUTDIR/configs/*.json
#
# The database is $SHIP_DB (default .ship/ship.db, git-ignored): carry `.ship` to the device
# and copy OUTDIR/ship.db back into .ship/ after each command, so the next one goes on where
# this one stopped. The ops run in turn (fwd, train, decode; OPS to choose), each with the
# time left of LIMIT seconds (default 540, a 10-minute device command with margin) less
# MARGIN (default 120: a shape of the train plan took 25-70 s on an H100 with 4 trials a
# template); `--stop-after` starts no shape that the longest so far would carry past it, and
# `timeout` stops what still runs over (the shape in flight is then tuned again next time).
# TRIALS (default 10) configs per template and shape; GPUS (default: every visible one);
# PLAN_DIR: plans named shipped-OP.toml there instead of the packaged ones; TUNE_ARGS: more
# `tune` options (e.g. `--interpret` with tiny plans, which is how it is tested on a CPU);
# VERBOSE=1: `flashtune -v`, every worker's log with times (where a command's time went).
# Each op's whole output is also kept in OUTDIR/tune_OP.log (the terminal gets its tail).
# A first command (no database at SHIP_DB yet) starts from this GPU's files in SEED
# (default flashtune/configs): op files with candidates (schema version 2) import as current
# choices, so a table whose database was lost goes on from its exported files, and the
# templates' files come along so that an export from this database keeps their entries (an
# imported best config is no finished search: the tuner still searches its shape).
# Prints each op's closing table and, last, the plan's progress (`flashtune show --op`).
set -u
what=${1:?usage: ship_tables.sh tune|export OUTDIR}
out=${2:?usage: ship_tables.sh tune|export OUTDIR}
db=${SHIP_DB:-.ship/ship.db}
limit=${LIMIT:-540}
margin=${MARGIN:-120}
trials=${TRIALS:-10}
ops=${OPS:-fwd train decode}
mkdir -p "$(dirname "$db")" "$out"
ft() { python -m flashtune --db "sqlite:///$db" "$@"; }
if [ -z "${GPUS:-}" ] && [ "$what" = tune ]; then
    GPUS=$(python -c 'import torch; print(",".join(map(str, range(torch.cuda.device_count()))))')
fi
start=$(date +%s)
case $what in
  tune)
    if [ ! -e "$db" ]; then
        device=$(python -c 'import torch
from flashtune.core.device import cuda_device, interpreter_device
print((cuda_device() if torch.cuda.is_available() else interpreter_device()).name)')
        seeds=$(find "${SEED:-flashtune/configs}" -maxdepth 1 -name "device_name=$device,*.json" \
                2>/dev/null | sort)
        if [ -n "$seeds" ]; then
            echo "== a new database: importing $(echo "$seeds" | wc -l) file(s) of $device" \
                 "($(echo "$seeds" | grep -c ',op=') op, $(echo "$seeds" | grep -c ',template=') template)"
            # shellcheck disable=SC2086
            ft import --policy skip $seeds | tail -n 1
        fi
    fi
    for op in $ops; do
        left=$(( limit - margin - ($(date +%s) - start) ))
        if [ "$left" -lt 60 ]; then
            echo "ship_tables: $left s left of $limit: --op $op waits for the next command"
            continue
        fi
        echo "== tune --op $op (stop after $left s, GPUs $GPUS, $(date -u +%T) UTC)"
        plan="shipped-$op"
        if [ -n "${PLAN_DIR:-}" ]; then plan="$PLAN_DIR/shipped-$op.toml"; fi
        # shellcheck disable=SC2086
        timeout -s TERM -k 30 $(( left + margin / 2 )) python -m flashtune \
            ${VERBOSE:+-v} --db "sqlite:///$db" tune --op "$op" --plan "$plan" --trials "$trials" \
            --timeout 60 --patience 6 --no-progress --skip-tuned --stop-after "$left" \
            --gpus "$GPUS" ${TUNE_ARGS:-} 2>&1 | tee -a "$out/tune_$op.log" \
            | grep -v "no tuned .* config for"
    done
    # one consistent file (no -wal/-shm beside it) to carry to the next command
    python - "$db" "$out/ship.db" <<'EOF'
import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
src.backup(dst)
dst.close()
EOF
    ft show --op fwd | tail -n 3; ft show --op train | tail -n 3; ft show --op decode | tail -n 3 ;;
  export)
    device=$(python -c 'from flashtune.core.device import cuda_device; print(cuda_device().name)')
    ft export -o "$out/configs" --device "$device" ;;
  *)
    echo "usage: ship_tables.sh tune|export OUTDIR" >&2; exit 2 ;;
esac
