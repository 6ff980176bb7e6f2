#!/usr/bin/python3
"""Writes reference renderings of chat templates for tests/tokenizer/chat_template_test.cc.

Renders the `chat_template` of each model's tokenizer_config.json with Python's
jinja2 exactly the way Hugging Face transformers' apply_chat_template does:

  * jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
    lstrip_blocks=True) with the jinja2.ext.loopcontrols extension;
  * globals raise_exception(message) (raises with the template's message) and
    strftime_now(format) (datetime.now().strftime);
  * the tojson filter replaced by json.dumps(x, ensure_ascii=False,
    indent=indent, separators=separators, sort_keys=sort_keys): no HTML
    escaping, non-ASCII kept, separators ", " / ": " without indent and
    "," / ": " with it (json.dumps' own defaults), keys in insertion order;
  * render(messages=..., tools=... or None, documents=None,
    add_generation_prompt=..., <special tokens of tokenizer_config.json>,
    **template kwargs).

Run with Debian's interpreter (/usr/bin/python3, package python3-jinja2):

  /usr/bin/python3 make_chat_reference.py OUT_DIR NAME=MODEL_DIR...

OUT_DIR/manifest.json lists the templates; OUT_DIR/<name>.chat.json holds the
template, every rendered case (context, then output or error) and renders of
truncated copies of the template (output or error). The corpus is below; it is
deterministic.
"""
import datetime
import json
import os
import random
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRaised(Exception):
    """raise_exception() was called by the template."""


def raise_exception(message):
    raise TemplateRaised(message)


def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_compiled = {}


def render(env, template, context):
    """Returns {"output": str} or {"error": str, "raised": bool}."""
    try:
        if template not in _compiled:
            _compiled[template] = env.from_string(template)
        return {"output": _compiled[template].render(**context)}
    except TemplateRaised as e:
        return {"error": str(e), "raised": True}
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ZeroDivisionError, OverflowError, RecursionError) as e:
        return {"error": f"{type(e).__name__}: {e}", "raised": False}


# ---------------------------------------------------------------- corpus
def u(text):
    return {"role": "user", "content": text}


def a(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def s(text):
    return {"role": "system", "content": text}


def tool(text, name=None):
    m = {"role": "tool", "content": text}
    if name:
        m["name"] = name
    return m


def call(name, arguments, wrap=True, call_id=None):
    c = {"name": name, "arguments": arguments}
    if not wrap:
        return c
    out = {"type": "function", "function": c}
    if call_id:
        out = {"id": call_id, **out}
    return out


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city, in °C — «quoted» \"text\" & <tags>",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1},
                "threshold": {"type": "number", "default": 0.5, "examples": [1e-7, 1e16, -2.25, 3.0]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.\nReturns a list of results.\ttabbed\u2028sep",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                       "required": ["query"]},
    },
}

