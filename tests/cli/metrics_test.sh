#!/usr/bin/env bash
# Prometheus metrics end to end: `exl3serve serve --tp 2 --metrics-port P` on a
# small test model, a few requests through `exl3serve client`, then
#   * /metrics of the coordinator (P) and of each rank (P+1, P+2; serve prints
#     them) passes `promtool check metrics`;
#   * the counters and histograms moved (generation tokens, finished requests
#     by reason, TTFT/ITL, per-rank forward time, collective latency; the
#     server drafts with n-grams, so exl3serve:spec_decode_* count drafts and
#     accepted tokens for a prompt that repeats itself);
#   * the ranks spill the token embedding (--spill-embeddings): the spill-store
#     series (lookups, cache hits, reads, bytes, read latency) moved, and the
#     answer's tokens equal `generate --tp 2` without spilling;
#   * a second cluster on a MoE test model (--tp 2 --ep 2) exports
#     exl3serve:expert_tokens_total for each rank's own experts;
#   * every metric deploy/grafana/exl3serve.json queries is exported;
#   * the real Prometheus server (Debian `prometheus`) scrapes all three
#     endpoints (bounded polling of its HTTP API until the targets are up)
#     and answers queries for the TTFT histogram and per-rank series.
# Readiness is a handshake (the printed lines, `client --health
# --wait-ready-ms`, Prometheus's /api/v1/targets), never a fixed sleep. A trap
# stops every process on every exit path. Exit 77 (skip) without promtool,
# prometheus or curl.
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
DASHBOARD="$SRC/deploy/grafana/exl3serve.json"
WORK=$(mktemp -d)
SERVER_PID="" PROM_PID=""
PY=/usr/bin/python3

for tool in promtool prometheus curl; do
  command -v $tool >/dev/null || { echo "SKIP: no $tool (apt-get install --no-install-recommends prometheus curl)"; exit 77; }
done

stop_pid() {  # SIGTERM, up to 20 s, then SIGKILL
  local pid=$1
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && { echo "pid $pid did not stop in 20 s; SIGKILL"; kill -KILL "$pid"; }
  wait "$pid" 2>/dev/null
}
cleanup() { stop_pid "$PROM_PID"; stop_pid "$SERVER_PID"; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -30 "$f"; }; done
  exit 1
}

# A base port P with P..P+2 free on loopback (the kernel picks P), and one for Prometheus.
free_ports() {
  $PY - "$1" <<'PY'
import socket, sys
n = int(sys.argv[1])
for _ in range(200):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    if p + n > 65535: continue
    ok = True
    for q in range(p, p + n):
        t = socket.socket()
        try: t.bind(("127.0.0.1", q))
        except OSError: ok = False
        finally: t.close()
    if ok: print(p); break
PY
}

"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"

MPORT=$(free_ports 3); [ -n "$MPORT" ] || fail "no 3 consecutive free ports"
"$BIN" --log-level warning serve --model "$WORK/model" --tp 2 --port 0 --kv-pages 128 \
    --metrics-port "$MPORT" --shutdown-grace-ms 2000 --spill-embeddings --spill-cache-bytes 65536 \
    --kv-disk-path "$WORK/kv-{rank}.bin" --kv-disk-blocks 32 \
    --speculative ngram --no-draft-governor >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
