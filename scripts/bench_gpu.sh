#!/usr/bin/env bash
# The benchmarks on a GPU machine (written for an H200), one step per name, each within one 600 s device call:
#   bash scripts/bench_gpu.sh [select sieve tiers ingest attention layer decode profile e2e quality-passkey
#                              quality-ppl16 quality-ppl64 quality-variants]     (default: the first seven, in order)
# (`make bench-gpu BENCH="select decode"` calls this.) Every script checks against its reference before timing
# and writes its JSON row by row, so a step cut by its timeout keeps what it measured. Output: JSON + PNG under
# $OUT (default out/gpu); $COMMIT, if set, is recorded as the measured commit (the device's copy of the tree may
# have no usable .git). Nothing is installed: the checkout is on PYTHONPATH ($PY: the interpreter, default python3).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-out/gpu}
C=()
[ -n "${COMMIT:-}" ] && C=(--commit "$COMMIT")
mkdir -p "$OUT"
status=0

step() {  # step NAME SECONDS SCRIPT ARGS...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" "$PY" "$@" || { echo "!! $name exited $?"; status=1; }
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=(select sieve tiers ingest attention layer decode)
for b in "${names[@]}"; do
  case $b in
    select)     step select 300 scripts/bench_select.py --out "$OUT" "${C[@]}" --reps 5 ;;
    sieve)      step sieve 560 scripts/bench_sieve.py --out "$OUT" "${C[@]}" --requests 8192 65536 \
                  --pools 65536 1048576 --buckets 64 128 256 1024 --budget-s 0.2 --max-seconds 420 ;;
    tiers)      step tiers 300 scripts/bench_tiers.py --out "$OUT" ;;
    ingest)     step ingest 200 scripts/bench_ingest.py --out "$OUT" "${C[@]}" ;;
    attention)  step attention 560 scripts/bench_attention.py --out "$OUT" "${C[@]}" --deadline 420 ;;
    layer)      step layer 560 scripts/bench_layer.py --out "$OUT" "${C[@]}" ;;
    decode)     # the regression rows (issue 20): sparse and dense at 128K x 3 and 256K x 1, each row its own process;
                # the score launch and top-k that select.json measured fastest, when this run has one
                step decode 580 scripts/bench_decode.py --out "$OUT" "${C[@]}" --chunks 4 --row-timeout 250 \
                  $("$PY" scripts/pick_launch.py "$OUT/select.json") \
                  --rows sparse:131072:3,dense:131072:3,sparse:262144:1,dense:262144:1 ;;
    profile)    step profile 560 scripts/profile_decode.py --out "$OUT" "${C[@]}" --row-timeout 130 \
                  --rows sparse:131072:1,sparse:131072:3,dense:131072:1,sparse:262144:1 ;;
    e2e)        # first token through generate: SmolLM2 at 8K ($MODEL: its GGUF; default the installed package),
                # the 8B shape at 128K
                step e2e 560 scripts/bench_e2e.py --out "$OUT" "${C[@]}" --model "${MODEL:-smollm2-135m}" ;;
    # the quality grid of issue 19 on SmolLM2 in four calls; then, anywhere: bench_quality.py --combine
    # $OUT/q_passkey.json $OUT/q_ppl16.json $OUT/q_ppl64.json $OUT/q_variants.json --out docs/benchmarks
    quality-passkey)  step quality-passkey 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks passkey --out "$OUT" --name q_passkey "${C[@]}" ;;
    quality-ppl16)    step quality-ppl16 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl --pages 16 --out "$OUT" --name q_ppl16 "${C[@]}" ;;
    quality-ppl64)    step quality-ppl64 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl,trace --pages 64 --save-trace --out "$OUT" --name q_ppl64 "${C[@]}" ;;
    quality-variants) step quality-variants 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl --variants --out "$OUT" --name q_variants "${C[@]}" ;;
    *) echo "unknown benchmark '$b' (select sieve tiers ingest attention layer decode profile e2e" \
            "quality-passkey quality-ppl16 quality-ppl64 quality-variants)"; exit 2 ;;
  esac
done
exit $status
