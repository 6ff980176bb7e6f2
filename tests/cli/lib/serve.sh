# Sourced by tests/cli/*_test.sh that run `exl3serve serve` on a free port:
# start it, wait for readiness (a handshake: the "listening on" line, then the
# health RPC until SERVING; no sleep stands in for it), and stop it with every
# rank process it started. The caller defines BIN, WORK and fail() and calls
# serve_stop from its EXIT trap — or, for a replay_client.py test, sets BIN and
# SRC and calls serve_test_setup, which does all of that.
#   serve_start MODEL [serve flags...]   sets SERVER_PID, ADDR and LOG ($WORK/serve-*.log);
#                                        $SERVE_CLIENT_FLAGS (e.g. --token-file F) go to the
#                                        readiness check's `client`
#   serve_stop                           SIGTERM (20 s), then SIGKILL; SIGKILLs the ranks;
#                                        returns serve's exit status
#   require_python_grpc                  exit 77 (skip, saying why) unless /usr/bin/python3 has
#                                        grpcio/protobuf and $BUILD/python holds the stubs
#   serve_test_setup [client flags...]   the common preamble of the replay_client.py tests
#                                        (speculative_serve_test.sh, seeded_sampling_test.sh,
#                                        lib/moe_serve.sh): BUILD
#                                        ($EXL3_BUILD_DIR, else the build dir above BIN), WORK (a
#                                        fresh temp dir), an EXIT trap (serve_stop, then rm -rf
#                                        WORK), INT/TERM -> exit 1, fail MSG (prints MSG and the
#                                        tail of every $WORK/*.log, exit 1), require_python_grpc,
#                                        and py ARGS... = replay_client.py against $ADDR with the
#                                        given flags (e.g. --repetitive) before ARGS
SERVER_PID=""
ADDR=""
serve_stop() {
  [ -n "$SERVER_PID" ] || return 0
  local pid=$SERVER_PID ranks
  ranks=$(pgrep -P "$pid" 2>/dev/null)
  SERVER_PID=""
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  wait "$pid"; local rc=$?
  for r in $ranks; do kill -KILL "$r" 2>/dev/null; done  # no rank outlives the test
  return $rc
}
serve_start() {
  local model=$1
  shift
  LOG="$WORK/serve-$(basename "$model")-$(echo "$*" | tr -c 'a-z0-9' _).log"
  "$BIN" --log-level warning serve --model "$model" "$@" --port 0 >"$LOG" 2>&1 &
  SERVER_PID=$!
  ADDR=""
  for _ in $(seq 600); do  # the port line comes before the ranks load
    ADDR=$(sed -n 's/^listening on //p' "$LOG")
    [ -n "$ADDR" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || fail "serve $* exited before listening"
    sleep 0.1
  done
  [ -n "$ADDR" ] || fail "serve $*: no 'listening on' line in 60 s"
  # shellcheck disable=SC2086  # SERVE_CLIENT_FLAGS is a word list
  "$BIN" client --addr "$ADDR" ${SERVE_CLIENT_FLAGS:-} --health --wait-ready-ms 120000 >/dev/null || fail "serve $*: not ready in 120 s"
}
require_python_grpc() {
  if ! /usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null; then
    echo "skip: /usr/bin/python3 lacks grpcio/protobuf (apt python3-grpcio python3-protobuf)"; exit 77
  fi
  if [ ! -f "$BUILD/python/exl3serve/v1/generation_pb2_grpc.py" ]; then
    echo "skip: no Python stubs in $BUILD/python (needs /usr/bin/grpc_python_plugin)"; exit 77
  fi
}
serve_test_cleanup() { serve_stop >/dev/null 2>&1; rm -rf "$WORK"; }
# shellcheck disable=SC2317  # fail and py are called by the sourcing test
serve_test_setup() {
  BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
  WORK=$(mktemp -d)
  trap serve_test_cleanup EXIT
  trap 'exit 1' INT TERM
  fail() {
    echo "FAIL: $*"
    for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -20 "$f"; }; done
    exit 1
  }
  SERVE_PY_FLAGS=("$@")
  require_python_grpc
  py() {
    /usr/bin/python3 "$SRC/tests/cli/replay_client.py" --addr "$ADDR" --stubs "$BUILD/python" \
      "${SERVE_PY_FLAGS[@]}" "$@"
  }
}
