#!/usr/bin/env bash
# FlashAttention-2's own test file (tests/fa2_suite) on one GPU, its whole fixed-seed sample
# in one run: the sample is split into $SHARDS parts (FLASHTUNE_FA2_SHARD i/n) that run as
# parallel pytest processes sharing one Triton cache. A case is compile-bound (about 5 s, one
# CPU core for ptxas), so on a 16-core GPU host 12 processes run the 510 sampled cases in a
# few minutes where one process needs about 40.
#
#   SHARDS=12 LIMIT=470 bash benchmarks/fa2_suite_parallel.sh OUTDIR
#
# Writes OUTDIR/fa2_suite.json (benchmarks/fa2_suite_report.py's counts over every shard),
# OUTDIR/fa2_suite.txt (its table and each shard's failures) and OUTDIR/fa2_raw.tar.gz (the
# JUnit XML and log of every shard). A shard still running after LIMIT seconds gets SIGINT, so
# pytest writes its XML for the cases it finished. Cases that ran out of GPU memory (the shards
# share the GPU: FA2's 128k-key KV-cache cases take several GiB) are run again afterwards, alone
# in one process, and counted with that outcome (the report lists them).
set -u
out=${1:?usage: fa2_suite_parallel.sh OUTDIR}
shards=${SHARDS:-12}
limit=${LIMIT:-470}
work=$(mktemp -d)
mkdir -p "$out"
unset FLASHTUNE_AUTOTUNE
export FLASHTUNE_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$work/triton-cache}
start=$(date +%s)
for i in $(seq 1 "$shards"); do
    FLASHTUNE_FA2_SHARD=$i/$shards timeout -s INT -k 30 "$limit" python -m pytest \
        tests/fa2_suite/test_flash_attn.py -p no:cacheprovider -q -rfE \
        --junitxml="$work/fa2_$i.xml" >"$work/log_$i.txt" 2>&1 &
done
wait
python - "$work" >"$work/oom_ids.txt" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
for path in sorted(pathlib.Path(sys.argv[1]).glob("fa2_*.xml")):
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None and "out of memory" in (bad.get("message") or "") + (bad.text or ""):
            print("tests/fa2_suite/test_flash_attn.py::" + case.get("name"))
PY
rerun=()
if [ -s "$work/oom_ids.txt" ]; then
    timeout -s INT -k 30 "$limit" python -m pytest $(cat "$work/oom_ids.txt") -p no:cacheprovider \
        -q -rfE --junitxml="$work/rerun.xml" >"$work/log_rerun.txt" 2>&1
    rerun=(--rerun "$work/rerun.xml")
fi
echo "shards: $shards, wall: $(( $(date +%s) - start )) s, out of memory re-run:" \
    "$(wc -l <"$work/oom_ids.txt")" | tee "$out/fa2_suite.txt"
python benchmarks/fa2_suite_report.py "$work"/fa2_*.xml "${rerun[@]}" --json "$out/fa2_suite.json" \
    | tee -a "$out/fa2_suite.txt"
status=${PIPESTATUS[0]}
for i in $(seq 1 "$shards"); do
    { echo "--- shard $i/$shards: $(tail -n 1 "$work/log_$i.txt")"
      grep -E "^(FAILED|ERROR) " "$work/log_$i.txt"; } >>"$out/fa2_suite.txt"
done
tar -czf "$out/fa2_raw.tar.gz" -C "$work" $(cd "$work" && ls fa2_*.xml log_*.txt rerun.xml 2>/dev/null)
exit "$status"
