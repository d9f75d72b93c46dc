#!/usr/bin/env bash
# The H200 runbook as three device calls (each fits the 600 s per-call limit; fire them back to back so the
# machine stays warm): bash scripts/h200_session.sh {layer|decode|rest} COMMIT
# Every step has its own timeout and every script writes its JSON row by row, so a slow step loses only itself.
# The selection launch shape measured by `layer` is kept in /tmp on the device and read by the later calls
# (a fresh machine has none: they fall back to the kernels' defaults).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ulacache_out}; C=$2; mkdir -p "$OUT"
flags() { python3 scripts/pick_launch.py /tmp/ulacache_select.json /tmp/ulacache_layer.json; }
case $1 in
layer)   # issue 5: score launch shapes and top-k variants, then the 256K x 32 layer rows with the best shape
  timeout 130 python3 scripts/bench_select.py --out "$OUT" --commit "$C" --reps 5
  cp "$OUT/select.json" /tmp/ulacache_select.json
  SL=$(python3 scripts/pick_launch.py "$OUT/select.json" | grep -o -- '--score-launch [0-9]* [0-9]*')
  echo "layer flags: $SL"
  timeout 430 python3 scripts/bench_layer.py --out "$OUT" --commit "$C" --calls 8 --reps 3 --budgets 2048 4096 1024 $SL
  cp "$OUT/layer.json" /tmp/ulacache_layer.json ;;
decode)  # issue 7: batch 1 and the largest dense batch at 128K and 256K, sparse and dense, same run
  F=$(flags); echo "decode flags: $F"
  timeout 580 python3 scripts/bench_decode.py --out "$OUT" --commit "$C" --chunks 4 --row-timeout 200 $F \
    --rows sparse:131072:1,dense:131072:1,sparse:131072:7,dense:131072:7,dense:262144:3,sparse:262144:3,dense:262144:1,sparse:262144:1 ;;
rest)    # issue 7 pool sweep + 32K pair, issue 3 large-N sieve rows, issue 5 layer shape sweep
  F=$(flags); echo "flags: $F"
  SL=$(echo "$F" | grep -o -- '--score-launch [0-9]* [0-9]*')
  mkdir -p "$OUT/decode2"
  timeout 200 python3 scripts/bench_decode.py --out "$OUT/decode2" --commit "$C" --chunks 4 --row-timeout 80 $F \
    --rows sparse:131072:1:0.5,sparse:131072:1:0.125,sparse:32768:1,dense:32768:1
  timeout 110 python3 scripts/bench_sieve.py --out "$OUT" --commit "$C" --requests 65536 262144 --buckets 64 128 256 1024 \
    --budget-s 0.2 --max-seconds 80 --name sieve_large_n
  timeout 105 python3 scripts/bench_layer.py --out "$OUT" --commit "$C" --batch 8 --context 262144 --budgets 1024 2048 4096 \
    --calls 8 --reps 3 --no-stages --no-compare --name layer_b8_256k $SL
  timeout 105 python3 scripts/bench_layer.py --out "$OUT" --commit "$C" --batch 32 --context 131072 --budgets 1024 2048 4096 \
    --calls 8 --reps 3 --no-stages --no-compare --name layer_b32_128k $SL ;;
*) echo "usage: $0 {layer|decode|rest} COMMIT"; exit 2 ;;
esac
