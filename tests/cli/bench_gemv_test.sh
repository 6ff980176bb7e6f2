#!/usr/bin/env bash
# `exl3serve bench gemv` prints one line ending in weights_per_s=<number>, for
# the trellis kernel and (when built with OpenBLAS) the dense baseline, and
# rejects bad shapes with exit code 1. Timing values are not checked.
set -euo pipefail
BIN=$1
fail() { echo "FAIL: $*" >&2; exit 1; }

out=$("$BIN" bench gemv --k 3 --shape 256x384 --batch 2 --threads 1 --repeats 2 --cycle-mib 1)
[ "$(printf '%s\n' "$out" | wc -l)" = 1 ] || fail "expected one line, got: $out"
[[ $out =~ ^gemv\ shape=256x384\ kernel=trellis\ codebook=mul1\ K=3\ .*\ weights_per_s=[0-9]+$ ]] ||
  fail "unexpected line: $out"
# 256·384·3/8 = 36864 packed bytes per copy: ceil(1 MiB / 36864) = 29 copies.
[[ $out =~ copies=29\ copy_bytes=36864\  ]] || fail "expected 29 copies of 36864 bytes: $out"

if out=$("$BIN" bench gemv --dense --shape 256x384 --threads 1 --repeats 2 --cycle-mib 1 2>&1); then
  [[ $out =~ kernel=openblas-fp32\ .*weights_per_s=[0-9]+$ ]] || fail "unexpected dense line: $out"
else
  [[ $out =~ OpenBLAS ]] || fail "dense without OpenBLAS should say so: $out"
fi

if err=$("$BIN" bench gemv --shape 100x384 2>&1); then fail "bad shape accepted"; fi
[[ $err =~ "got '100x384'" ]] || fail "bad-shape message: $err"
echo OK
