#!/usr/bin/env bash
# The main job on its built-in default (README's first command runs exactly
# this binary with no arguments): it must finish and print the table.
set -euo pipefail
BIN=$1
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
"$BIN" --log-level warning >"$OUT" 2>&1 || { cat "$OUT"; exit 1; }
grep -q "model.layers.1.mlp.down_proj" "$OUT" || { cat "$OUT"; echo "FAIL: no table"; exit 1; }
grep -q "EXL3 linears decode" "$OUT" || { cat "$OUT"; echo "FAIL: no reload"; exit 1; }
# The demo model has large logit margins: the 3.5-bpw EXL3 model must
# continue the prompt exactly like the original.
grep -q "the first 16 of 16 tokens agree" "$OUT" || { cat "$OUT"; echo "FAIL: EXL3 greedy continuation diverged"; exit 1; }
echo "demo: OK"
