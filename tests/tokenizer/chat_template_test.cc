// Tests of the chat template interpreter (coordinator/tokenizer/chat_template.h).
//
// The unit tests below need nothing outside the repository: each expected
// string was produced by Python's jinja2 configured as transformers does
// (tests/tokenizer/reference/make_chat_reference.py). The ReferenceTest cases
// compare with jinja2 over real model templates and a corpus of conversations;
// that data is produced at test time by tests/cli/chat_template_reference_test.sh,
// which sets EXL3_CHAT_TEMPLATE_REFERENCE to its manifest; run alone they skip.
#include "coordinator/tokenizer/chat_template.h"

#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::coordinator {
namespace {

using json = nlohmann::ordered_json;
using testing::HasSubstr;

absl::StatusOr<std::string> RenderText(const std::string& source, const json& context = json::object()) {
  auto tmpl = ChatTemplate::Parse(source);
  if (!tmpl.ok()) return tmpl.status();
  return tmpl->Render(context);
}

struct Golden {
  const char* name;
  const char* source;
  const char* context;
  const char* expected;
};

// (template, context, jinja2's output) triples.
const Golden kGolden[] = {
    {"trim_blocks",
     "{% if true %}\nyes\n{% endif %}\nafter",
     R"json({})json",
     "yes\nafter"},
    {"lstrip_blocks",
     "a\n    {% if true %}\n    b\n    {% endif %}\nc",
     R"json({})json",
     "a\n    b\nc"},
    {"lstrip_keeps_text_before_tag",
     "x {% if true %}y{% endif %}",
     R"json({})json",
     "x y"},
    {"plus_disables_lstrip",
     "a\n  {%+ if true %}b{% endif %}",
     R"json({})json",
     "a\n  b"},
    {"dash_strips_all",
     "a  \n\n  {%- if true -%}  \n\n b {{- ' c ' -}} \n d{% endif %}",
     R"json({})json",
     "ab c d"},
    {"variable_not_lstripped",
     "a\n   {{ 'v' }}\n",
     R"json({})json",
     "a\n   v"},
    {"comment_trimmed",
     "a\n  {# note #}\nb",
     R"json({})json",
     "a\nb"},
    {"trailing_newline_dropped",
     "text\n",
     R"json({})json",
     "text"},
    {"crlf_normalized",
     "a\r\nb\rc",
     R"json({})json",
     "a\nb\nc"},
    {"loop_vars",
     "{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }};{% endfor %}",
     R"json({"xs": ["a", "b", "c"]})json",
     "01TrueFalse33;12FalseFalse32;23FalseTrue31;"},
    {"loop_else_and_filter",
     "{% for x in xs if x > 1 %}{{ x }}{{ loop.length }},{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}",
     R"json({"xs": [1, 2, 3]})json",
     "22,32,|empty"},
    {"loop_scope",
     "{% set x = 5 %}{% for i in [1,2] %}[{{ x }}]{% set x = i %}{% endfor %}{{ x }}{% if true %}{% set y = 3 %}{% endif %}{{ y }}",
     R"json({})json",
     "[5][5]53"},
    {"namespace",
     "{% set ns = namespace(n=0, s='') %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}",
     R"json({})json",
     "6 0123"},
    {"break_continue",
     "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}",
     R"json({})json",
     "0134"},
    {"slicing",
     "{{ xs[1:] }} {{ xs[::-1] }} {{ xs[-2:] }} {{ xs[:1] }} {{ s[1:3] }} {{ s[::-1] }} {{ xs[-1] }} {{ s[0] }}",
     R"json({"xs": [1, 2, 3, 4], "s": "héllo"})json",
     "[2, 3, 4] [4, 3, 2, 1] [3, 4] [1] él olléh 4 h"},
    {"python_str",
     "{{ none }} {{ true }} {{ 1.0 }} {{ 1e-5 }} {{ 1e20 }} {{ 10/4 }} {{ 7//2 }} {{ -7 % 3 }} {{ [1, 'a', none, true, {'k': \"v'\"}] }} {{ ('t',) }}",
     R"json({})json",
     "None True 1.0 1e-05 1e+20 2.5 3 2 [1, 'a', None, True, {'k': \"v'\"}] ('t',)"},
    {"filters",
     "{{ '  x  '|trim }}|{{ xs|length }}|{{ 'héllo'|length }}|{{ 'AbC'|lower }}{{ 'abc'|upper }}|{{ u|default('dflt') }}|{{ ''|default('e', true) }}|{{ xs|first }}{{ xs|last }}|{{ xs|join(',') }}|{{ 5|string ~ 'x' }}|{{ 'hello world'|title }}|{{ 'hELLO'|capitalize }}",
     R"json({"xs": [3, 1, 2]})json",
     "x|3|5|abcABC|dflt|e|32|3,1,2|5x|Hello World|Hello"},
    {"selectattr",
     "{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(' ') }}|{{ ms|rejectattr('role', 'eq', 'user')|list|length }}|{{ ms|selectattr('x')|list }}",
     R"json({"ms": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "x": 1}, {"role": "user", "content": "c"}]})json",
     "a c|1|[{'role': 'assistant', 'content': 'b', 'x': 1}]"},
    {"tojson",
     "{{ d|tojson }}\n{{ d|tojson(indent=2) }}\n{{ 'é\"\\n'|tojson }}",
     R"json({"d": {"z": 1, "a": [1.5, null, true, "ü"], "e": {}, "l": []}})json",
     "{\"z\": 1, \"a\": [1.5, null, true, \"ü\"], \"e\": {}, \"l\": []}\n{\n  \"z\": 1,\n  \"a\": [\n    1.5,\n    null,\n    true,\n    \"ü\"\n  ],\n  \"e\": {},\n  \"l\": []\n}\n\"é\\\"\\n\""},
    {"tests",
     "{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ none is none }}{{ 's' is string }}{{ d is mapping }}{{ false is false }}{{ 0 is false }}{{ 3 is odd }}{{ 4 is divisibleby 2 }}{{ 1 is integer }}{{ 1.0 is float }}{{ xs is iterable }}{{ x is not none }}",
     R"json({"x": 1, "d": {}, "xs": []})json",
     "TrueFalseTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrue"},
    {"operators",
     "{{ 'a' in 'cat' }}{{ 2 in [1,2] }}{{ 'k' in d }}{{ 'z' not in d }}{{ 1 == 1.0 }}{{ 'a' ~ 1 ~ none }}{{ [1] + [2] }}{{ 1 < 2 < 3 }}{{ not 0 }}{{ 'b' > 'a' }}{{ 2 ** 3 }}{{ 'ab' * 2 }}{{ 1 or 2 }}{{ 0 and 1 }}{{ 'y' if 0 else 'n' }}",
     R"json({"d": {"k": 1}})json",
     "TrueTrueTrueTrueTruea1None[1, 2]TrueTrueTrue8abab10n"},
    {"string_methods",
     "{{ 'a,b,,c'.split(',') }} {{ ' x y  '.split() }} {{ 'xxhixx'.strip('x') }} {{ '\\n\\nhi\\n'.lstrip('\\n') }}|{{ '  r  '.rstrip() }}| {{ 'hello'.startswith('he') }} {{ 'hello'.endswith(('x', 'lo')) }} {{ 'a-b-c'.replace('-', '+') }} {{ 'Hi'.upper() }}{{ 'Hi'.lower() }} {{ 'a</think>b</think>c'.split('</think>')[-1] }}",
     R"json({})json",
     "['a', 'b', '', 'c'] ['x', 'y'] hi hi\n|  r| True True a+b+c HIhi c"},
    {"dict_methods",
     "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.get('a') }}{{ d.get('q', 'none!') }}{{ d.keys()|list }}{{ d|items|list }}",
     R"json({"d": {"b": 2, "a": 1}})json",
     "b=2;a=1;1none!['b', 'a'][('b', 2), ('a', 1)]"},
    {"attribute_vs_item",
     "{{ m.content }}{{ m['role'] }}{{ m.missing }}|{{ m.missing is defined }}|{{ xs.0 }}",
     R"json({"m": {"role": "user", "content": "hi"}, "xs": ["zero"]})json",
     "hiuser|False|zero"},
    {"string_escapes",
     "{{ 'tab\\there' }}|{{ \"q\\\"uote\" }}|{{ '\\u00e9\\x41' }}|{{ 'back\\\\slash' }}|{{ 'adj' 'acent' }}",
     R"json({})json",
     "tab\there|q\"uote|éA|back\\slash|adjacent"},
    {"macro",
     "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', punct='?') }}",
     R"json({})json",
     "Hi Ann! Hi Bob?"},
    {"set_block",
     "{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]",
     R"json({})json",
     "[inner 2]"},
    {"filter_binds_tighter_than_plus",
     "{{ 'a' + ' b '|trim + 'c' }}",
     R"json({})json",
     "abc"},
    {"inline_if_no_else",
     "[{{ 'x' if false }}]",
     R"json({})json",
     "[]"},
};

class GoldenTest : public testing::TestWithParam<Golden> {};

TEST_P(GoldenTest, RendersLikeJinja2) {
  const Golden& g = GetParam();
  auto out = RenderText(g.source, json::parse(g.context));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, g.expected) << "template: " << absl::CHexEscape(g.source);
}

