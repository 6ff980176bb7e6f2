#!/bin/bash
# tests/fuzz/run_target.sh TARGET [SECONDS] — the libFuzzer targets other than
# the safetensors header (reached as `tests/fuzz/run.sh TARGET SECONDS`),
# built with clang + libFuzzer + ASan + UBSan straight from the sources:
#   openai_request   HTTP API request bodies      (needs a build's generated protobuf code)
#   http1_framing    raw bytes of HTTP/1.1 connections to the request framing (coordinator/http/http1_parser)
#   chat_template    template text + context JSON
#   tokenizer        tokenizer.json + tokenizer_config.json + text
#   model_config     config.json + generation_config.json
#   model_folder     an EXL3 model folder: config.json + model.safetensors
#   rank_protocol    Step messages to a loaded rank (needs a build: protobuf code, the binary for the model)
#   rank_endpoint    RankMessages from a fake rank to the coordinator's RemoteRankGroup over gRPC
#   cluster_config   the cluster YAML (coordinator --config, launch)  (needs a build's generated protobuf code)
#   constraint       structured-output constraints: JSON Schema, regex, GBNF, choice (coordinator/constrained/)
# Output in $EXL3_BUILD_DIR/fuzz-TARGET (default ./build): corpus/ (grows
# across runs), seeds/, artifacts/ (reproducers). Non-zero exit on a finding.
# Reproduce: <dir>/TARGET_fuzz FILE
# The whole script is one brace group, parsed before any of it runs: editing
# this file while a long run is going cannot change what that run executes.
{
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
link_objects=0
max_len=65536
timeout=30
dict=""
case $target in
  openai_request)
    gen=$build/proto/gen
    [[ -f $gen/exl3serve/v1/generation.pb.cc ]] ||
      { echo "run_target.sh: no generated protobuf code in $gen (build first)" >&2; exit 2; }
    sources=("$src/coordinator/http/openai_request.cc" "$src/common/json_depth.cc" "$gen/exl3serve/v1/generation.pb.cc")
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
  http1_framing)
    sources=("$src/coordinator/http/http1_parser.cc")
    pkgs=(absl_strings)
    dict=$src/tests/fuzz/http1_framing.dict
    max_len=16384
    seed get $'\x10\x00\x10\x00\x10\x00\x02\x00\x05\x00\x30GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\nGET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n'
    seed post $'\x40\x00\x08\x00\x00\x01\x01\x00\x20POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n{"prompt":1}'
    seed chunked $'\x40\x00\x08\x00\x00\x01\x02\x00\x30\x00\x31POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nT: 1\r\n\r\nGET / HTTP/1.1\r\nHost: b\r\n\r\n'
    seed smuggle $'\x40\x00\x08\x00\x00\x01\x00GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n'
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
    # (printf straight to the file: a command substitution would drop the NULs)
    printf '%s\0%s\0%s' '{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]},"added_tokens":[{"id":3,"content":"<s>","special":true}]}' '{"bos_token":"<s>"}' 'abab<s>ba' >"$out/seeds/tiny_bpe"
    printf '%s\0\0%s' '{"model":{"type":"BPE","vocab":{"a":0,"Ġ":1},"merges":[]},"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false},"decoder":{"type":"ByteLevel"}}' 'a a' >"$out/seeds/bytelevel"
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
  model_folder)
    sources=("$src"/sharding/{exl3_model,safetensors,safetensors_checkpoint,safetensors_json,safetensors_atomic_file,model_arch,shard_plan,spill_store}.cc "$src/sharding/quant/bit_allocation.cc"
             "$src"/kernels/{reconstruct,hadamard,trellis_lut,trellis_pack}.cc
             "$src/common/status_macros.cc" "$src/common/logging.cc")
    pkgs=(absl_status absl_statusor absl_strings absl_str_format absl_flat_hash_map absl_raw_hash_set absl_hash absl_synchronization)
    dict=$src/tests/fuzz/safetensors.dict
    max_len=$((512 << 10))
    timeout=60
    # The shared single-linear test checkpoints (every codebook, K, legacy
    # signs, an unaligned header) and, when the binary is built, a tiny
    # Llama and Qwen3-MoE converted to EXL3.
    n=0
    while IFS= read -r -d '' f; do
      d=$(dirname "$f")
      [ -f "$d/config.json" ] || continue
      n=$((n + 1))
      { cat "$d/config.json"; printf '\0'; cat "$f"; } >"$out/seeds/vector_$n"
    done < <(find "$shared/testdata/exl3" -name model.safetensors -size -200k -print0 2>/dev/null | sort -z)
    if [ -x "$build/cli/exl3serve" ] && [ ! -f "$out/seeds/llama" ]; then
      tmp=$(mktemp -d)
      for arch in llama qwen3-moe; do
        if "$build/cli/exl3serve" make-test-model --out "$tmp/$arch-hf" --arch "$arch" --layers 1 --hidden 128 \
             --intermediate 256 --vocab 48 --experts 2 >/dev/null 2>&1 &&
           "$build/cli/exl3serve" convert --in "$tmp/$arch-hf" --out "$tmp/$arch" --bits 2 --head-bits 2 \
             --threads 1 --no-progress >/dev/null 2>&1; then
          { cat "$tmp/$arch/config.json"; printf '\0'; cat "$tmp/$arch/model.safetensors"; } >"$out/seeds/$arch"
        fi
      done
      rm -rf "$tmp"
    fi
    ;;
  rank_protocol)
    gen=$build/proto/gen
    [[ -f $gen/exl3serve/rank/v1/rank.pb.cc && -x $build/cli/exl3serve ]] ||
      { echo "run_target.sh: needs a build (generated protobuf code, build/cli/exl3serve)" >&2; exit 2; }
    # Most of a rank: compiled once into objects (cached in $out/obj), the
    # fuzzer linked from them.
    sources=($(ls "$src"/worker/model/*.cc | grep -v /calibration.cc) "$src"/worker/model/modules/*.cc
             "$src"/worker/api/*.cc
             "$src"/worker/rank/{rank_executor,capacities,step_command}.cc
             "$src"/worker/comm/{comm_factory,communicator,gpu_backend_choice,gpu_rank_info,hierarchical_communicator,host_staged_communicator,reduce_sum,reduce_sum_avx2,reduce_sum_avx512,shm_communicator,tcp_bootstrap,timed_communicator,ucx_communicator}.cc
             "$src"/kernels/*.cc "$src"/kernels/cpu/*.cc
             "$src"/sharding/{exl3_model,safetensors,safetensors_checkpoint,safetensors_json,safetensors_atomic_file,model_arch,shard_plan,spill_store}.cc "$src/sharding/quant/bit_allocation.cc"
             "$src/common/status_macros.cc" "$src/common/logging.cc" "$gen/exl3serve/rank/v1/rank.pb.cc"
             "$gen/exl3serve/v1/generation.pb.cc")
    extra_flags=(-I"$gen")
    pkgs=(protobuf ucx libcrypto absl_status absl_statusor absl_strings absl_str_format absl_flat_hash_map
          absl_raw_hash_set absl_hash absl_synchronization absl_time)
    link_objects=1
    max_len=4096
    timeout=60
    # The rank's model: a tiny Llama (odd vocab) converted to 2-bit EXL3.
    model=$out/model
    if [ ! -f "$model/config.json" ]; then
      tmp=$(mktemp -d)
      "$build/cli/exl3serve" make-test-model --out "$tmp/hf" --layers 2 --hidden 128 --intermediate 256 \
        --vocab 61 >/dev/null
      rm -rf "$model"
      "$build/cli/exl3serve" convert --in "$tmp/hf" --out "$model" --bits 2 --head-bits 4 --threads 1 \
        --no-progress >/dev/null
      rm -rf "$tmp"
    fi
    export EXL3_FUZZ_MODEL_DIR=$model
    # A few hand-made step sequences (bytes for the FuzzedDataProvider).
    printf '\x10\x00\x00\xc8\x01\x11\x00\x02\x01\x00\x05\x01\x02\x03\x04\x05\x02\x00\x01\x01' >"$out/seeds/add_forward"
    head -c 2048 /dev/urandom >"$out/seeds/random" 2>/dev/null || true
    ;;
  rank_endpoint)
    gen=$build/proto/gen
    [[ -f $gen/exl3serve/rank/v1/rank.grpc.pb.cc ]] ||
      { echo "run_target.sh: no generated protobuf code in $gen (build first)" >&2; exit 2; }
    sources=("$src/coordinator/rank_group.cc" "$src/coordinator/listen_policy.cc"
             "$src/worker/rank/capacities.cc" "$src"/worker/api/*.cc
             "$src/common/status_macros.cc" "$src/common/logging.cc"
             "$gen/exl3serve/rank/v1/rank.pb.cc" "$gen/exl3serve/rank/v1/rank.grpc.pb.cc"
             "$gen/exl3serve/v1/generation.pb.cc")
    extra_flags=(-I"$gen")
    pkgs=(grpc++ protobuf absl_status absl_statusor absl_strings absl_str_format absl_synchronization absl_time)
    link_objects=1
    max_len=2048
    timeout=30
    # gRPC keeps per-process state the leak checker reports at exit.
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
    printf '\x0c\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00' >"$out/seeds/register_ready"
    ;;
  cluster_config)
    gen=$build/proto/gen
    [[ -f $gen/exl3serve/v1/generation.pb.h ]] ||
      { echo "run_target.sh: no generated protobuf code in $gen (build first)" >&2; exit 2; }
    sources=("$src/cli/cluster_keys.cc" "$src/cli/coordinator_config.cc" "$src/cli/launch_plan.cc"
             "$src/coordinator/listen_policy.cc" "$src/coordinator/speculative_method.cc"
             "$src/worker/rank/capacities.cc"
             "$src/worker/api/step_executor.cc" "$src/common/status_macros.cc" "$src/common/logging.cc")
    extra_flags=(-I"$gen")
    pkgs=(yaml-cpp protobuf absl_status absl_statusor absl_strings absl_str_format absl_time absl_synchronization)
    dict=$src/tests/fuzz/cluster_config.dict
    max_len=16384
    for f in "$src"/deploy/cluster/cluster.yaml "$src"/deploy/cluster/local-2-ranks.yaml; do
      seed_file "$(basename "$f")" "$f"
    done
    seed launch.yaml "$(printf '%s\n' 'model_dir: /m' 'world_size: 3' 'capacities: [1, 1, 0.5]' \
      'listen_address: 10.0.0.1:50061' 'rank_token_file: /t' 'tls: {rank_cert: c, rank_key: k, rank_ca: ca}' \
      'comm: {backend: ucx, ucx: {tls: tcp}, nccl: {net: IB, ib_gid_index: 3}}' \
      'kv: {bits: 8, num_pages: 64}' 'precision: {prefill: bf16, decode: int8}' \
      'engine: {max_running: 8, max_context: 0}' 'timeouts: {join_ms: 10}' \
      'http_address: 127.0.0.1:8000' 'http: {served_model_names: [a, b], threads: 4}' \
      'boxes:' '  - {name: lead, address: 10.0.0.1, coordinator: true, ranks: [0], metrics_port: 9400}' \
      '  - {name: a, address: 10.0.0.2, devices: [0, 1], nics: [eth1], ranks: [1, 2], rank_devices: [0, 1],' \
      '     rank_metrics_ports: [9401, 9402], nccl: {ib_hca: "mlx5_0:1"}}')"
    seed aliases.yaml "$(printf '%s\n' 'a: &a [1, 1]' 'b: &b [*a, *a]' 'model_dir: m' 'world_size: 2' 'capacities: *a')"
    ;;
  constraint)
    sources=("$src"/coordinator/constrained/*.cc "${tokenizer_sources[@]}")
    pkgs=(icu-uc absl_status absl_statusor absl_strings absl_str_format absl_flat_hash_map absl_raw_hash_set absl_hash absl_synchronization)
    max_len=4096
    timeout=30
    printf '\000%s' '{"type":"object","properties":{"a":{"type":"integer","minimum":-5,"maximum":300},"b":{"type":"array","items":{"$ref":"#/$defs/s"},"maxItems":3},"c":{"anyOf":[{"type":"null"},{"type":"number","exclusiveMaximum":10}]}},"required":["a"],"additionalProperties":{"type":"boolean"},"$defs":{"s":{"type":"string","pattern":"^[a-z]{2,4}$"}}}' >"$out/seeds/schema"
    printf '\000%s' '{"type":"string","format":"date-time","minLength":1}' >"$out/seeds/schema_error"
    printf '\001%s' '(?:[a-z]+|\d{1,3})@[^\s"]{2,}\.(com|org)$' >"$out/seeds/regex"
    printf '\002%s' 'root ::= obj
obj ::= "{" ( pair ("," pair)* )? "}"
pair ::= [a-z]+ ":" ( [0-9]{1,3} | obj | "\u00e9" )' >"$out/seeds/grammar"
    printf '\003yes\000no\000maybe' >"$out/seeds/choice"
    ;;
  *)
    echo "run_target.sh: unknown target $target (openai_request, http1_framing, chat_template, tokenizer, model_config, model_folder, rank_protocol, rank_endpoint, cluster_config, constraint)" >&2
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
  for f in "$src"/coordinator/tokenizer/*.h "$src"/coordinator/constrained/*.h "$src"/coordinator/http/*.h "$src"/worker/model/model_config.h \
           "$src"/sharding/*.h "$src"/kernels/*.h "$src"/cli/*.h; do
    if [[ "$f" -nt "$binary" ]]; then needs_build=1; break; fi
  done
fi
san=(-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
# The ISA flags CMakeLists.txt (exl3_isa_flags) gives a source by its suffix.
isa_flags() {
  local avx2="-mavx2 -mfma -mf16c -mbmi2" avx512="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni"
  case $1 in
    *_avx2.cc) echo "$avx2" ;;
    *_avx512icl.cc) echo "$avx512 $avx2 -mavx512vbmi -mavx512vbmi2" ;;
    *_avx512fp16.cc) echo "$avx512 $avx2 -mavx512fp16 -ffp-contract=off" ;;
    *_avx512bf16.cc) echo "$avx512 $avx2 -mavx512bf16 -mamx-tile -mamx-bf16" ;;
    *_avx512.cc) echo "$avx512 $avx2" ;;
  esac
}
if [[ $link_objects == 1 ]]; then
  # One object per source, rebuilt when the source (or any header of the
  # project) is newer; two at a time.
  mkdir -p "$out/obj"
  newest_header=$(find "$src" -name '*.h' -newer "$out/obj/.stamp" -print -quit 2>/dev/null || echo all)
  [[ -f $out/obj/.stamp ]] || newest_header=all
  objects=()
  jobs=()
  for f in "${all_sources[@]}"; do
    o=$out/obj/$(echo "${f#"$src"/}" | tr '/' '_').o
    objects+=("$o")
    if [[ ! -f $o || $f -nt $o || -n $newest_header ]]; then jobs+=("$f"); fi
  done
  if [[ ${#jobs[@]} -gt 0 ]]; then
    echo "run_target.sh: compiling ${#jobs[@]} sources for $target"
    cflags=$(pkg-config --cflags "${pkgs[@]}")
    export src out cxx cflags
    export -f isa_flags
    printf '%s\0' "${jobs[@]}" | xargs -0 -P "${EXL3_FUZZ_JOBS:-2}" -I{} bash -c '
      f={}; o=$out/obj/$(echo "${f#"$src"/}" | tr "/" "_").o
      # shellcheck disable=SC2046
      '"$cxx"' -std=c++20 -g -O1 -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined \
        -I"$src" '"${extra_flags[*]}"' $cflags $(isa_flags "$f") -c "$f" -o "$o.tmp" && mv "$o.tmp" "$o"' ||
      { echo "run_target.sh: compiling failed" >&2; exit 2; }
    touch "$out/obj/.stamp"
    needs_build=1
  fi
fi
if [[ $needs_build == 1 ]]; then
  echo "run_target.sh: building $binary"
  if [[ $link_objects == 1 ]]; then
    # shellcheck disable=SC2046  # pkg-config output is a word list
    "$cxx" "${san[@]}" "${objects[@]}" $(pkg-config --libs "${pkgs[@]}") -lpthread -lrt -o "$binary.tmp"
  else
    # shellcheck disable=SC2046  # pkg-config output is a word list
    "$cxx" -std=c++20 -g -O1 "${san[@]}" \
      -I"$src" "${extra_flags[@]}" "${all_sources[@]}" $(pkg-config --cflags --libs "${pkgs[@]}") \
      -o "$binary.tmp"
  fi
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
}
