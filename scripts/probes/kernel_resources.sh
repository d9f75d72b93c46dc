#!/usr/bin/env bash
# What the compiler made of Pallas (Triton) kernels, on a GPU machine: registers, spills, shared memory and the
# instruction mix of every kernel whose name matches REGEX, read off XLA's PTX dump of COMMAND (ptxas -v, then
# cuobjdump's SASS opcode counts). No hardware counters needed (ncu is absent on some runtimes).
#   bash scripts/probes/kernel_resources.sh REGEX OUTDIR COMMAND...
# e.g. bash scripts/probes/kernel_resources.sh label_page_lse $OUT/res python3 -m scripts.bench_labels --out $OUT/l
set -uo pipefail
regex=$1; out=$2; shift 2
mkdir -p "$out"
dump=$(mktemp -d)
XLA_FLAGS="--xla_dump_to=$dump ${XLA_FLAGS:-}" "$@"
rc=$?
ptxas=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -1)
cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
echo "ptxas: ${ptxas:-none}; cuobjdump: ${cuobjdump:-none}"
for f in $(grep -l -E "\.entry[^(]*($regex)" "$dump"/*.ptx 2>/dev/null); do
  base=$(basename "$f" .ptx)
  cp "$f" "$out/$base.ptx"
  [ -n "$ptxas" ] || continue
  arch=$(grep -m1 -o 'sm_[0-9]*a\?' "$f")
  "$ptxas" -arch="$arch" -v "$f" -o "$out/$base.cubin" 2>&1 | grep -A2 -E "Compiling entry function '[^']*($regex)" \
    | tee "$out/$base.resources.txt"
  if [ -n "$cuobjdump" ]; then
    "$cuobjdump" -sass "$out/$base.cubin" > "$out/$base.sass" 2>/dev/null
    python3 - "$out/$base.sass" "$regex" <<'PY'
import collections, re, sys
fn, counts = None, {}
for line in open(sys.argv[1]):
    m = re.search(r"Function : (\S+)", line)
    if m:
        fn = m.group(1); counts[fn] = collections.Counter(); continue
    m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
    if fn and m:
        counts[fn][m.group(1)] += 1
for fn, c in counts.items():
    if re.search(sys.argv[2], fn):
        print(fn, sum(c.values()), "instructions:", ", ".join(f"{k} {v}" for k, v in c.most_common(40)))
PY
  fi
done
rm -rf "$dump"
exit $rc