CONVERSATIONS = [
    ("single_user", [u("Hello")]),
    ("system_user", [s("You are a helpful assistant."), u("Hi there!")]),
    ("system_user_assistant", [s("Be brief."), u("What is 2+2?"), a("4")]),
    ("multi_turn", [u("Hi"), a("Hello! How can I help?"), u("Tell me a joke."), a("Why did the chicken cross the road?"),
                    u("Why?")]),
    ("assistant_last", [u("Name a colour."), a("Blue.")]),
    ("unicode", [s("Réponds en français. 🇫🇷"), u("你好，世界！👨‍👩‍👧 café naïve e\u0301"), a("Привет! ✓"),
                 u("مرحبا \u200b zero-width")]),
    ("empty_user_content", [u("")]),
    ("empty_assistant_content", [u("Say nothing."), a(""), u("Thanks")]),
    ("whitespace_content", [s("  padded system  \n"), u("\n\n  leading and trailing  \n\t"), a("  spaced answer \n")]),
    ("template_like_text", [u("{{ messages }} {% if x %} {# c #} <|im_start|>user <|eot_id|> <s> [INST]")]),
    ("quotes_backslashes", [u("She said \"hi\" and 'bye' \\ back\\slash \\n not a newline")]),
    ("crlf_and_controls", [u("line1\r\nline2\rline3\u0001\u007f\u2028end")]),
    ("long_content", [u("lorem ipsum dolor sit amet " * 200)]),
    ("system_only", [s("Only a system prompt.")]),
    ("tool_response_as_user", [u("What's the weather?"),
                               u("<tool_response>\n{\"temp\": 20}\n</tool_response>")]),
    ("think_in_content", [u("What is 3*7?"), a("<think>\n3*7 = 21\n</think>\n\n21")]),
    ("think_in_earlier_turn", [u("Q1"), a("<think>reason 1</think>A1"), u("Q2"), a("<think>\nreason 2\n</think>\nA2")]),
    ("reasoning_content_field", [u("Why is the sky blue?"),
                                 a("Rayleigh scattering.", reasoning_content="Short wavelengths scatter more.")]),
    ("reasoning_content_null", [u("Hi"), a("Hello", reasoning_content=None)]),
    ("reasoning_content_newlines", [u("Q"), a("\n\nAnswer", reasoning_content="\n\nthinking...\n\n")]),
    ("reasoning_then_user", [u("Q1"), a("A1", reasoning_content="R1"), u("Q2")]),
    ("close_think_only", [u("Q"), a("</think>")]),
    ("tool_call_roundtrip", [
        u("What's the weather in Paris?"),
        a("", tool_calls=[call("get_weather", {"city": "Paris", "unit": "celsius"}, call_id="call_1")]),
        tool("{\"temperature\": 18.5, \"condition\": \"cloudy\"}", "get_weather"),
        a("It is 18.5 °C and cloudy in Paris."),
    ]),
    ("tool_call_string_arguments", [
        u("Search for jinja"),
        a("Let me search.", tool_calls=[call("search", "{\"query\": \"jinja\", \"k\": 3}")]),
        tool("[\"result 1\", \"result 2\"]"),
    ]),
    ("multiple_tool_calls", [
        u("Weather in Paris and Tokyo?"),
        a("", tool_calls=[call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "東京", "days": 3})]),
        tool("{\"temp\": 18}"),
        tool("{\"temp\": 25}"),
        a("Paris 18, Tokyo 25."),
    ]),
    ("tool_call_unwrapped", [
        u("Do it"),
        a("ok", tool_calls=[call("search", {"query": "x", "nested": {"b": [1, 2.5, True, None], "a": "ü"}}, wrap=False)]),
    ]),
    ("tool_call_with_think", [
        u("Weather?"),
        a("<think>I should call the tool.</think>Calling.", tool_calls=[call("get_weather", {"city": "Oslo"})]),
        tool("{\"temp\": -3}"),
        a("It is -3 °C."),
        u("Thanks"),
    ]),
    ("tool_first", [tool("orphan tool output"), u("hi")]),
    ("system_in_middle", [u("Hi"), s("New instructions."), u("Continue")]),
    ("ten_turns", [m for i in range(5) for m in (u(f"question {i}"), a(f"answer {i}"))]),
    ("content_list_parts", [u([{"type": "text", "text": " Describe this. "}, {"type": "image"}])]),
    ("system_content_list", [{"role": "system", "content": [{"type": "text", "text": "List system."}]}, u("Hi")]),
    ("content_number", [u(42)]),
    ("assistant_null_content_tool_calls", [
        u("Call it"),
        {"role": "assistant", "content": None, "tool_calls": [call("search", "{\"query\": \"q\"}")]},
        tool("done"),
        a("Done."),
    ]),
    ("extra_fields", [{"role": "user", "content": "with extras", "name": "alice", "id": 7, "meta": {"k": "v"}}]),
    ("roles_not_alternating", [u("one"), u("two")]),
    ("assistant_first", [a("I start."), u("ok")]),
    ("empty_messages", []),
    ("unknown_role", [{"role": "developer", "content": "dev note"}, u("hi")]),
    ("user_missing_content", [{"role": "user"}]),
    ("think_tags_in_user", [u("<think>user thinks</think> hello")]),
    ("tools_no_system", [u("weather?")], [WEATHER_TOOL]),
    ("tools_with_system", [s("Use tools wisely."), u("search cats")], [WEATHER_TOOL, SEARCH_TOOL]),
    ("tools_and_roundtrip", [
        s("sys"), u("Weather in Rome?"),
        a("", tool_calls=[call("get_weather", {"city": "Rome", "threshold": 0.1, "days": 2})]),
        tool("{\"temp\": 22}"), a("22 °C."), u("And tomorrow?"),
    ], [WEATHER_TOOL]),
    ("tools_empty_list", [u("hi")], []),
]

KWARGS_VARIANTS = [{}, {"enable_thinking": False}, {"enable_thinking": True}]


def special_tokens(config):
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


def main():
    if len(sys.argv) < 3:
        print("usage: make_chat_reference.py OUT_DIR NAME=MODEL_DIR...", file=sys.stderr)
        sys.exit(2)
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    env = make_env()
    manifest = []
    for spec in sys.argv[2:]:
        name, model_dir = spec.split("=", 1)
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            print(f"{name}: no chat_template in {model_dir}/tokenizer_config.json; skipped")
            continue
        special = special_tokens(config)
        cases = []
        for conv in CONVERSATIONS:
            conv_name, messages = conv[0], conv[1]
            tools = conv[2] if len(conv) > 2 else None
            for add_generation_prompt in (False, True):
                for kwargs in KWARGS_VARIANTS:
                    context = {"messages": messages, "tools": tools, "documents": None,
                               "add_generation_prompt": add_generation_prompt, **special, **kwargs}
                    case = {"id": f"{conv_name}/agp={int(add_generation_prompt)}/{json.dumps(kwargs)}",
                            "context": context}
                    case.update(render(env, template, context))
                    cases.append(case)
        # Truncated copies of the template (cut at code point boundaries), rendered
        # with one tool-using context: the C++ side must agree on output or error.
        rng = random.Random(20240611)
        trunc_context = {"messages": CONVERSATIONS[22][1], "tools": [WEATHER_TOOL], "documents": None,
                         "add_generation_prompt": True, **special}
        cuts = sorted(set(rng.randrange(0, len(template) + 1) for _ in range(60)))
        truncations = []
        for cut in cuts:
            entry = {"template": template[:cut]}
            entry.update(render(env, template[:cut], trunc_context))
            truncations.append(entry)
        cases_file = os.path.join(out_dir, f"{name}.chat.json")
        with open(cases_file, "w", encoding="utf-8") as f:
            json.dump({"name": name, "template": template, "special_tokens": special, "cases": cases,
                       "truncation_context": trunc_context, "truncations": truncations}, f, ensure_ascii=False)
        rendered = sum(1 for c in cases if "output" in c)
        print(f"{name}: {len(cases)} cases ({rendered} rendered, {len(cases) - rendered} errors), "
              f"{len(truncations)} truncations")
        manifest.append({"name": name, "model_dir": model_dir, "cases_file": cases_file})
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    print(f"{len(CONVERSATIONS)} conversations x 2 add_generation_prompt x {len(KWARGS_VARIANTS)} kwargs per template")


if __name__ == "__main__":
    main()
