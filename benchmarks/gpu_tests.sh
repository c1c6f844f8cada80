#!/usr/bin/env bash
# Run tests on the GPU in N pytest processes that share one Triton cache: on a GPU machine the
# suite's time is compilation, which one process does serially.
#   bash benchmarks/gpu_tests.sh N OUTDIR [pytest selection...]   (e.g. -m gpu tests/kernel_templates_tests)
# Each shard's log is OUTDIR/shard.K.log; a shard past $SHARD_TIMEOUT seconds (default 480) is
# stopped. Exits non-zero when any shard failed.
set -u
n=$1 out=$2
shift 2
export FLASHTUNE_TEST_DEVICE=cuda
mkdir -p "$out"
python -m pytest --collect-only -q -p no:cacheprovider "$@" | grep '::' > "$out/ids.txt"
split -n "r/$n" -d "$out/ids.txt" "$out/shard."
pids=()
for f in "$out"/shard.[0-9]*; do
  [[ $f == *.log ]] && continue
  mapfile -t ids < "$f"
  timeout "${SHARD_TIMEOUT:-480}" python -m pytest -q -p no:cacheprovider -rfE --durations=5 "${ids[@]}" > "$f.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for f in "$out"/shard.*.log; do echo "== $f"; grep -E "passed|failed|error|FAILED|ERROR" "$f" | tail -n 8; done
exit $rc
