#!/usr/bin/env bash
# Surviving a dead rank under `exl3serve serve --tp 2` (local ranks: the
# engine's LocalGroup starts new rank processes itself on Recover): 32
# concurrent greedy streams from the Python client (tests/cli/replay_client.py)
# on a small test model with peaked logits; once every stream has its first
# chunk, kill -9 one rank process (a `worker` child of serve). Every stream
# completes with exactly the tokens it gets alone (references computed first,
# one at a time, through the same server), GetServerInfo.num_replays > 0, and
# the server is ready again.
#
# Readiness is a handshake ("listening on HOST:PORT", then the health RPC
# until SERVING), not a sleep. A trap stops the server on any exit. Needs
# /usr/bin/python3 with grpcio and the stubs in $EXL3_BUILD_DIR/python (else
# exit 77 = skip).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
WORK=$(mktemp -d)
PY_PID=""
source "$SRC/tests/cli/lib/serve.sh"
cleanup() {
  [ -n "$PY_PID" ] && kill -KILL "$PY_PID" 2>/dev/null
  serve_stop >/dev/null 2>&1
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -30 "$f"; }; done
  exit 1
}

require_python_grpc
py() { /usr/bin/python3 "$SRC/tests/cli/replay_client.py" --addr "$ADDR" --stubs "$BUILD/python" "$@"; }

"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"
serve_start "$WORK/model" --tp 2 --kv-pages 400 --shutdown-grace-ms 2000

RANKS=$(pgrep -P "$SERVER_PID" -f worker | tr '\n' ' ')
[ "$(echo $RANKS | wc -w)" = 2 ] || fail "want 2 worker children of serve (pid $SERVER_PID), found [$RANKS]"
VICTIM=$(echo $RANKS | awk '{print $2}')

py refs --out "$WORK/refs.json" --streams 32 --max-tokens 120 || fail "references"
py streams --refs "$WORK/refs.json" --kill-pid "$VICTIM" --expect same >"$WORK/client.out" 2>&1 &
PY_PID=$!
wait "$PY_PID"; rc=$?; PY_PID=""
cat "$WORK/client.out"
[ $rc = 0 ] || fail "the streams (exit $rc)"
py info --ready 1 --min-replays 1 || fail "GetServerInfo after the replay"
# The re-formed group started with empty caches; the replayed streams left
# their blocks cached again, so a new request shares the 16-token prefix block.
py one --refs "$WORK/refs.json" --min-cached 16 || fail "a request after the replay"
"$BIN" client --addr "$ADDR" --health --wait-ready-ms 60000 >/dev/null || fail "not ready again"
NEW=$(pgrep -P "$SERVER_PID" -f worker | tr '\n' ' ')
[ "$(echo $NEW | wc -w)" = 2 ] || fail "want 2 new worker children after re-formation, found [$NEW]"
for pid in $NEW; do
  for old in $RANKS; do [ "$pid" = "$old" ] && fail "rank pid $pid survived the re-formation"; done
done
echo "ranks: [$RANKS] -> [$NEW]"
"$BIN" client --addr "$ADDR" --health --deep >/dev/null || fail "deep health after re-formation"
serve_stop; rc=$?
[ $rc = 0 ] || fail "serve exited $rc after SIGTERM"
echo "serve_replay: OK"