ADDR=""
for _ in $(seq 600); do
  ADDR=$(sed -n 's/^listening on //p' "$WORK/serve.log")
  [ -n "$ADDR" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || fail "serve exited before listening"
  sleep 0.1
done
[ -n "$ADDR" ] || fail "no 'listening on' line in 60 s"
"$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null || fail "not ready in 120 s"

COORD_URL=$(sed -n 's/^metrics: coordinator //p' "$WORK/serve.log")
RANK0_URL=$(sed -n 's/^metrics: rank 0 //p' "$WORK/serve.log")
RANK1_URL=$(sed -n 's/^metrics: rank 1 //p' "$WORK/serve.log")
[ "$COORD_URL" = "http://127.0.0.1:$MPORT/metrics" ] || fail "coordinator metrics line: '$COORD_URL'"
[ "$RANK0_URL" = "http://127.0.0.1:$((MPORT + 1))/metrics" ] || fail "rank 0 metrics line: '$RANK0_URL'"
[ "$RANK1_URL" = "http://127.0.0.1:$((MPORT + 2))/metrics" ] || fail "rank 1 metrics line: '$RANK1_URL'"

# A second serve on the same metrics port fails with a clear error, not a crash.
if "$BIN" serve --model "$WORK/model" --port 0 --metrics-port "$MPORT" >"$WORK/busy.log" 2>&1; then
  fail "a second serve on metrics port $MPORT started"
fi
grep -q "cannot serve /metrics on 127.0.0.1:$MPORT" "$WORK/busy.log" || fail "busy port message: $(cat "$WORK/busy.log")"

N=4
for i in $(seq $N); do
  "$BIN" client --addr "$ADDR" --prompt-ids 1,42,7,$((300 + i)) --max-tokens 8 --ignore-eos --ids \
      >/dev/null 2>"$WORK/client.err" || { cat "$WORK/client.err"; fail "request $i"; }
done

# The prefix cache: a 40-token prompt twice (the second finds 2 blocks of 16).
for i in 1 2; do
  "$BIN" client --addr "$ADDR" --prompt-ids "$(seq -s, 100 139)" --max-tokens 4 --ignore-eos --ids \
      >/dev/null 2>"$WORK/client.err" || { cat "$WORK/client.err"; fail "prefix request $i"; }
done

# Speculative decoding: the test model's greedy output cycles (period 20
# after this prompt), so n-gram drafts from its own output are accepted.
"$BIN" client --addr "$ADDR" --prompt-ids 1,42,7,301,1,42,7,301 --max-tokens 64 --ignore-eos --ids \
    >/dev/null 2>"$WORK/client.err" || { cat "$WORK/client.err"; fail "repetitive request"; }

scrape() { curl -sf --max-time 10 "$1" >"$2" || fail "scrape $1"; }
scrape "$COORD_URL" "$WORK/coordinator.prom"
scrape "$RANK0_URL" "$WORK/rank0.prom"
scrape "$RANK1_URL" "$WORK/rank1.prom"
# promtool parses the exposition (rc 1 on a format error) and lints it (rc 3
# with findings). The one finding we accept is the `exl3serve:` prefix's
# colon, which we keep on purpose to mirror vLLM's `vllm:` names
# (shared/docs/style.md, Metrics): any other finding fails.
for f in coordinator rank0 rank1; do
  promtool check metrics <"$WORK/$f.prom" >"$WORK/promtool-$f.log" 2>&1; rc=$?
  if [ $rc = 3 ]; then
    grep -v "^exl3serve:[a-zA-Z0-9_:]* metric names should not contain ':'$" "$WORK/promtool-$f.log" \
        >"$WORK/promtool-$f.other" && { cat "$WORK/promtool-$f.other"; fail "promtool lint: $f"; }
  elif [ $rc != 0 ]; then
    cat "$WORK/promtool-$f.log"; fail "promtool check metrics: $f (rc $rc)"
  fi
done
echo "promtool: coordinator and both ranks parse; lint findings only the exl3serve: colon"

# value FILE 'SERIES-REGEX': the sum of the samples whose line starts with the regex.
value() { awk -v re="^$2" '$0 ~ re { s += $NF } END { printf "%.6f\n", s + 0 }' "$1"; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 >= b + 0) }'; }
C="$WORK/coordinator.prom"
ge "$(value "$C" 'exl3serve:generation_tokens_total\{')" $((N * 8)) || fail "generation_tokens_total < $((N * 8))"
ge "$(value "$C" 'exl3serve:prompt_tokens_total\{')" $((N * 4)) || fail "prompt_tokens_total < $((N * 4))"
ge "$(value "$C" 'exl3serve:request_success_total\{[^}]*finished_reason="length"')" $N ||
  fail "request_success_total{finished_reason=length} < $N"
