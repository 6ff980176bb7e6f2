#!/bin/bash
# tests/fuzz/run_target.sh TARGET [SECONDS] — the libFuzzer targets other than
# the safetensors header (reached as `tests/fuzz/run.sh TARGET SECONDS`),
# built with clang + libFuzzer + ASan + UBSan straight from the sources:
#   openai_request   HTTP API request bodies      (needs a build's generated protobuf code)
#   chat_template    template text + context JSON
#   tokenizer        tokenizer.json + tokenizer_config.json + text
#   model_config     config.json + generation_config.json
# Output in $EXL3_BUILD_DIR/fuzz-TARGET (default ./build): corpus/ (grows
# across runs), seeds/, artifacts/ (reproducers). Non-zero exit on a finding.
# Reproduce: <dir>/TARGET_fuzz FILE
set -euo pipefail
target=${1:?usage: run_target.sh TARGET [SECONDS]}
seconds=${2:-60}
src=${EXL3_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
shared=${EXL3_SHARED_DIR:-$(cd "$src/.." && pwd)/shared}
build=${EXL3_BUILD_DIR:-$src/build}
out=$build/fuzz-$target
cxx=${CLANGXX:-clang++}
command -v "$cxx" >/dev/null || { echo "run_target.sh: $cxx not found; install clang" >&2; exit 2; }
mkdir -p "$out/corpus" "$out/seeds" "$out/artifacts"
seed() { printf '%s' "$2" >"$out/seeds/$1"; }
seed_file() { [ -f "$2" ] && cp "$2" "$out/seeds/$1" || true; }

tokenizer_sources=("$src"/coordinator/tokenizer/*.cc "$src/sharding/safetensors_json.cc" "$src/sharding/safetensors_atomic_file.cc"
                   "$src/common/status_macros.cc" "$src/common/logging.cc")
extra_flags=()
max_len=65536
timeout=30
dict=""
case $target in
  openai_request)
    gen=$build/proto/gen
    [[ -f $gen/exl3serve/v1/generation.pb.cc ]] ||
      { echo "run_target.sh: no generated protobuf code in $gen (build first)" >&2; exit 2; }
    sources=("$src/coordinator/http/openai_request.cc" "$gen/exl3serve/v1/generation.pb.cc")
    extra_flags=(-I"$gen")
    pkgs=(protobuf absl_strings absl_str_format)
    dict=$src/tests/fuzz/openai_request.dict
    max_len=8192
    seed chat.json '{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0.7,"top_p":0.9,"top_k":40,"max_tokens":16,"stop":["\n"],"seed":1,"logprobs":true,"top_logprobs":2,"stream":true,"stream_options":{"include_usage":true}}'
    seed tools.json '{"messages":[{"role":"user","content":"weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"w","arguments":"{\"c\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}],"tools":[{"type":"function","function":{"name":"w","parameters":{"type":"object"}}}],"tool_choice":{"type":"function","function":{"name":"w"}},"parallel_tool_calls":false}'
    seed completions.json '{"prompt":["a","b"],"n":2,"echo":true,"logprobs":3,"logit_bias":{"7":-100},"stop_token_ids":[2]}'
    seed ids.json '{"prompt":[[1,2,3],[4,5]],"max_completion_tokens":4,"ignore_eos":true,"return_token_ids":true}'
    seed tokenize.json '{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":true,"return_token_strs":true}'
    seed detokenize.json '{"tokens":[1,2,3]}'
    seed kwargs.json '{"messages":[{"role":"assistant","content":"Once","reasoning_content":"r"}],"continue_final_message":true,"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false},"reasoning_effort":"low"}'
    ;;
  chat_template)
    sources=("${tokenizer_sources[@]}")
    pkgs=(icu-uc absl_status absl_statusor absl_strings absl_str_format absl_flat_hash_map absl_raw_hash_set absl_hash absl_synchronization)
    # The real templates we test with, each with the default conversation.
    n=0
    while IFS= read -r -d '' f; do
      n=$((n + 1))
      python3 - "$f" "$out/seeds/template_$n" <<'PY' || true
import json, sys
c = json.load(open(sys.argv[1]))
t = c.get("chat_template")
if isinstance(t, list): t = t[0]["template"]
if isinstance(t, str): open(sys.argv[2], "w").write(t)
PY
    done < <(find "$shared" "$build/demo-tokenizer" -name tokenizer_config.json -print0 2>/dev/null | sort -z)
    seed loops "{% for m in messages %}{% for k in range(10) %}{{ m.role ~ k }}{% endfor %}{% endfor %}"
    seed macro "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}x{% endmacro %}{{ f(5) }}"
    printf '%s\0%s' "{{ messages[0]['content'] | upper }}{{ tools | tojson }}" '{"messages":[{"role":"user","content":"hé"}],"tools":[1,{"a":null}]}' >"$out/seeds/context"
    ;;
  tokenizer)
    sources=("${tokenizer_sources[@]}")
    pkgs=(icu-uc absl_status absl_statusor absl_strings absl_str_format absl_flat_hash_map absl_raw_hash_set absl_hash absl_synchronization)
    max_len=$((256 << 10))
    timeout=60
    # stories260K's real tokenizer (SentencePiece-style BPE, 512 tokens) as
    # tokenizer.json, when the shared models and a built binary are here.
    stories=$shared/models/stories260K
    if [ -x "$build/cli/exl3serve" ] && [ -f "$stories/tok512.bin" ] && [ ! -f "$out/seeds/stories" ]; then
      tmp=$(mktemp -d)
      if "$build/cli/exl3serve" import-llama2c --in "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" \
          --out "$tmp/m" >/dev/null 2>&1; then
        { cat "$tmp/m/tokenizer.json"; printf '\0'; cat "$tmp/m/tokenizer_config.json"; printf '\0Once upon a time, Lily <s> ü'; } \
          >"$out/seeds/stories"
      fi
      rm -rf "$tmp"
    fi
    seed tiny_bpe "$(printf '%s\0%s\0%s' '{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]},"added_tokens":[{"id":3,"content":"<s>","special":true}]}' '{"bos_token":"<s>"}' 'abab<s>ba')"
    seed bytelevel "$(printf '%s\0\0%s' '{"model":{"type":"BPE","vocab":{"a":0,"Ġ":1},"merges":[]},"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false},"decoder":{"type":"ByteLevel"}}' 'a a')"
    ;;
  model_config)
    sources=("$src/worker/model/model_config.cc" "$src/sharding/model_arch.cc")
    pkgs=(absl_status absl_statusor absl_strings absl_str_format)
    max_len=16384
    n=0
    while IFS= read -r -d '' f; do
      n=$((n + 1))
      cp "$f" "$out/seeds/config_$n.json"
    done < <(find "$shared" -name config.json -size -32k -print0 2>/dev/null | sort -z)
    seed llama.json '{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"rms_norm_eps":1e-5,"rope_theta":10000,"rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":1,"high_freq_factor":4,"original_max_position_embeddings":8192}}'
    seed moe.json '{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":100,"num_experts":4,"num_experts_per_tok":2,"decoder_sparse_step":1}'
    ;;
  *)
    echo "run_target.sh: unknown target $target (openai_request, chat_template, tokenizer, model_config)" >&2
    exit 2
    ;;
esac

binary=$out/${target}_fuzz
all_sources=("$src/tests/fuzz/${target}_fuzz.cc" "${sources[@]}")
needs_build=1
if [[ -x "$binary" ]]; then
  needs_build=0
  for f in "${all_sources[@]}" "$0"; do
    if [[ "$f" -nt "$binary" ]]; then needs_build=1; break; fi
  done
  for f in "$src"/coordinator/tokenizer/*.h "$src"/coordinator/http/*.h "$src"/worker/model/model_config.h \
           "$src"/sharding/model_arch.h; do
    if [[ "$f" -nt "$binary" ]]; then needs_build=1; break; fi
  done
fi
if [[ $needs_build == 1 ]]; then
  echo "run_target.sh: building $binary"
  # shellcheck disable=SC2046  # pkg-config output is a word list
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$src" "${extra_flags[@]}" "${all_sources[@]}" $(pkg-config --cflags --libs "${pkgs[@]}") \
    -o "$binary.tmp"
  mv "$binary.tmp" "$binary"
fi
dict_flag=()
[ -n "$dict" ] && dict_flag=(-dict="$dict")
set +e
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} \
  "$binary" "$out/corpus" "$out/seeds" "${dict_flag[@]}" -max_total_time="$seconds" -max_len="$max_len" \
  -timeout="$timeout" -rss_limit_mb=2560 -artifact_prefix="$out/artifacts/" -print_final_stats=1
rc=$?
set -e
[[ $rc == 0 ]] || echo "run_target.sh: $target fuzzer failed (exit $rc); reproducer in $out/artifacts/" >&2
exit $rc
