#!/usr/bin/env bash
# The benchmarks on a GPU machine (written for an H200), one step per name, each within one 600 s device call:
#   bash scripts/bench_gpu.sh [select labels labels-8bit sieve sieve-decode sieve-buckets tiers ingest attention layer
#                              decode profile e2e quality-passkey16
#                              quality-passkey64 quality-passkey-low16 quality-passkey-low64 quality-ppl16
#                              quality-ppl16-copy quality-ppl64 quality-trace quality-variants auto-short auto-long
#                              decode-prefill longctx-16k longctx-32k longctx-100 longctx-diag oracle-32k decode-labels
#                              decode-labels-256k dense-fp8 exact
#                              quality-austen32k
#                              quality-austen32k-quest quality-austen32k-1of16 profile-labels profile-page16
#                              page16-rows sieve-page16 profile-two-stage
#                              longctx-15b
#                              speculative-b1 speculative-b4 speculative-step prefix-8b-on prefix-8b-off prefix-smollm2
#                              serve tokens-decode tokens-quality tokens-study token-attention profile-tokens
#                              tokens-page64]
#                              (default: select sieve tiers ingest attention layer decode, in order)
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

step() {  # step NAME SECONDS SCRIPT ARGS...: SCRIPT (scripts/x.py) runs as the module scripts.x
  local name=$1 limit=$2 mod=${3%.py}; shift 3
  mod=${mod//\//.}
  echo "== $name: -m $mod $*"
  timeout "$limit" "$PY" -m "$mod" "$@" || { echo "!! $name exited $?"; status=1; }
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=(select sieve tiers ingest attention layer decode)
for b in "${names[@]}"; do
  case $b in
    select)     step select 300 scripts/bench_select.py --out "$OUT" "${C[@]}" --reps 5 ;;
    labels|labels-8bit)   # the labels rule's page scoring alone at the 8B shape (128K x 3, C = 32): the CUDA-core
                # kernel's default launch beside the tensor-core kernel's spans x stages (4 bits); labels.json or
                # labels_8bit.json
                bits=4; [ "$b" = labels-8bit ] && bits=8
                step "$b" 300 scripts/bench_labels.py --out "$OUT" "${C[@]}" --bits "$bits" ;;
    sieve)      step sieve 560 scripts/bench_sieve.py --out "$OUT" "${C[@]}" --requests 8192 65536 \
                  --pools 65536 1048576 --buckets 64 128 256 1024 --budget-s 0.2 --max-seconds 420 ;;
    sieve-decode)   # the decode's accesses: 256 / 768 requests a layer (256K x 1 / 128K x 3 at budget 2048) and
                    # 1024 / 1536 (at 1/32) into pools of 1/4 of the KV, at bucket counts around sieve_geometry's
                    # (512 / 1024 since d2548a7: buckets of <= 512 slots), warps 4 <-> 8 beside them
                    step sieve-decode 400 scripts/bench_sieve.py --out "$OUT" "${C[@]}" --name sieve_decode \
                      --requests 256 768 1024 1536 --pools 262144 393216 --buckets 256 512 1024 2048 --budget-s 0.2 \
                      --kernel-only --variants --max-seconds 360 ;;
    sieve-page16)   # the groupings where the scan's N x B bound is passed: 6144 / 12288 requests a layer (page 16 at
                    # 128K x 3, 1/32 / 1/16) into the 1,572,864 frames of a 1/4 pool, at sieve_geometry's 4096
                    # buckets: the sort (the default there since 9f3755c), the rank count, the scan
                    step sieve-page16 300 scripts/bench_sieve.py --out "$OUT" "${C[@]}" --name sieve_page16 \
                      --requests 6144 12288 --pools 1572864 --buckets 4096 --budget-s 0.2 --kernel-only --variants \
                      --max-seconds 240 ;;
    sieve-buckets)  # the bucket floor (issue 21, sieve_geometry >= 128 buckets): the auto pools' frames at B = 1
                    # and 3 (256 / 768 requests) split into 32 to 256 buckets, the sieve alone
                    step sieve-buckets 400 scripts/bench_sieve.py --out "$OUT" "${C[@]}" --name sieve_buckets \
                      --requests 256 768 --pools 8192 16384 32768 65536 --buckets 32 64 128 256 --kernel-only \
                      --budget-s 0.2 --max-seconds 300 ;;
    tiers)      step tiers 300 scripts/bench_tiers.py --out "$OUT" "${C[@]}" ;;
    ingest)     step ingest 200 scripts/bench_ingest.py --out "$OUT" "${C[@]}" ;;
    attention)  step attention 560 scripts/bench_attention.py --out "$OUT" "${C[@]}" --deadline 420 ;;
    layer)      step layer 560 scripts/bench_layer.py --out "$OUT" "${C[@]}" ;;
    decode)     # the regression rows (issue 20): sparse and dense at 128K x 3 and 256K x 1, each row its own process;
                # the score launch and top-k that select.json measured fastest, when this run has one
                step decode 580 scripts/bench_decode.py --out "$OUT" "${C[@]}" --chunks 4 --row-timeout 250 \
                  $("$PY" -m scripts.pick_launch "$OUT/select.json") \
                  --rows sparse:131072:3,dense:131072:3,sparse:262144:1,dense:262144:1 ;;
    profile)    step profile 560 scripts/profile_decode.py --out "$OUT" "${C[@]}" --row-timeout 130 \
                  --rows sparse:131072:1,sparse:131072:3,dense:131072:1,sparse:262144:1 ;;
    e2e)        # first token through generate: SmolLM2 at 8K ($MODEL: its GGUF; default the installed package),
                # the 8B shape at 128K
                step e2e 560 scripts/bench_e2e.py --out "$OUT" "${C[@]}" --model "${MODEL:-smollm2-135m}" ;;
    # the quality grid of issue 19 on SmolLM2, each step sized to one 600 s call by the H200's cell times at 0a69cd0
    # (passkey: ~55 s dense + 50-90 s a sparse cell of 300 prompts; ppl: ~50 s a Quest cell, ~75 s a key-copy cell;
    # trace: ~27 s a pool). Then, anywhere: bench_quality.py --combine $OUT/q_*.json --out docs/benchmarks
    quality-passkey|quality-passkey16|quality-passkey64)   # the target cells (budgets >= 512), Quest and key copy 32
                  pg=16; [ "$b" = quality-passkey64 ] && pg=64
                  step "$b" 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" --tasks passkey \
                  --pages "$pg" --budgets 512,1024 --key-channels 0,32 --batch 32 \
                  --out "$OUT" --name "q_pk$pg" "${C[@]}" ;;
    quality-passkey-low16|quality-passkey-low64)           # the speed shapes' ratios (budgets 64-256)
                  pg=16; [ "$b" = quality-passkey-low64 ] && pg=64
                  step "$b" 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" --tasks passkey \
                  --pages "$pg" --budgets 64,128,256 --key-channels 0,32 --batch 32 \
                  --out "$OUT" --name "q_pklow$pg" "${C[@]}" ;;
    quality-ppl16)    step quality-ppl16 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl --pages 16 --key-channels 0 --out "$OUT" --name q_ppl16 "${C[@]}" ;;
    quality-ppl16-copy) step quality-ppl16-copy 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl --pages 16 --key-channels 32 --out "$OUT" --name q_ppl16c "${C[@]}" ;;
    quality-ppl64)    step quality-ppl64 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl --pages 64 --budgets 512,1024 --key-channels 0,32 --out "$OUT" --name q_ppl64 "${C[@]}" ;;
    quality-trace)    step quality-trace 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl,trace --pages 16 --budgets 1024 --pools 2,4 --out "$OUT" --name q_trace "${C[@]}" ;;
    quality-variants) step quality-variants 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks ppl --variants --pages 16 --budgets 1024 --out "$OUT" --name q_variants "${C[@]}" ;;
    # long-context quality on a trained 32K model (issues 47, 48): $MODEL a GGUF path (on the GPU machine: joined
    # by `python -m scripts.gguf_parts join`; its parts, cut with `split --part-mib 48` so a part and the ~12 MB
    # tree fit one call's 64 MiB, copied out of the checkout to /tmp one call at a time, since a call's carry
    # replaces the folder it names; the image lacks the `gguf` package: carry its wheel), $PROMPTS the
    # prompt file made where the haystacks are (`python -m scripts.bench_longctx --make-prompts FILE --model
    # qwen2.5-coder-0.5b ...`); one context a step (24 prompts x 9 cells at 16K took ~250 s on the H200 at --batch 24)
    longctx-16k|longctx-32k)
                ctx=16384; [ "$b" = longctx-32k ] && ctx=32768
                step "$b" 580 scripts/bench_longctx.py --prompts "${PROMPTS:?PROMPTS=prompt file}" \
                  --model "${MODEL:?MODEL=gguf path}" --contexts "$ctx" --name "$b" --out "$OUT" --deadline 540 \
                  --rules "${RULES:-dense,quest,key_copy:32,labels:32:4,two:4:labels:32:4}" \
                  --budget-ratios "${RATIOS:-0.03125,0.0625}" --batch 24 "${C[@]}" ;;
    longctx-100)    # issue 48's quality target: >= 100 prompts a task at 32K, dense and the labels at 1/32, one task a
                    # call (TASK: niah_single | niah_multikey | niah_multivalue | vt; PROMPTS: its file, 102 prompts:
                    # bench_longctx --make-prompts .prompts/lc32k_$TASK.json --tasks $TASK --contexts 32768
                    # --depths 0.1,0.5,0.9 --num-prompts 34 --haystack essays --seed 1, made on a CPU machine)
                step "$b" 580 scripts/bench_longctx.py --prompts "${PROMPTS:?PROMPTS=prompt file}" \
                  --model "${MODEL:?MODEL=gguf path}" --contexts 32768 --tasks "${TASK:?TASK=task}" \
                  --name "longctx100_${TASK}" --out "$OUT" --deadline 540 --rules "${RULES:-dense,labels:32:4}" \
                  --budget-ratios 0.03125 --batch 24 --page-size "${PAGE:-64}" "${C[@]}" ;;
    oracle-32k)     # issue 48: is multi-value at 32K lost to the labels or to the budget? greedy answers under the
                    # oracle page selection (the true page mass: scripts/studies/dense_layers.py), every layer
                    # sparse, page 16, at 1/32 and 1/16, beside dense, from one prefill a prompt. PROMPTS: a
                    # longctx-100 prompt file (.prompts/lc32k_niah_multivalue.json); MODEL: Qwen2.5-Coder-0.5B's GGUF
                step oracle-32k 590 scripts/studies/dense_layers.py --prompts "${PROMPTS:?PROMPTS=prompt file}" \
                  --model "${MODEL:?MODEL=gguf path}" --dtype bfloat16 --page-size 16 --budget 1024 2048 \
                  --dense-sets none --deadline 500 --run oracle-32k --out "$OUT" "${C[@]}" ;;
    longctx-diag)   # issue 48: are the 32K answers labels 32 @ 4 lose at 1/32 lost to selection? the same rule at a
                    # near-covering budget (496 of 512 pages): dense's answers there = selection loses them
                step longctx-diag 580 scripts/bench_longctx.py --prompts "${PROMPTS:?PROMPTS=prompt file}" \
                  --model "${MODEL:?MODEL=gguf path}" --contexts 32768 --name longctx-diag --out "$OUT" --deadline 540 \
                  --rules dense,labels:32:4 --budgets 1024,31744 --batch 24 "${C[@]}" ;;
    quality-austen32k) # issue 47 / 48: perplexity, top-1 and KL to dense on 32K windows of Jane Austen's novels,
                    # 4096 positions past 28K scored a window, and the selection trace's hit rates, for the labels
                    # (32 of 64 channels @ 4 bits) at budget 1024 (1/32); then Quest. TEXT: the novels as a text file
                    # (python -c "from scripts.bench_quality import corpus_text; print(corpus_text('austen')[0])" > F
                    # on a machine with the source); MODEL: Qwen2.5-Coder-0.5B's GGUF
                    # The labels' call also measures the top-1 noise floor (dense bf16 vs dense float32, same
                    # windows: --noise-floor); quality-austen32k-quest is Quest's call.
                step "$b" 420 scripts/bench_quality.py --model "${MODEL:?MODEL=gguf path}" --text "${TEXT:?TEXT=file}" \
                  --tasks ppl,trace --ppl-window 32768 --ppl-prefix 28672 --ppl-windows 2 --trace-steps 256 \
                  --budgets 1024 --pages 64 --key-channels 32 --label-bits 4 --pools 4,8,16 --noise-floor \
                  --out "$OUT" --name q_austen32k_c32 "${C[@]}" ;;
    quality-austen32k-quest)
                step "$b" 300 scripts/bench_quality.py --model "${MODEL:?MODEL=gguf path}" --text "${TEXT:?TEXT=file}" \
                  --tasks ppl,trace --ppl-window 32768 --ppl-prefix 28672 --ppl-windows 2 --trace-steps 256 \
                  --budgets 1024 --pages 64 --key-channels 0 --pools 4,8,16 --out "$OUT" --name q_austen32k_c0 \
                  "${C[@]}" ;;
    quality-austen32k-1of16) # the same windows at budget 2048 (1/16, issue 48's "2048 allowed"), pages 64 and 32:
                    # on SmolLM2 (CPU) the labels sit at the exact-mass ceiling at a fixed budget, so the budget
                    # and the page size are what is left to buy perplexity with
                step "$b" 580 scripts/bench_quality.py --model "${MODEL:?MODEL=gguf path}" --text "${TEXT:?TEXT=file}" \
                  --tasks ppl --ppl-window 32768 --ppl-prefix 28672 --ppl-windows 2 --budgets 2048 --pages 64,32 \
                  --key-channels 32 --label-bits 4 --out "$OUT" --name q_austen32k_1of16 "${C[@]}" ;;
    profile-labels) # where the labels' decode step goes (31% of its byte floor at 128K x 3): one chunk traced,
                    # labels 64 @ 4 bits at 1/32 with the trace's hit rate, beside Quest
                step profile-labels 560 scripts/profile_decode.py --out "$OUT/labels" "${C[@]}" --row-timeout 250 \
                  --budget 4096 --key-channels 64 --label-bits 4 --hot-share 0.9 --rows sparse:131072:3 && \
                step profile-labels 300 scripts/profile_decode.py --out "$OUT/labels" "${C[@]}" --append \
                  --row-timeout 250 --budget 4096 --rows sparse:131072:3 ;;
    profile-page16) # issue 48: why every label channel at page 16 decodes at 0.92x dense while it reads 0.381 of
                    # dense's bytes (page 64: 1.50x): one chunk traced at each page, 128K x 3, 1/32, hot share 0.9
                step profile-page16 560 scripts/profile_decode.py --out "$OUT/page16" "${C[@]}" --row-timeout 250 \
                  --budget 4096 --page-size 16 --key-channels 128 --label-bits 4 --hot-share 0.9 \
                  --rows sparse:131072:3 && \
                step profile-page16 300 scripts/profile_decode.py --out "$OUT/page16" "${C[@]}" --append \
                  --row-timeout 250 --budget 4096 --page-size 64 --key-channels 128 --label-bits 4 --hot-share 0.9 \
                  --rows sparse:131072:3 ;;
    page16-rows)    # issue 48 after the sieve's sort fallback (9f3755c): every channel (128 @ 4) at page 16, 128K x 3,
                    # hot share 0.9, one call: 1/32 with the default top-k (lax.top_k: 16384 padded pages is past
                    # the radix kernel's TOPK_MAX_PAGES), the same with --topk pallas (the kernel at 16384: does it
                    # compile, and is it faster?), 1/16 (budget 8192: the oracle keeps 82% of dense's multi-value
                    # answers there, 66% at 1/32), and dense; each row its own process (~80 s a row on an H100)
                pg16=(--out "$OUT/page16_rows" "${C[@]}" --append --chunks 4 --row-timeout 150 --page-size 16
                      --key-channels 128 --label-bits 4 --hot-share 0.9)
                step "$b" 160 scripts/bench_decode.py "${pg16[@]}" --budget 4096 --rows sparse:131072:3
                step "$b" 160 scripts/bench_decode.py "${pg16[@]}" --budget 4096 --rows sparse:131072:3 --topk pallas
                step "$b" 160 scripts/bench_decode.py "${pg16[@]}" --budget 8192 --rows sparse:131072:3
                step "$b" 100 scripts/bench_decode.py "${pg16[@]}" --budget 4096 --rows dense:131072:3 ;;
    profile-two-stage) # where the two-stage rule's extra ~2 ms a step over Quest goes at 128K x 3, 1/32 (the
                    # shortlist's top-k, the labels over it, the spread, the second top-k), beside Quest's layer
                step profile-two-stage 560 scripts/profile_decode.py --out "$OUT/two_stage" "${C[@]}" \
                  --row-timeout 250 --budget 4096 --key-channels 64 --label-bits 4 --two-stage 4 --hot-share 0.9 \
                  --rows sparse:131072:3 && \
                step profile-two-stage 300 scripts/profile_decode.py --out "$OUT/two_stage" "${C[@]}" --append \
                  --row-timeout 250 --budget 4096 --hot-share 0.9 --rows sparse:131072:3 ;;
    longctx-15b)    # issue 48's quality target on Qwen2.5-Coder-1.5B (head dim 128, like the 8B shape): one task of
                    # longctx-100's prompt files (the 1.5B shares the 0.5B's tokenizer) at 1/32, dense and the labels
                    # at D/2 and D/4 with the shipped offline table (so they share prompt prefixes as dense does);
                    # its calls' rows and outputs join docs/benchmarks/longctx100.json as runs, each with its `model`
                step "$b" 580 scripts/bench_longctx.py --prompts "${PROMPTS:?PROMPTS=prompt file}" \
                  --model "${MODEL:?MODEL=the 1.5B GGUF}" --contexts 32768 --tasks "${TASK:?TASK=task}" \
                  --name "longctx15b_${TASK}" --out "$OUT" --deadline 540 \
                  --rules "${RULES:-dense,labels:64:4:auto,labels:32:4:auto}" --budget-ratios 0.03125 --batch 24 \
                  "${C[@]}" ;;
    decode-labels|decode-labels-256k)
                    # issue 48's speed rows at 1/32 (budget 4096 of 128K x 3, or 8192 of 256K x 1) with labels 32 of
                    # 128 @ 4 bits (a quarter of the head dimension: the quality rows' fraction on the 1.5B), the hit
                    # rate held under the Qwen 32K trace's (0.970 at pool 1/4) by planted hot pages; Quest and dense
                    # in the same call (one call each; ~65 s a row on an H100); PAGE: the page size (default 64;
                    # longctx-100 takes it too, for quality and speed at the same page); CHANNELS: the label
                    # channels of 128 (default 32)
                rows=sparse:131072:3,dense:131072:3; budget=4096
                [ "$b" = decode-labels-256k ] && { rows=sparse:262144:1,dense:262144:1; budget=8192; }
                step "$b" 400 scripts/bench_decode.py --out "$OUT/labels" "${C[@]}" --chunks 4 --append \
                  --row-timeout 130 --budget "$budget" --rows "$rows" --page-size "${PAGE:-64}" && \
                step "$b" 180 scripts/bench_decode.py --out "$OUT/labels" "${C[@]}" --chunks 4 --append \
                  --row-timeout 130 --budget "$budget" --key-channels "${CHANNELS:-32}" --label-bits 4 \
                  --hot-share 0.9 --rows "${rows%%,*}" --page-size "${PAGE:-64}" ;;
    dense-fp8)      # issue 50: the dense baseline over fp8 pages (the page walk, and XLA's decoded cache) beside
                    # dense bf16, 128K x 3, one call; then the walk's launch shapes
                for a in "--kv-dtype float8_e4m3fn" "--kv-dtype float8_e4m3fn --dense-attention xla" ""; do
                  step dense-fp8 130 scripts/bench_decode.py --out "$OUT/fp8" "${C[@]}" --chunks 4 --append \
                    --row-timeout 120 --rows dense:131072:3 $a
                done
                step dense-fp8 200 scripts/probes/dense_walk_tuning.py --batch 3 --context 131072 ;;
    quality-passkey-split2) step quality-passkey-split2 580 scripts/bench_quality.py --model "${MODEL:-smollm2-135m}" \
                  --tasks passkey --contexts 8192 --pages 16 --budgets 512,1024 --summary-split 2 --out "$OUT" \
                  --name q_passkey_split2 "${C[@]}" ;;
    # attention="auto" against both paths, same run (issue 21): short contexts, then the long ones appended
    auto-short) step auto-short 580 scripts/bench_decode.py --out "$OUT/auto" "${C[@]}" --chunks 4 --row-timeout 180 \
                  --rows sparse:8192:8,dense:8192:8,auto:8192:8,sparse:32768:1,dense:32768:1,auto:32768:1 ;;
    auto-long)  step auto-long 580 scripts/bench_decode.py --out "$OUT/auto" "${C[@]}" --chunks 4 --row-timeout 180 \
                  --append --rows sparse:262144:1,dense:262144:1,auto:262144:1 ;;
    # real prefill before decode, time to first token beside decode (issue 21 part 6): $OUT/prefill/decode.json,
    # kept as docs/benchmarks/decode_variants.json's rows of variant 'prefill'
    decode-prefill) step decode-prefill 580 scripts/bench_decode.py --out "$OUT/prefill" "${C[@]}" --fill prefill \
                  --chunks 4 --row-timeout 150 \
                  --rows sparse:32768:1,dense:32768:1,auto:32768:1,sparse:131072:1,dense:131072:1 ;;
    # speculative decoding (issue 22): SmolLM2 with and without drafts, one batch size a call; then the
    # verification step's cost at the 8B shape
    speculative-b1) step speculative-b1 580 scripts/bench_speculative.py --model "${MODEL:-smollm2-135m}" \
                  --batches 1 --out "$OUT" "${C[@]}" ;;
    speculative-b4) step speculative-b4 580 scripts/bench_speculative.py --model "${MODEL:-smollm2-135m}" \
                  --batches 4 --tasks continue,quote,sampled --append --out "$OUT" \
                  "${C[@]}" ;;
    exact)          # exact mode at the 8B shape (issue 48 item 5): dense step, labels drafter step, the cycle and its
                    # parts; one row a process (128K x 3 does not fit an H100 with both caches)
                for r in 131072:2 262144:1; do
                  step exact 290 scripts/bench_exact.py --out "$OUT" "${C[@]}" --append --rows "$r" --ks 2,4 --reps 6
                done ;;
    speculative-step) step speculative-step 580 scripts/bench_speculative.py --step-cost \
                  --out "$OUT" "${C[@]}" ;;
    # shared prefixes (issue 24): 16 questions over one 128K document with and without sharing, then SmolLM2 at 8K
    prefix-8b-on)   step prefix-8b-on 580 scripts/bench_prefix.py --rows 8b:130816 --modes on --row-timeout 560 \
                  --out "$OUT" "${C[@]}" ;;
    prefix-8b-off)  step prefix-8b-off 580 scripts/bench_prefix.py --rows 8b:130816 --modes off --append \
                  --row-timeout 560 --out "$OUT" "${C[@]}" ;;
    prefix-smollm2) step prefix-smollm2 580 scripts/bench_prefix.py --rows smollm2:8192 --append --row-timeout 280 \
                  --model "${MODEL:-smollm2-135m}" --out "$OUT" "${C[@]}" ;;
    # the serving benchmark (issue 49 item 6): `ulacache serve` (started by the script) and 32 streaming openai
    # clients, real text, prompts 1K-32K, 256 new tokens, beside the offline Engine on the same requests; a 32K
    # prompt admitted while they stream. $MODEL: Qwen2.5-Coder-0.5B's GGUF path (default the packaged name)
    tokens-decode)  # issue 48: per-token selection's speed at 128K x 3, page 16, labels 32 @ 4, hot share 0.9 on
                    # the pages a step selects, each row its own process (~85 s a row on an H100): pages and dense
                    # (the baselines, same call), tokens of a 2x shortlist at 1/32 and 1/16, of a 4x one at 1/32
                tk=(--out "$OUT/tokens_decode" "${C[@]}" --append --chunks 4 --row-timeout 150 --page-size 16
                    --key-channels 32 --label-bits 4 --hot-share 0.9 --run "${RUN:-tokens-decode}")
                step "$b" 320 scripts/bench_decode.py "${tk[@]}" --budget 4096 --rows sparse:131072:3,dense:131072:3
                step "$b" 160 scripts/bench_decode.py "${tk[@]}" --budget 4096 --rows sparse:131072:3 \
                  --token-shortlist 2
                step "$b" 160 scripts/bench_decode.py "${tk[@]}" --budget 8192 --rows sparse:131072:3 \
                  --token-shortlist 2
                step "$b" 160 scripts/bench_decode.py "${tk[@]}" --budget 4096 --rows sparse:131072:3 \
                  --token-shortlist 4 ;;
    tokens-quality) # issue 48: the library's own per-token selection on the 32K Austen windows of quality-austen32k
                    # (labels 32 @ 4, page 16, tokens of a 2x shortlist; SHORTLIST=4 for the 4x) at 1/32 and 1/16,
                    # and the selection trace's hit rates at pools 1/4 and 1/8. TEXT, MODEL: as quality-austen32k
                step "$b" 560 scripts/bench_quality.py --model "${MODEL:?MODEL=gguf path}" --text "${TEXT:?TEXT=file}" \
                  --dtype bfloat16 --tasks ppl,trace --ppl-window 32768 --ppl-prefix 28672 --ppl-windows 2 \
                  --trace-steps 256 --budgets 1024,2048 --pages 16 --key-channels 32 --label-bits 4 \
                  --token-shortlist "${SHORTLIST:-2}" --pools 4,8 --out "$OUT" --name "tokens_quality_${SHORTLIST:-2}" \
                  "${C[@]}" ;;
    tokens-study)   # issue 48: how much of a 4x shortlist's choice survives reading only the 2x budget pages
                    # holding the most chosen mass (oracle_ppl --fetch; the library's token_fetch lost to a 2x
                    # shortlist at 8K and was deleted: does 32K say otherwise?), labels 32 @ 4, on the study's
                    # 4092 positions of the 32K windows
                step "$b" 560 scripts/studies/oracle_ppl.py --model "${MODEL:?MODEL=gguf path}" \
                  --text "${TEXT:?TEXT=file}" --dtype bfloat16 --window 32768 --prefix 30720 --windows 2 \
                  --page-size 16 --budget 1024 2048 --label-channels 32 --label-bits 4 --select tokens \
                  --shortlist 2 4 --fetch 0 2 --run tokens-fetch --deadline 500 --out "$OUT" "${C[@]}" ;;
    profile-tokens) # issue 48: where per-token selection's step goes (2x shortlist: 1.05x dense where pages of 16
                    # give 1.53x, run AL) at 128K x 3, 1/32, page 16, labels 32 @ 4, hot share 0.9: the token row,
                    # then the pages row it is compared with
                pt=(--out "$OUT/tokens_profile" "${C[@]}" --row-timeout 220 --budget 4096 --page-size 16
                    --key-channels 32 --label-bits 4 --hot-share 0.9 --rows sparse:131072:3)
                step "$b" 240 scripts/profile_decode.py "${pt[@]}" --token-shortlist 2 && \
                step "$b" 240 scripts/profile_decode.py "${pt[@]}" --append ;;
    tokens-page64)  # issue 48: per-token selection in a 2x shortlist of pages of 64 (half the page requests of
                    # whole pages of 16; token_pages' 32K recall 0.818 against 0.804 for pages of 16 and 0.838 for
                    # tokens in pages of 16): speed at 128K x 3, 1/32 (pages of 64 and dense the baselines, same
                    # call), then the library's 32K ppl (MODEL, TEXT as tokens-quality)
                t6=(--out "$OUT/tokens_page64" "${C[@]}" --append --chunks 4 --row-timeout 150 --page-size 64
                    --key-channels 32 --label-bits 4 --hot-share 0.9 --run "${RUN:-tokens-page64}" --budget 4096)
                step "$b" 320 scripts/bench_decode.py "${t6[@]}" --rows sparse:131072:3,dense:131072:3
                step "$b" 160 scripts/bench_decode.py "${t6[@]}" --rows sparse:131072:3 --token-shortlist 2
                [ -n "${MODEL:-}" ] && step "$b" 400 scripts/bench_quality.py --model "$MODEL" \
                  --text "${TEXT:?TEXT=file}" \
                  --dtype bfloat16 --tasks ppl --ppl-window 32768 --ppl-prefix 28672 --ppl-windows 2 \
                  --budgets 1024,2048 --pages 64 --key-channels 32 --label-bits 4 --token-shortlist 2 \
                  --out "$OUT" --name tokens_quality_p64 "${C[@]}" ;;
    token-attention) # the per-token attention kernel against the page kernel over the same tokens
                step "$b" 400 scripts/bench_attention.py --only ceiling token --out "$OUT" "${C[@]}" --deadline 320 ;;
    serve)      step serve 590 scripts/bench_serve.py --model "${MODEL:-qwen2.5-coder-0.5b}" --dtype bfloat16 \
                  --clients 32 --prompt-lengths 1024,4096,32768 --weights 0.6,0.3,0.1 --max-tokens 256 \
                  --page-size 64 --token-budget 2048 --prefill-chunk-tokens 2048 --max-context 33024 \
                  --compile-cache "$OUT/jax_cache" --time-limit 300 --startup-timeout 240 --out "$OUT" "${C[@]}" ;;
    *) echo "unknown benchmark '$b' (select labels labels-8bit sieve sieve-decode sieve-buckets tiers ingest" \
            "attention layer decode profile e2e" \
            "quality-passkey16 quality-passkey64 quality-passkey-low16 quality-passkey-low64 quality-ppl16" \
            "quality-ppl16-copy quality-ppl64 quality-trace quality-variants auto-short auto-long decode-prefill" \
            "speculative-b1 speculative-b4 speculative-step prefix-8b-on prefix-8b-off prefix-smollm2 longctx-16k" \
            "longctx-32k longctx-100 longctx-diag" \
            "decode-labels decode-labels-256k dense-fp8 exact quality-austen32k quality-austen32k-quest" \
            "quality-austen32k-1of16" \
            "profile-labels profile-page16 page16-rows profile-two-stage longctx-15b serve tokens-decode" \
            "tokens-quality tokens-study token-attention profile-tokens tokens-page64)"; exit 2 ;;
  esac
done
exit $status