ge "$(value "$C" 'exl3serve:time_to_first_token_seconds_count\{')" $N || fail "TTFT count < $N"
# One inter-token latency per step and request: an accepted run is one gap.
ACCEPTED=$(value "$C" 'exl3serve:spec_decode_num_accepted_tokens_total\{')
ge "$(awk -v a="$(value "$C" 'exl3serve:inter_token_latency_seconds_count\{')" -v b="$ACCEPTED" 'BEGIN { print a + b }')" \
  $((N * 7)) || fail "ITL count + accepted drafts < $((N * 7))"
ge "$(value "$C" 'exl3serve:spec_decode_num_drafts_total\{')" 1 || fail "spec_decode_num_drafts_total < 1"
ge "$ACCEPTED" 1 || fail "spec_decode_num_accepted_tokens_total < 1"
ge "$(value "$C" 'exl3serve:spec_decode_num_draft_tokens_total\{')" "$ACCEPTED" || fail "draft tokens < accepted"
echo "speculative decoding: $(value "$C" 'exl3serve:spec_decode_num_drafts_total\{') drafts, $ACCEPTED tokens accepted"
ge "$(value "$C" 'exl3serve:e2e_request_latency_seconds_bucket\{[^}]*le="\+Inf"')" $N || fail "e2e +Inf bucket < $N"
ge "$(value "$C" 'exl3serve:engine_steps_total\{')" 8 || fail "engine_steps_total < 8"
ge "$(value "$C" 'exl3serve:prefix_cache_queries_total\{')" $((N * 4 + 80)) || fail "prefix_cache_queries_total < $((N * 4 + 80))"
ge "$(value "$C" 'exl3serve:prefix_cache_hits_total\{')" 32 || fail "prefix_cache_hits_total < 32"
for r in 0 1; do  # the ranks' disk tier exports its counters (nothing evicted yet: zero)
  grep -q "^exl3serve:kv_disk_written_bytes_total{.*rank=\"$r\"" "$WORK/rank$r.prom" || fail "rank $r: no kv_disk_written_bytes_total"
done
grep -q '^exl3serve:cache_config_info{.*block_size="16".*num_gpu_blocks="128"' "$C" || fail "cache_config_info"
grep -q '^exl3serve:inter_token_latency_seconds_bucket{.*le="0.001"' "$C" || fail "no sub-10 ms ITL bucket"
ge "$(value "$C" 'exl3serve:rank_up\{')" 2 || fail "rank_up: not 2 ranks up"
for r in 0 1; do
  R="$WORK/rank$r.prom"
  ge "$(value "$R" "exl3serve:rank_forward_seconds_count\\{[^}]*phase=\"decode\"[^}]*rank=\"$r\"")" 1 ||
    fail "rank $r: no decode forward counted"
  ge "$(value "$R" "exl3serve:collective_latency_seconds_count\\{[^}]*backend=\"shm\"")" 1 ||
    fail "rank $r: no shm collective timed"
done
# The spilled embedding: every prompt and generated token was looked up on each
# rank (N requests of 4 + 8 tokens; the last generated token is not fed back).
for r in 0 1; do
  R="$WORK/rank$r.prom"
  T='tensor="model.embed_tokens.weight"'
  ge "$(value "$R" "exl3serve:spill_lookups_total\\{[^}]*$T")" $((N * 11)) || fail "rank $r: spill_lookups_total < $((N * 11))"
  grep -q "^exl3serve:spill_cache_hits_total{.*$T" "$R" || fail "rank $r: no spill_cache_hits_total"
  ge "$(value "$R" "exl3serve:spill_reads_total\\{[^}]*$T")" 1 || fail "rank $r: no spill reads"
  ge "$(value "$R" "exl3serve:spill_read_bytes_total\\{[^}]*$T")" 1 || fail "rank $r: no spill bytes"
  ge "$(value "$R" "exl3serve:spill_read_latency_seconds_count\\{[^}]*$T")" 1 || fail "rank $r: no spill read latency"
done
# Spilling is transparent: the same greedy tokens as two ranks holding the embedding.
"$BIN" client --addr "$ADDR" --prompt-ids 1,42,7,9 --max-tokens 8 --ignore-eos --ids \
    >"$WORK/spill-answer.txt" 2>"$WORK/client.err" || { cat "$WORK/client.err"; fail "spill request"; }
