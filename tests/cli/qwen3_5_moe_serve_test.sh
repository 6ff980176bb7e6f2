#!/usr/bin/env bash
# A Gated DeltaNet hybrid served end to end (issue 36): the Qwen3.5-MoE demo
# model (`make-demo-model --arch qwen3.5-moe`: three linear-attention layers
# and one gated attention layer, 8 experts and a gated shared expert, text keys
# under text_config, tensors under model.language_model, a vision tensor that
# is skipped; the Qwen3 tokenizer when built into $EXL3_BUILD_DIR/demo-tokenizer),
# unquantized:
#   * `serve --tp 1`: 16 greedy streams, each alone (the references), then all
#     16 at once: the same ids (each sequence's recurrent state is its own);
#   * `serve --tp 2 --http-port 0` (one key head and its 3 value heads per
#     rank, the experts 4/4): the same ids alone and batched through gRPC, and
#     /v1/completions answers with the TP 1 ids (and text with the tokenizer);
#     kill -9 of a rank mid-generation: every stream replayed to its
#     uninterrupted ids;
#   * the prefix cache with state snapshots, at TP 1 and TP 2: a 40-token
#     prompt twice — the second resumes from the snapshot after block 2
#     (cached 32 tokens) and answers the same ids as the first and as a
#     server without the prefix cache; GetServerInfo reports prefix caching on,
#     the snapshot taken and the hit, and the state bytes per sequence that
#     config.json implies;
#   * n-gram drafting at TP 2 on the random-logits test model: drafted ==
#     undrafted, alone and batched, with rejected drafts rolled back.
# Needs /usr/bin/python3 with grpcio and the stubs in $EXL3_BUILD_DIR/python
# (else exit 77 = skip).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$SRC/tests/cli/lib/serve.sh"
serve_test_setup  # BUILD, WORK, the cleanup trap, fail, the Python skip, py

STREAMS=16
TOKENS=24
EXTRA=(--kv-pages 400 --shutdown-grace-ms 2000)
TOK=$BUILD/demo-tokenizer
tok=(--no-tokenizer)
[ -f "$TOK/tokenizer.json" ] && [ -f "$TOK/tokenizer_config.json" ] && tok=(--tokenizer-dir "$TOK")
"$BIN" make-demo-model --arch qwen3.5-moe "${tok[@]}" --out "$WORK/hybrid" >/dev/null ||
  fail "make-demo-model --arch qwen3.5-moe"

# The same 40-token prompt twice (greedy ids): the first is computed (its
# prefill cut at position 32 for the snapshot), the second resumes at 32.
LONG=$(seq -s, 100 139)
prefix_pair() {  # $1 = label; sets PAIR_IDS, checks cached 0 then 32
  local a1 a2
  a1=$("$BIN" client --addr "$ADDR" --prompt-ids $LONG --max-tokens 12 --ignore-eos --ids 2>"$WORK/$1.c1.err") &&
    a2=$("$BIN" client --addr "$ADDR" --prompt-ids $LONG --max-tokens 12 --ignore-eos --ids 2>"$WORK/$1.c2.err") ||
    { cat "$WORK/$1".c?.err; fail "$1: prefix-cache requests"; }
  [ "$a1" = "$a2" ] || fail "$1: the answer resumed from the snapshot [$a2] != computed [$a1]"
  grep -q "cached 0 tokens" "$WORK/$1.c1.err" && grep -q "cached 32 tokens" "$WORK/$1.c2.err" ||
    { cat "$WORK/$1".c?.err; fail "$1: cached_tokens of the repeated prompt"; }
  PAIR_IDS=$a1
}

serve_start "$WORK/hybrid" --tp 1 --no-prefix-cache "${EXTRA[@]}"
NOCACHE=$("$BIN" client --addr "$ADDR" --prompt-ids $LONG --max-tokens 12 --ignore-eos --ids 2>"$WORK/nc.err") ||
  { cat "$WORK/nc.err"; fail "no-prefix-cache request"; }
grep -q "cached 0 tokens" "$WORK/nc.err" || fail "no-prefix-cache: cached tokens reported"
serve_stop || fail "serve --tp 1 --no-prefix-cache exited non-zero"

serve_start "$WORK/hybrid" --tp 1 "${EXTRA[@]}"
py refs --out "$WORK/tp1.json" --streams $STREAMS --max-tokens $TOKENS || fail "tp1 refs"
py streams --refs "$WORK/tp1.json" --kill-pid 0 --expect same || fail "tp1: batched != alone"
prefix_pair tp1
[ "$PAIR_IDS" = "$NOCACHE" ] || fail "tp1: prefix cache on [$PAIR_IDS] != off [$NOCACHE]"
echo "tp1: prefix cache on == off, the repeat resumed from a state snapshot (cached 32 tokens)"
"$BIN" client --addr "$ADDR" --info >"$WORK/info.json" 2>"$WORK/info.err" || fail "server info"
/usr/bin/python3 - "$WORK/info.json" "$WORK/hybrid/config.json" <<'PY' || fail "server info: $(cat "$WORK/info.json")"
import json, sys
info = json.load(open(sys.argv[1]))
server = info.get("server", info)
assert server.get("prefix_cache_enabled") is True, server
saves, hits = int(server.get("state_snapshot_saves", 0)), int(server.get("state_snapshot_hits", 0))
held, most = int(server.get("state_snapshots", 0)), int(server.get("state_snapshots_max", 0))
assert saves >= 1 and hits >= 1 and 1 <= held <= most, server
print(f"GetServerInfo: prefix caching on; state snapshots {held} held of {most}, {saves} taken, {hits} resumed")
# The recurrent state per sequence, computed here from config.json: per
# linear-attention layer (K-1) conv inputs of 2*Hk*dk + Hv*dv channels and,
# per value head, a dk x dv matrix and the open chunk's 15 rows of k (dk),
# u (dv) and a gate (chunks of 16), fp32.
t = json.load(open(sys.argv[2]))["text_config"]
conv = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"] + t["linear_num_value_heads"] * t["linear_value_head_dim"]
dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
per_layer = 4 * ((t["linear_conv_kernel_dim"] - 1) * conv +
                 t["linear_num_value_heads"] * (dk * dv + 15 * (dk + dv + 1)))