INSTANTIATE_TEST_SUITE_P(ChatTemplate, GoldenTest, testing::ValuesIn(kGolden),
                         [](const testing::TestParamInfo<Golden>& info) { return std::string(info.param.name); });

TEST(ChatTemplateTest, RaiseExceptionIsInvalidArgumentWithTheTemplatesMessage) {
  auto out = RenderText("{% if x %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}",
                        json{{"x", true}});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "Conversation roles must alternate");
}

TEST(ChatTemplateTest, SyntaxErrorNamesLineAndColumn) {
  auto t = ChatTemplate::Parse("line one\n{% if x %}\n  {{ x + }}\n{% endif %}");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("line 3, column 10"));
}

TEST(ChatTemplateTest, UnclosedBlockIsAnError) {
  auto t = ChatTemplate::Parse("{% for m in messages %}{{ m }}");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("expected 'else' or 'endfor'"));
}

TEST(ChatTemplateTest, UnsupportedStatementIsAnErrorNamingIt) {
  auto t = ChatTemplate::Parse("{% include 'x.j2' %}");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("'include' is not supported"));
}

TEST(ChatTemplateTest, AttributeOfUndefinedIsAnErrorLikeJinja) {
  auto out = RenderText("\n{{ x.y.z }}", json{{"x", json::object()}});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("line 2"));
  EXPECT_THAT(out.status().message(), HasSubstr("'dict object' has no attribute 'y'"));
}

