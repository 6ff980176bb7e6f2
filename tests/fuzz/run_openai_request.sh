#!/bin/bash
# tests/fuzz/run_openai_request.sh [SECONDS] — the OpenAI request-body fuzzer
# (openai_request_fuzz.cc) built with clang + libFuzzer + ASan + UBSan and run
# (also reached as `tests/fuzz/run.sh openai_request SECONDS`). The generated
# protobuf code comes from a build: $EXL3_BUILD_DIR (default ./build).
# Output in $EXL3_BUILD_DIR/fuzz-openai (corpus/, seeds/, artifacts/);
# non-zero exit on any finding. Reproduce: <dir>/openai_request_fuzz FILE
set -euo pipefail
seconds=${1:-60}
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
build=${EXL3_BUILD_DIR:-$src/build}
out=$build/fuzz-openai
cxx=${CLANGXX:-clang++}
command -v "$cxx" >/dev/null || { echo "run_openai_request.sh: $cxx not found; install clang" >&2; exit 2; }
gen=$build/proto/gen
[[ -f $gen/exl3serve/v1/generation.pb.cc ]] ||
  { echo "run_openai_request.sh: no generated protobuf code in $gen (build first)" >&2; exit 2; }
mkdir -p "$out/corpus" "$out/seeds" "$out/artifacts"
binary=$out/openai_request_fuzz
sources=("$src/tests/fuzz/openai_request_fuzz.cc" "$src/coordinator/http/openai_request.cc"
         "$gen/exl3serve/v1/generation.pb.cc")
needs_build=1
if [[ -x "$binary" ]]; then
  needs_build=0
  for f in "${sources[@]}" "$src/coordinator/http/openai_request.h" "$0"; do
    if [[ "$f" -nt "$binary" ]]; then needs_build=1; break; fi
  done
fi
if [[ $needs_build == 1 ]]; then
  echo "run_openai_request.sh: building $binary"
  # shellcheck disable=SC2046  # pkg-config output is a word list
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$src" -I"$gen" "${sources[@]}" \
    $(pkg-config --cflags --libs protobuf absl_strings absl_str_format) -o "$binary.tmp"
  mv "$binary.tmp" "$binary"
fi
seed() { printf '%s' "$2" > "$out/seeds/$1.json"; }
seed chat '{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0.7,"top_p":0.9,"top_k":40,"max_tokens":16,"stop":["\n"],"seed":1,"logprobs":true,"top_logprobs":2,"stream":true,"stream_options":{"include_usage":true}}'
seed tools '{"messages":[{"role":"user","content":"weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"w","arguments":"{\"c\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}],"tools":[{"type":"function","function":{"name":"w","parameters":{"type":"object"}}}],"tool_choice":{"type":"function","function":{"name":"w"}},"parallel_tool_calls":false}'
seed completions '{"prompt":["a","b"],"n":2,"echo":true,"logprobs":3,"logit_bias":{"7":-100},"stop_token_ids":[2]}'
seed ids '{"prompt":[[1,2,3],[4,5]],"max_completion_tokens":4,"ignore_eos":true}'
seed tokenize '{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":true,"return_token_strs":true}'
seed detokenize '{"tokens":[1,2,3]}'
seed kwargs '{"messages":[{"role":"assistant","content":"Once","reasoning_content":"r"}],"continue_final_message":true,"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false},"reasoning_effort":"low"}'
set +e
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} \
  "$binary" "$out/corpus" "$out/seeds" -dict="$src/tests/fuzz/openai_request.dict" \
  -max_total_time="$seconds" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$out/artifacts/" -print_final_stats=1
rc=$?
set -e
[[ $rc == 0 ]] || echo "run_openai_request.sh: fuzzer failed (exit $rc); reproducer in $out/artifacts/" >&2
exit $rc