want = per_layer * t["layer_types"].count("linear_attention")
server = info.get("server", info)
got = int(server.get("recurrent_state_bytes_per_sequence", 0))
assert got == want, (got, want)
print(f"GetServerInfo: recurrent state {got} bytes per sequence (= config.json's {want})")
PY
serve_stop || fail "serve --tp 1 exited non-zero"

serve_start "$WORK/hybrid" --tp 2 --http-port 0 "${EXTRA[@]}"
py refs --out "$WORK/tp2.json" --streams $STREAMS --max-tokens $TOKENS || fail "tp2 refs"
py same "$WORK/tp1.json" "$WORK/tp2.json" || fail "tp2 alone != tp1"
prefix_pair tp2
[ "$PAIR_IDS" = "$NOCACHE" ] || fail "tp2: prefix cache on [$PAIR_IDS] != tp1 off [$NOCACHE]"
echo "tp2: the repeat resumed from each rank's state snapshot, the tp 1 ids"
py streams --refs "$WORK/tp1.json" --kill-pid 0 --expect same || fail "tp2 batched != tp1"
HTTP=$(sed -n 's/^http: listening on //p' "$LOG")
[ -n "$HTTP" ] || fail "no 'http: listening on' line"
# /v1/completions with the first reference stream's prompt ids: its ids.
/usr/bin/python3 - "$WORK/tp1.json" "http://$HTTP" <<'PY' || fail "OpenAI completions != gRPC"
import json, sys, urllib.request
ref = json.load(open(sys.argv[1]))["refs"][0]
body = {"model": "hybrid", "prompt": ref["prompt"], "max_tokens": len(ref["ids"]), "temperature": 0,
        "return_token_ids": True, "ignore_eos": True}
req = urllib.request.Request(sys.argv[2] + "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=120))
ids = out["choices"][0]["token_ids"]
assert ids == ref["ids"], (ids, ref["ids"])
print(f"OpenAI /v1/completions at tp 2: the tp 1 ids ({len(ids)} tokens): {out['choices'][0]['text']!r}")
PY
# kill -9 a rank mid-generation: the group re-forms and every stream is
# replayed (prefilled again: each sequence's recurrent state is recomputed
# from its tokens) to exactly its uninterrupted tokens.
RANKS=$(pgrep -P "$SERVER_PID" -f worker | tr '\n' ' ')
[ "$(echo $RANKS | wc -w)" = 2 ] || fail "want 2 worker children of serve, found [$RANKS]"
VICTIM=$(echo $RANKS | awk '{print $2}')
py streams --refs "$WORK/tp1.json" --kill-pid "$VICTIM" --expect same || fail "replay after kill -9 != uninterrupted"
py info --ready 1 --min-replays 1 || fail "GetServerInfo after the replay"
serve_stop || fail "serve --tp 2 exited non-zero"

# Exact drafting: the random-logits test model with prompts that repeat a
# span (n-gram drafts are proposed; its random output rejects them):
# drafted == undrafted at TP 2, alone and batched — every rejection rolls
# each rank's recurrent state back to the last accepted token
# (PagedKvCache::RollbackWithState; partly accepted drafts are covered by
# tests/worker/speculative_verify_test.cc).
SERVE_PY_FLAGS=(--repetitive)
"$BIN" make-test-model --arch qwen3.5-moe --seed 3 --out "$WORK/test" >/dev/null ||
  fail "make-test-model --arch qwen3.5-moe"
serve_start "$WORK/test" --tp 2 "${EXTRA[@]}"
py refs --out "$WORK/undrafted.json" --streams $STREAMS --max-tokens $TOKENS || fail "undrafted refs"
serve_stop || fail "serve test --tp 2 exited non-zero"
serve_start "$WORK/test" --tp 2 --speculative ngram --draft-tokens 6 --no-draft-governor "${EXTRA[@]}"
py refs --out "$WORK/drafted.json" --streams $STREAMS --max-tokens $TOKENS || fail "drafted refs"
py same "$WORK/undrafted.json" "$WORK/drafted.json" || fail "drafted alone != undrafted"
py streams --refs "$WORK/undrafted.json" --kill-pid 0 --expect same || fail "drafted batch != undrafted"
py info --ready 1 --min-drafts 1 >"$WORK/spec.txt" || fail "drafting did not happen"
cat "$WORK/spec.txt"
/usr/bin/python3 - "$WORK/spec.txt" <<'PY' || fail "no draft was rejected (no rollback exercised)"
import re, sys
m = re.search(r"(\d+) draft tokens, (\d+) accepted", open(sys.argv[1]).read())
assert m and int(m.group(2)) < int(m.group(1)), m and m.groups()
print(f"{int(m.group(1)) - int(m.group(2))} draft tokens rejected and rolled back")
PY
serve_stop || fail "serve --speculative exited non-zero"
echo "qwen3_5_moe_serve: OK"
