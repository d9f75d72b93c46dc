#!/usr/bin/env bash
# Device-trace diff of one sparse decode chunk (bench_decode's sparse 256K x 1 row, Llama-3.1-8B shape) between
# an old and a new source tree, each in its own process (PYTHONPATH and cwd = that tree), under timeouts so a
# hanging tree cannot eat the call; then a per-op table per decode step (regression_diff.py diff).
# Device command (repo root; carry .base and .snap = `git archive` exports of the old commit and HEAD):
#   bash scripts/probes/regression_profile.sh .base .snap
# Args: OLD_TREE NEW_TREE [extra `regression_diff.py trace` options, e.g. --tiny or --context 131072 --batch 3].
# Env: OUT (default out/regression_profile), PYTHON (default python3), BUDGET_S (total seconds, default 520).
# Writes $OUT/{old,new}_trace.json, $OUT/{old,new}.log and $OUT/regression_profile.json.
set -u
OLD=$(cd "${1:?old tree}" && pwd)
NEW=$(cd "${2:?new tree}" && pwd)
shift 2
OUTD=${OUT:-out/regression_profile}
mkdir -p "$OUTD" && OUTD=$(cd "$OUTD" && pwd)
PY=${PYTHON:-python3}
DIFF=$(cd "$(dirname "$0")" && pwd)/regression_diff.py
BUDGET_S=${BUDGET_S:-520}
start=$SECONDS
export PYTHONUNBUFFERED=1
side() {  # side NAME TREE LIMIT_S
    echo "== $1: $2 (limit $3 s)"
    rm -f "$OUTD/$1_trace.json"                # a stale JSON must not stand in for a failed run
    (cd "$2" && PYTHONPATH="$2" timeout -k 10 "$3" "$PY" "$DIFF" trace --tree "$2" \
        --out "$OUTD/$1_trace.json" "${@:4}") >"$OUTD/$1.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
        wrote=$([ -f "$OUTD/$1_trace.json" ] && echo ' after writing its JSON')
        echo "$1 FAILED rc=$rc (124 = timeout)$wrote; log tail:"
        tail -n 15 "$OUTD/$1.log"
    else
        tail -n 1 "$OUTD/$1.log"
    fi
}
first=$(( (BUDGET_S - 20) / 2 ))               # the first tree may not take the second's share
side old "$OLD" "$first" "$@"
side new "$NEW" $(( BUDGET_S - 20 - (SECONDS - start) )) "$@"
"$PY" "$DIFF" diff "$OUTD/old_trace.json" "$OUTD/new_trace.json" --out "$OUTD/regression_profile.json"
echo "total $(( SECONDS - start )) s"
