#!/usr/bin/env bash
# Same-call decode rows of two source trees (issue 20 part 8: the one program against ea0d433): for each row,
# the old tree's bench_decode.py, then the new tree's, each a process of its own with its own tree on PYTHONPATH,
# alternating so that both commits see the same machine state; rows that no longer fit the call's budget are
# skipped and named. Then scripts/probes/pair_report.py: a table of tokens/s per row and the change, and
# $OUT/regression_pair.json + .png (OLD_COMMIT / NEW_COMMIT name the trees there; default old / new).
# Device command (repo root; carry .base and .snap = `git archive` exports of the old commit and the new one):
#   bash scripts/probes/regression_pair.sh .base .snap sparse:262144:1 sparse:131072:3
# Env: OUT (default out/regression_pair), PYTHON (default python3), BUDGET_S (whole call, default 560),
# ROW_S (one row's limit, default 240: the 8B sparse 128K x 3 row of ea0d433 compiles for ~85 s), EXTRA (more
# bench_decode options for both trees, e.g. "--layers 1 --chunks 1 --budget 256" for a CPU check).
set -u
OLD=$(cd "${1:?old tree}" && pwd)
NEW=$(cd "${2:?new tree}" && pwd)
shift 2
[ $# -gt 0 ] || { echo "usage: $0 OLD_TREE NEW_TREE ROW [ROW ...] (bench_decode rows, side:context:batch)"; exit 2; }
OUTD=${OUT:-out/regression_pair}
mkdir -p "$OUTD/old" "$OUTD/new" && OUTD=$(cd "$OUTD" && pwd)
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-560}
ROW_S=${ROW_S:-240}
export PYTHONUNBUFFERED=1
rm -f "$OUTD"/{old,new}/decode.json "$OUTD"/{old,new}.log   # stale rows or logs must not stand in for this run's
for row in "$@"; do
    for side in old new; do
        tree=$OLD; [ $side = new ] && tree=$NEW
        left=$(( BUDGET_S - SECONDS - 10 ))
        limit=$(( left < ROW_S ? left : ROW_S ))
        if [ $limit -lt 60 ]; then echo "== $side $row: SKIPPED ($left s left in the budget)"; continue; fi
        echo "== $side $row (limit $limit s)"
        (cd "$tree" && PYTHONPATH="$tree" timeout -k 10 "$limit" "$PY" scripts/bench_decode.py --rows "$row" \
            --out "$OUTD/$side" --append --commit "$side" --row-timeout "$limit" ${EXTRA:-}) >>"$OUTD/$side.log" 2>&1 \
            || { echo "$side $row FAILED rc=$? (124 = timeout); log tail:"; tail -n 8 "$OUTD/$side.log"; }
    done
done
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m scripts.probes.pair_report "$OUTD" \
    --old-commit "${OLD_COMMIT:-old}" --new-commit "${NEW_COMMIT:-new}"
echo "total $SECONDS s"