"$BIN" --log-level warning generate --model "$WORK/model" --tp 2 --prompt-ids 1,42,7,9 --max-tokens 8 \
    --ignore-eos --ids >"$WORK/resident-answer.txt" 2>"$WORK/generate.log" || fail "generate --tp 2"
[ "$(tr -s ' \n' ' ' <"$WORK/spill-answer.txt" | xargs)" = "$(tr -s ' \n' ' ' <"$WORK/resident-answer.txt" | xargs)" ] ||
  fail "spilled serve answered '$(cat "$WORK/spill-answer.txt")', resident generate '$(cat "$WORK/resident-answer.txt")'"
echo "spill: both ranks export spill-store series; answer equals the resident run: $(xargs <"$WORK/spill-answer.txt")"

# Expert load on a MoE cluster (pure expert parallelism: each rank holds half the experts).
"$BIN" make-test-model --arch qwen3-moe --out "$WORK/moe" >/dev/null || fail "make-test-model moe"
MOE_PORT=$(free_ports 3); [ -n "$MOE_PORT" ] || fail "no 3 consecutive free ports (moe)"
"$BIN" --log-level warning serve --model "$WORK/moe" --tp 2 --ep 2 --port 0 --kv-pages 64 \
    --metrics-port "$MOE_PORT" --shutdown-grace-ms 2000 >"$WORK/moe-serve.log" 2>&1 &
MOE_PID=$!
MOE_ADDR=""
for _ in $(seq 600); do
  MOE_ADDR=$(sed -n 's/^listening on //p' "$WORK/moe-serve.log")
  [ -n "$MOE_ADDR" ] && break
  kill -0 "$MOE_PID" 2>/dev/null || fail "moe serve exited before listening"
  sleep 0.1
done
[ -n "$MOE_ADDR" ] || { stop_pid "$MOE_PID"; fail "moe: no 'listening on' line in 60 s"; }
"$BIN" client --addr "$MOE_ADDR" --health --wait-ready-ms 120000 >/dev/null || { stop_pid "$MOE_PID"; fail "moe not ready"; }
"$BIN" client --addr "$MOE_ADDR" --prompt-ids 3,1,4,1,5 --max-tokens 6 --ignore-eos --ids >/dev/null 2>&1 ||
  { stop_pid "$MOE_PID"; fail "moe request"; }
for r in 0 1; do
  curl -sf --max-time 10 "http://127.0.0.1:$((MOE_PORT + 1 + r))/metrics" >"$WORK/moe-rank$r.prom" ||
    { stop_pid "$MOE_PID"; fail "scrape moe rank $r"; }
done
stop_pid "$MOE_PID"
for r in 0 1; do
  R="$WORK/moe-rank$r.prom"
  promtool check metrics <"$R" >"$WORK/promtool-moe$r.log" 2>&1; rc=$?
  if [ $rc = 3 ]; then
    grep -v "^exl3serve:[a-zA-Z0-9_:]* metric names should not contain ':'$" "$WORK/promtool-moe$r.log" \
        >"$WORK/promtool-moe$r.other" && { cat "$WORK/promtool-moe$r.other"; fail "promtool lint: moe rank $r"; }
  elif [ $rc != 0 ]; then
    cat "$WORK/promtool-moe$r.log"; fail "promtool check metrics: moe rank $r (rc $rc)"
  fi
  series=$(grep -c "^exl3serve:expert_tokens_total{.*rank=\"$r\"" "$R")
  [ "$series" -ge 1 ] || fail "moe rank $r: no expert_tokens_total series"
  ge "$(value "$R" "exl3serve:expert_tokens_total\\{[^}]*rank=\"$r\"")" 1 || fail "moe rank $r: no tokens routed to its experts"
done
# Pure EP over 2 ranks: disjoint experts.
e0=$(grep -o '^exl3serve:expert_tokens_total{[^}]*' "$WORK/moe-rank0.prom" | grep -o 'expert="[0-9]*"' | sort)
e1=$(grep -o '^exl3serve:expert_tokens_total{[^}]*' "$WORK/moe-rank1.prom" | grep -o 'expert="[0-9]*"' | sort)
[ -z "$(comm -12 <(echo "$e0") <(echo "$e1"))" ] || fail "moe: ranks report the same experts: $e0 / $e1"
echo "expert load: rank 0 $(echo $e0), rank 1 $(echo $e1)"

