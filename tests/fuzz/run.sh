#!/bin/bash
# tests/fuzz/run.sh [TARGET] [SECONDS] — build a fuzzer with clang (libFuzzer
# + ASan + UBSan) straight from the sources and run it. TARGET:
# safetensors_header (default, below), or openai_request, chat_template,
# tokenizer, model_config, cluster_config, model_folder, rank_protocol, rank_endpoint
# (tests/fuzz/run_target.sh).
#
# Build and corpus live in $EXL3_BUILD_DIR/fuzz (default /tmp/exl3serve-fuzz);
# the corpus grows across runs. Exits non-zero when the fuzzer finds a crash,
# leak, sanitizer report or contract violation; the reproducer is written to
# <fuzz dir>/artifacts/. Reproduce with: <fuzz dir>/safetensors_header_fuzz FILE
# One brace group, parsed before it runs (see run_target.sh).
{
set -euo pipefail

target=safetensors_header
if [[ $# -gt 0 && ! $1 =~ ^[0-9]+$ ]]; then
  target=$1
  shift
fi
seconds=${1:-60}
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
shared=${EXL3_SHARED_DIR:-$(cd "$src/.." && pwd)/shared}
if [[ -n "${EXL3_BUILD_DIR:-}" ]]; then
  out=$EXL3_BUILD_DIR/fuzz
else
  out=/tmp/exl3serve-fuzz
fi
cxx=${CLANGXX:-clang++}

if ! command -v "$cxx" >/dev/null; then
  echo "run.sh: $cxx not found; install clang (and libclang-rt-dev) to fuzz" >&2
  exit 2
fi

if [[ $target != safetensors_header ]]; then
  exec bash "$src/tests/fuzz/run_target.sh" "$target" "$seconds"
fi

mkdir -p "$out/corpus" "$out/seeds" "$out/artifacts"
binary=$out/safetensors_header_fuzz
sources=("$src/tests/fuzz/safetensors_header_fuzz.cc" "$src"/sharding/safetensors*.cc
         "$src/common/status_macros.cc" "$src/common/logging.cc")

# Rebuild only when a source or header of the module changed.
needs_build=1
if [[ -x "$binary" ]]; then
  needs_build=0
  for f in "${sources[@]}" "$src"/sharding/safetensors*.h "$src"/common/*.h \
           "$src/kernels/trellis_decode.h" "$0"; do
    if [[ "$f" -nt "$binary" ]]; then needs_build=1; break; fi
  done
fi
if [[ $needs_build == 1 ]]; then
  echo "run.sh: building $binary"
  # shellcheck disable=SC2046  # pkg-config output is a word list
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=undefined -I"$src" "${sources[@]}" \
    $(pkg-config --cflags --libs absl_status absl_statusor absl_strings absl_str_format \
        absl_flat_hash_map absl_raw_hash_set absl_hash) \
    -o "$binary.tmp"
  mv "$binary.tmp" "$binary"
fi

# Seeds: the shared EXL3 vectors (small ones; the data section only matters
# through its size) and a few hand-made edge cases.
if [[ -d "$shared/testdata" ]]; then
  n=0
  while IFS= read -r -d '' f; do
    n=$((n + 1))
    cp "$f" "$out/seeds/vector_$n.safetensors"
  done < <(find "$shared/testdata" -name model.safetensors -size -20k -print0 | sort -z)
fi
seed() {  # seed NAME HEADER DATA_BYTES
  local header=$2
  python3 - "$out/seeds/$1" "$header" "$3" <<'PY' 2>/dev/null || true
import struct, sys
path, header, data = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
open(path, "wb").write(struct.pack("<Q", len(header)) + header + bytes(range(256)) * (data // 256) + bytes(data % 256))
PY
}
seed empty '{}' 0
seed metadata '{"__metadata__":{"format":"pt"},"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}' 4
seed scalar_and_empty '{"m":{"dtype":"I32","shape":[],"data_offsets":[0,4]},"z":{"dtype":"BF16","shape":[0,3],"data_offsets":[4,4]}}' 4
seed padded '{"w":{"dtype":"I16","shape":[2,2],"data_offsets":[0,8]}}      ' 8

set +e
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} \
  "$binary" "$out/corpus" "$out/seeds" -dict="$src/tests/fuzz/safetensors.dict" \
  -max_total_time="$seconds" -max_len=20480 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$out/artifacts/" -print_final_stats=1
rc=$?
set -e
if [[ $rc != 0 ]]; then
  echo "run.sh: fuzzer failed (exit $rc); reproducer in $out/artifacts/" >&2
fi
exit $rc
}