TEST(ChatTemplateTest, StringPlusNoneIsAnError) {
  auto out = RenderText("{{ 'a' + none }}");
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("can only concatenate str"));
}

TEST(ChatTemplateTest, ContextMustBeAnObject) {
  auto tmpl = ChatTemplate::Parse("x");
  ASSERT_TRUE(tmpl.ok());
  EXPECT_EQ(tmpl->Render(json::array()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, HugeRepetitionIsResourceExhaustedNotACrash) {
  auto out = RenderText("{{ 'abc' * 1000000000000 }}");
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted);
}

// Nested loops are bounded by the render step budget, not by patience.
TEST(ChatTemplateTest, NestedLoopsHitTheStepBudgetWithAnErrorNamingIt) {
  absl::StatusOr<std::string> r = RenderText(
      "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("kMaxRenderSteps"));
  // A few thousand iterations are nowhere near it.
  absl::StatusOr<std::string> ok = RenderText("{% for i in range(3000) %}{{ i % 10 }}{% endfor %}");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->size(), 3000u);
}

TEST(ChatTemplateTest, IntegerOverflowIsAnErrorNotUndefinedBehaviour) {
  EXPECT_EQ(RenderText("{{ 9223372036854775807 + 1 }}").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RenderText("{{ 3 ** 200 }}").status().code(), absl::StatusCode::kInvalidArgument);
  auto sliced = RenderText("{{ [1, 2, 3][::-9223372036854775807] }}|{{ [1, 2][-9223372036854775807] }}");
  ASSERT_TRUE(sliced.ok()) << sliced.status();
  EXPECT_EQ(*sliced, "[3]|");
}

TEST(ChatTemplateTest, DeepNestingIsAnErrorNotAStackOverflow) {
  auto t = ChatTemplate::Parse("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  EXPECT_EQ(ChatTemplate::Parse(ifs).status().code(), absl::StatusCode::kInvalidArgument);
}

// A template in the shape of the real ones, used for the truncation fuzz below.
constexpr char kChatLike[] = R"({%- set ns = namespace(last=-1) %}
{%- for m in messages[::-1] %}{%- if ns.last < 0 and m.role == 'user' %}{%- set ns.last = (messages|length - 1) - loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {{- '<|assistant|>' + (message.content or '') }}
        {%- for tc in message.tool_calls %}{{- '\n' ~ tc.function.name ~ ' ' ~ tc.function.arguments|tojson }}{%- endfor %}
    {%- elif message.content is string %}
        {{- '<|' + message.role + '|>\n' + message.content|trim + '<|end|>\n' }}
    {%- else %}{{ raise_exception("bad content at " ~ loop.index0) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think></think>' }}{% endif %}{%- endif %})";

TEST(ChatTemplateTest, TruncatedAndCorruptedTemplatesFailCleanly) {
  const unsigned seed = static_cast<unsigned>(testing::UnitTest::GetInstance()->random_seed());
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937 rng(seed);
  const json context = json::parse(R"({"messages": [{"role": "user", "content": " hi "},
      {"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
      {"role": "user", "content": ["not", "a", "string"]}], "add_generation_prompt": true, "enable_thinking": false})");
  const std::string full = kChatLike;
  static constexpr char kNoise[] = "{}%#-+()[]'\"|.,:~ \n\\";
  auto whole = RenderText(full, context);
  EXPECT_EQ(whole.status().message(), "bad content at 2");
  for (size_t cut = 0; cut <= full.size(); ++cut) {
    auto tmpl = ChatTemplate::Parse(full.substr(0, cut));
    if (tmpl.ok()) (void)tmpl->Render(context);  // any result but a crash
  }
  for (int i = 0; i < 2000; ++i) {
    std::string s = full;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const size_t at = rng() % s.size();
      switch (rng() % 3) {
        case 0: s.erase(at, 1 + rng() % 8); break;
        case 1: s.insert(s.begin() + static_cast<std::ptrdiff_t>(at), kNoise[rng() % (sizeof(kNoise) - 1)]); break;
        default: s[at] = static_cast<char>(rng() % 256);
      }
      if (s.empty()) s = "x";
    }
    auto tmpl = ChatTemplate::Parse(s);
    if (tmpl.ok()) (void)tmpl->Render(context);
  }
}

// A byte-level tokenizer with two special added tokens, and a chat template.
std::unique_ptr<Tokenizer> TinyChatTokenizer(const std::string& chat_template) {
  nlohmann::json vocab = nlohmann::json::object();
  const std::string bytes =
      "!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~";
  for (size_t i = 0; i < bytes.size(); ++i) vocab[std::string(1, bytes[i])] = static_cast<int>(i);
  vocab["\xC4\xA0"] = 94;  // Ġ (space)
  vocab["\xC4\x8A"] = 95;  // Ċ (newline)
  auto added = [](int id, const char* content) {
    return nlohmann::json{{"id", id}, {"content", content}, {"special", true}, {"normalized", false}};
  };
  const nlohmann::json tokenizer = {
      {"added_tokens", {added(96, "<s>"), added(97, "</s>")}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
  };
  const nlohmann::json config = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"chat_template", chat_template}};
  auto t = Tokenizer::FromJson(tokenizer.dump(), config.dump(), "tiny");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(RenderChatPromptTest, PassesSpecialTokensToolsAndExtraContext) {
  auto tok = TinyChatTokenizer(
      "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
      "{% if tools %}tools={{ tools|length }}{% endif %}{{ documents }}"
      "{% if add_generation_prompt %}[assistant]{% endif %}{{ enable_thinking }}");
  ASSERT_NE(tok, nullptr);
  const json messages = json::parse(R"([{"role": "user", "content": "hi"}])");
  auto plain = RenderChatPrompt(*tok, messages, {});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(*plain, "<s>[user]hi</s>None");
  ChatPromptOptions options;
  options.add_generation_prompt = true;
  options.tools = json::parse(R"([{"type": "function"}])");
  options.extra_context = json{{"enable_thinking", false}};
  auto full = RenderChatPrompt(*tok, messages, options);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(*full, "<s>[user]hi</s>tools=1None[assistant]False");
}

TEST(RenderChatPromptTest, ModelWithoutTemplateIsFailedPrecondition) {
  auto tok = TinyChatTokenizer("");
  ASSERT_NE(tok, nullptr);
  auto out = RenderChatPrompt(*tok, json::array(), {});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(RenderChatPromptTest, MessagesMustBeAnArray) {
  auto tok = TinyChatTokenizer("x");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(RenderChatPrompt(*tok, json::object(), {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- jinja2 reference

// Mismatches reported per template before the rest are only counted.
constexpr int kMaxReported = 6;

class ReferenceTest : public testing::Test {
 protected:
  void SetUp() override {
    const char* manifest_path = std::getenv("EXL3_CHAT_TEMPLATE_REFERENCE");
    if (manifest_path == nullptr) {
      GTEST_SKIP() << "EXL3_CHAT_TEMPLATE_REFERENCE is not set: the reference comes from "
                      "tests/cli/chat_template_reference_test.sh (needs python3-jinja2, node and npm)";
    }
    auto manifest = sharding::ReadJsonFile(manifest_path);
    ASSERT_TRUE(manifest.ok()) << manifest.status();
    for (const auto& entry : *manifest) {
      auto text = sharding::ReadFileToString(entry.at("cases_file").get<std::string>());
      ASSERT_TRUE(text.ok()) << text.status();
      files_.push_back(json::parse(*text));  // ordered: tojson output keeps the corpus' key order
    }
    ASSERT_FALSE(files_.empty()) << "the manifest lists no templates";
  }

  std::vector<json> files_;
};

TEST_F(ReferenceTest, RendersEveryCaseByteIdenticallyToJinja2) {
  for (const json& file : files_) {
    const std::string name = file.at("name").get<std::string>();
    auto tmpl = ChatTemplate::Parse(file.at("template").get<std::string>());
    ASSERT_TRUE(tmpl.ok()) << name << ": " << tmpl.status();
    int mismatches = 0, rendered = 0, errors = 0;
    for (const json& c : file.at("cases")) {
      auto out = tmpl->Render(c.at("context"));
      const std::string id = absl::StrCat(name, " ", c.at("id").get<std::string>());
      bool ok;
      if (c.contains("output")) {
        ++rendered;
        ok = out.ok() && *out == c.at("output").get<std::string>();
        if (!ok && ++mismatches <= kMaxReported) {
          ADD_FAILURE() << id << ":\n  jinja2: \"" << absl::CHexEscape(c.at("output").get<std::string>())
                        << "\"\n  ours:   "
                        << (out.ok() ? absl::StrCat("\"", absl::CHexEscape(*out), "\"") : out.status().ToString());
        }
      } else {
        ++errors;
        const std::string want = c.at("error").get<std::string>();
        ok = !out.ok() && out.status().code() == absl::StatusCode::kInvalidArgument &&
             (!c.at("raised").get<bool>() || out.status().message() == want);
        if (!ok && ++mismatches <= kMaxReported) {
          ADD_FAILURE() << id << ": jinja2 raised \"" << want << "\", ours "
                        << (out.ok() ? absl::StrCat("rendered \"", absl::CHexEscape(*out), "\"") : out.status().ToString());
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << name << ": " << mismatches << " of " << rendered + errors << " cases differ";
    std::printf("%s: %d renders and %d errors identical to jinja2\n", name.c_str(), rendered - mismatches, errors);
  }
}

TEST_F(ReferenceTest, TruncatedTemplatesRenderOrFailLikeJinja2) {
  for (const json& file : files_) {
    const std::string name = file.at("name").get<std::string>();
    const json& context = file.at("truncation_context");
    int mismatches = 0;
    for (const json& t : file.at("truncations")) {
      const std::string source = t.at("template").get<std::string>();
      absl::StatusOr<std::string> out = RenderText(source, context);
      const bool ok = t.contains("output") ? (out.ok() && *out == t.at("output").get<std::string>()) : !out.ok();
      if (!ok && ++mismatches <= kMaxReported) {
        ADD_FAILURE() << name << " cut at " << source.size() << " bytes: jinja2 "
                      << (t.contains("output") ? "rendered" : "failed: " + t.at("error").get<std::string>())
                      << "; ours " << (out.ok() ? absl::StrCat("rendered \"", absl::CHexEscape(*out), "\"") : out.status().ToString());
      }
    }
    EXPECT_EQ(mismatches, 0) << name;
  }
}

}  // namespace
}  // namespace exl3serve::coordinator