# GetServerInfo carries the step totals bench-serve reads (fields 13-15).
INFO=$("$BIN" client --addr "$ADDR" --info) || fail "client --info"
echo "$INFO" | grep -Eq '"num_steps": *"?[1-9]' || fail "--info lacks num_steps: $INFO"
echo "$INFO" | grep -q '"coordinator_seconds_total"' || fail "--info lacks coordinator_seconds_total: $INFO"

# Every metric the dashboard queries is exported (a sample line starts with its name).
[ -f "$DASHBOARD" ] || fail "no $DASHBOARD"
NAMES=$(grep -o 'exl3serve:[a-zA-Z0-9_:]*' "$DASHBOARD" | sort -u)
[ -n "$NAMES" ] || fail "the dashboard references no exl3serve metric"
cat "$WORK"/*.prom >"$WORK/all.txt"
for name in $NAMES; do
  grep -Eq "^${name}(\{| )" "$WORK/all.txt" || fail "dashboard metric $name is not exported"
done
echo "dashboard: $(echo "$NAMES" | wc -l) metric names, all exported"

# The real Prometheus server scrapes the three endpoints.
PPORT=$(free_ports 1); [ -n "$PPORT" ] || fail "no free port for prometheus"
cat >"$WORK/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: exl3serve
    static_configs:
      - targets: ["127.0.0.1:$MPORT", "127.0.0.1:$((MPORT + 1))", "127.0.0.1:$((MPORT + 2))"]
YAML
promtool check config "$WORK/prometheus.yml" >"$WORK/promtool-config.log" 2>&1 || fail "promtool check config"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
    --web.listen-address="127.0.0.1:$PPORT" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
API="http://127.0.0.1:$PPORT/api/v1"
# Poll the targets (the first scrape comes 5-11 s after start), 60 s at most.
UP=0
for _ in $(seq 120); do
  kill -0 "$PROM_PID" 2>/dev/null || fail "prometheus exited"
  UP=$(curl -sf --max-time 2 "$API/targets" | $PY -c '
import json, sys
t = json.load(sys.stdin)["data"]["activeTargets"]
print(sum(1 for x in t if x["health"] == "up"))' 2>/dev/null || echo 0)
  [ "$UP" = 3 ] && break
  sleep 0.5
done
[ "$UP" = 3 ] || fail "prometheus: $UP of 3 targets up after 60 s"
# Requests keep flowing while Prometheus watches.
"$BIN" client --addr "$ADDR" --prompt-ids 1,2,3 --max-tokens 8 --ignore-eos --ids >/dev/null 2>&1 ||
  fail "request while scraped"
# query EXPR MIN_SERIES: polls until the query returns at least MIN_SERIES series (30 s).
query() {
  local n=0
  for _ in $(seq 60); do
    n=$(curl -sf --max-time 2 --get --data-urlencode "query=$1" "$API/query" | $PY -c '
import json, sys
r = json.load(sys.stdin)["data"]["result"]
print(sum(1 for s in r if float(s["value"][1]) > 0))' 2>/dev/null || echo 0)
    [ "$n" -ge "$2" ] && { echo "prometheus: $1 -> $n series"; return 0; }
    sleep 0.5
  done
  fail "prometheus: '$1' gave $n series > 0, want >= $2"
}
query 'exl3serve:time_to_first_token_seconds_count' 1
query 'sum by (le) (exl3serve:time_to_first_token_seconds_bucket)' 10
query 'sum by (rank) (exl3serve:rank_forward_seconds_count)' 2
query 'sum by (rank) (exl3serve:collective_latency_seconds_count)' 2
query 'sum by (rank) (exl3serve:spill_lookups_total)' 2
stop_pid "$PROM_PID"; PROM_PID=""

stop_pid "$SERVER_PID"; rc=$?; SERVER_PID=""
[ $rc = 0 ] || fail "serve exited with $rc on SIGTERM"
echo "PASS"
