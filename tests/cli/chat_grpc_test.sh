#!/usr/bin/env bash
# Chat input in the gRPC API (GenerateRequest.chat): stories260K (../shared)
# imported with its tokenizer and given a chat template; the server renders the
# messages with its own template engine, and the result must equal jinja2's
# rendering (python3-jinja2, the independent reference) sent as plain text:
# same prompt token count, same greedy tokens. GetModelInfo says the model has
# a template; bad roles, a tool result without tool_call_id and bad JSON are
# INVALID_ARGUMENT naming the field; a model without a template refuses chat.
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
SHARED=${EXL3_SHARED_DIR:-$SRC/../shared}
STORIES=$SHARED/models/stories260K
[ -f "$STORIES/stories260K.bin" ] || { echo "SKIP: $STORIES not found"; exit 77; }
/usr/bin/python3 -c 'import grpc, google.protobuf, jinja2' 2>/dev/null ||
  { echo "SKIP: /usr/bin/python3 lacks grpcio/protobuf/jinja2"; exit 77; }
[ -f "$BUILD/python/exl3serve/v1/generation_pb2_grpc.py" ] || { echo "SKIP: no Python stubs"; exit 77; }
WORK=$(mktemp -d)
source "$SRC/tests/cli/lib/serve.sh"
cleanup() { serve_stop >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -n "${LOG:-}" ] && [ -f "$LOG" ] && tail -20 "$LOG"; exit 1; }

"$BIN" import-llama2c --in "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" --out "$WORK/hf" \
  >/dev/null || fail "import"
cp -r "$WORK/hf" "$WORK/plain"
/usr/bin/python3 - "$WORK/hf/tokenizer_config.json" <<'PY' || fail "adding a chat template"
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c["chat_template"] = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}[{{ m['content'] | trim }}]\n"
    "{% elif m['role'] == 'tool' %}(tool {{ m['tool_call_id'] }}: {{ m['content'] }})\n"
    "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %} <call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}{% endif %}\n{% endif %}{% endfor %}"
    "{% if tools %}Tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
    "{% if add_generation_prompt %}Once upon a time{% endif %}")
json.dump(c, open(p, "w"), indent=2)
PY

serve_start "$WORK/hf" --tp 1
/usr/bin/python3 - "$ADDR" "$BUILD/python" "$WORK/hf/tokenizer_config.json" <<'PY' || fail "chat checks"
import json, sys
import grpc, jinja2
sys.path.insert(0, sys.argv[2])
from exl3serve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
stub = pb_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
assert info.has_chat_template, info

def run(req):
    req.sampling_params.temperature = 0.0
    req.sampling_params.max_tokens = 16
    req.sampling_params.ignore_eos = True
    done = None
    for r in stub.Generate(req, timeout=60):
        if r.HasField("complete"):
            done = r.complete
        assert not r.HasField("error"), r.error
    return done

tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
messages = [
    {"role": "system", "content": "  A story teller. "},
    {"role": "user", "content": "Tell me about Lily."},
    {"role": "assistant", "content": "Lily was a girl.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "user", "content": "And then?"},
]
env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
template = env.from_string(json.load(open(sys.argv[3]))["chat_template"])
for gen_prompt in (True, False):
    want = template.render(messages=messages, tools=tools, add_generation_prompt=gen_prompt, bos_token="<s>")
    chat = pb.GenerateRequest(request_id=f"chat-{gen_prompt}")
    for m in messages:
        cm = chat.chat.messages.add(role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", ""))
        for c in m.get("tool_calls", []):
            cm.tool_calls.add(id=c["id"], function_name=c["function"]["name"],
                              arguments_json=json.dumps(c["function"]["arguments"]))
    chat.chat.tools_json = json.dumps(tools)
    chat.chat.add_generation_prompt = gen_prompt
    text = pb.GenerateRequest(request_id=f"text-{gen_prompt}", text=want, add_special_tokens=False)
    a, b = run(chat), run(text)
    assert a.prompt_tokens == b.prompt_tokens, (a.prompt_tokens, b.prompt_tokens)
    assert list(a.output_ids) == list(b.output_ids), (list(a.output_ids), list(b.output_ids))
    print(f"chat (add_generation_prompt={gen_prompt}) == jinja2 text: {a.prompt_tokens} prompt tokens, "
          f"{len(a.output_ids)} equal greedy tokens")

def refused(req, field):
    try:
        run(req)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.details(), (e.code(), e.details())
        print(f"refused: {e.details()}")
        return
    raise AssertionError(f"accepted a request with a bad {field}")

bad = pb.GenerateRequest(); bad.chat.messages.add(role="wizard", content="hi")
refused(bad, "chat.messages[0].role")
bad = pb.GenerateRequest(); bad.chat.messages.add(role="tool", content="x")
refused(bad, "chat.messages[0].tool_call_id")
bad = pb.GenerateRequest(); bad.chat.messages.add(role="user", content="x"); bad.chat.template_kwargs_json = "[1"
refused(bad, "chat.template_kwargs_json")
refused(pb.GenerateRequest(chat=pb.ChatInput()), "chat.messages")
PY
# The C++ client's --chat-json (an OpenAI-style file) gives the same tokens as the text.
cat >"$WORK/chat.json" <<'JSON'
{"messages": [{"role": "system", "content": "A story teller."}, {"role": "user", "content": "Tell me about Lily."}]}
JSON
chat_ids=$("$BIN" client --addr "$ADDR" --chat-json "$WORK/chat.json" --temperature 0 --max-tokens 12 --ignore-eos --ids) ||
  fail "client --chat-json"
text_ids=$("$BIN" client --addr "$ADDR" --prompt "$(printf '<s>[A story teller.]\nUser: Tell me about Lily.\nOnce upon a time')" \
           --temperature 0 --max-tokens 12 --ignore-eos --ids) || fail "client --prompt"
[ "$chat_ids" = "$text_ids" ] || fail "client --chat-json '$chat_ids' != text '$text_ids'"
echo "client --chat-json == text: $chat_ids"
serve_stop || fail "serve exited non-zero"

serve_start "$WORK/plain" --tp 1
/usr/bin/python3 - "$ADDR" "$BUILD/python" <<'PY' || fail "a model without a template"
import sys
import grpc
sys.path.insert(0, sys.argv[2])
from exl3serve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
stub = pb_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
assert not stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).has_chat_template
req = pb.GenerateRequest(); req.chat.messages.add(role="user", content="hi")
try:
    list(stub.Generate(req, timeout=30))
    raise AssertionError("chat accepted without a template")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.details(), e.details()
    print(f"no template: {e.details()}")
PY
echo "chat_grpc_test: OK"
