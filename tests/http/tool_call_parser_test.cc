// ToolCallParser (coordinator/http/tool_call_parser.h): Hermes, Llama 3 JSON and
// Mistral tool calls, streamed name-first, held-back partial markers, bad JSON
// returned as content, and results independent of how the text was split.
#include "coordinator/http/tool_call_parser.h"

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace exl3serve::coordinator::http {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 42;

struct Expected {
  std::string name;
  std::string arguments;
};

// Feeds `pieces` to one parser, checks the streaming conventions on every
// delta (first delta of a call: next index, id and name; later ones: neither)
// and returns the merged result.
ParsedMessage FeedPieces(ToolCallFormat format, const std::vector<std::string>& pieces,
                         uint64_t seed = kSeed) {
  ToolCallParser parser(format, seed);
  ParsedMessage message;
  std::set<int> started;
  auto check = [&](const ParsedOutput& out) {
    for (const ToolCallDelta& delta : out.tool_calls) {
      if (started.count(delta.index) == 0) {
        EXPECT_EQ(delta.index, static_cast<int>(started.size())) << "indices must appear in order";
        EXPECT_TRUE(delta.id.has_value()) << "first delta of call " << delta.index << " lacks an id";
        EXPECT_TRUE(delta.name.has_value()) << "first delta of call " << delta.index << " lacks a name";
        started.insert(delta.index);
      } else {
        EXPECT_FALSE(delta.id.has_value()) << "id repeated on call " << delta.index;
        EXPECT_FALSE(delta.name.has_value()) << "name repeated on call " << delta.index;
        EXPECT_EQ(delta.index, static_cast<int>(started.size()) - 1) << "delta for an older call";
      }
    }
    MergeParsedOutput(out, &message);
  };
  for (const std::string& piece : pieces) check(parser.Feed(piece));
  check(parser.Finish());
  EXPECT_EQ(parser.num_calls(), static_cast<int>(message.calls.size()));
  return message;
}

std::vector<std::string> Bytewise(std::string_view text) {
  std::vector<std::string> pieces;
  for (char c : text) pieces.emplace_back(1, c);
  return pieces;
}

std::vector<std::string> RandomSplits(std::string_view text, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> length(0, 7);  // empty pieces included
  std::vector<std::string> pieces;
  size_t at = 0;
  while (at < text.size()) {
    const size_t n = std::min<size_t>(length(rng), text.size() - at);
    pieces.emplace_back(text.substr(at, n));
    at += n;
  }
  return pieces;
}

void ExpectSameMessage(const ParsedMessage& got, const ParsedMessage& want) {
  EXPECT_EQ(got.content, want.content);
  ASSERT_EQ(got.calls.size(), want.calls.size());
  for (size_t i = 0; i < got.calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].id, want.calls[i].id) << "call " << i;
    EXPECT_EQ(got.calls[i].name, want.calls[i].name) << "call " << i;
    EXPECT_EQ(got.calls[i].arguments, want.calls[i].arguments) << "call " << i;
  }
}

// Parses `text` whole, byte by byte and at random split points, checks that
// all agree with each other and with ParseToolCalls, and returns the result.
ParsedMessage ParseAllWays(ToolCallFormat format, std::string_view text) {
  const ParsedMessage whole = FeedPieces(format, {std::string(text)});
  {
    SCOPED_TRACE("non-streaming ParseToolCalls");
    ExpectSameMessage(ParseToolCalls(format, text, kSeed), whole);
  }
  {
    SCOPED_TRACE("fed byte by byte");
    ExpectSameMessage(FeedPieces(format, Bytewise(text)), whole);
  }
  const uint32_t gtest_seed = static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
  for (uint32_t round = 0; round < 20; ++round) {
    const uint32_t seed = gtest_seed * 1000 + round;
    SCOPED_TRACE(::testing::Message() << "random splits, seed " << seed);
    ExpectSameMessage(FeedPieces(format, RandomSplits(text, seed)), whole);
  }
  return whole;
}

void ExpectMessage(const ParsedMessage& got, std::string_view content, const std::vector<Expected>& calls) {
  EXPECT_EQ(got.content, content);
  ASSERT_EQ(got.calls.size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].name, calls[i].name) << "call " << i;
    EXPECT_EQ(got.calls[i].arguments, calls[i].arguments) << "call " << i;
  }
}

bool IsAlnum(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

// --- names and detection ----------------------------------------------------

TEST(ToolCallFormatTest, NamesRoundTripAndAliasesResolve) {
  for (ToolCallFormat f : {ToolCallFormat::kNone, ToolCallFormat::kHermes, ToolCallFormat::kLlama3Json,
                           ToolCallFormat::kMistral}) {
    absl::StatusOr<ToolCallFormat> parsed = ToolCallFormatFromName(ToolCallFormatName(f));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_EQ(ToolCallFormatName(ToolCallFormat::kHermes), "hermes");
  EXPECT_EQ(ToolCallFormatName(ToolCallFormat::kLlama3Json), "llama3_json");
  EXPECT_EQ(ToolCallFormatName(ToolCallFormat::kMistral), "mistral");
  EXPECT_EQ(ToolCallFormatName(ToolCallFormat::kNone), "none");
  EXPECT_EQ(*ToolCallFormatFromName("qwen"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ToolCallFormatFromName("qwen3"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ToolCallFormatFromName("llama3"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(*ToolCallFormatFromName("Hermes"), ToolCallFormat::kHermes);
}

TEST(ToolCallFormatTest, UnknownNameIsInvalidArgumentListingTheNames) {
  absl::StatusOr<ToolCallFormat> parsed = ToolCallFormatFromName("pythonic");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("pythonic"));
  for (const char* name : {"none", "hermes", "qwen", "llama3_json", "mistral"}) {
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(name));
  }
  EXPECT_FALSE(ToolCallFormatFromName("").ok());
}

TEST(ToolCallFormatTest, DetectsFormatFromChatTemplate) {
  EXPECT_EQ(DetectToolCallFormat("{% for tool in tools %}...<tool_call>\n{{ tool_call }}</tool_call>"),
            ToolCallFormat::kHermes);
  EXPECT_EQ(DetectToolCallFormat("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}"), ToolCallFormat::kMistral);
  EXPECT_EQ(DetectToolCallFormat("{{- '<|python_tag|>' + tool_call.name }}"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(DetectToolCallFormat("<|start_header_id|>... \"parameters\": ... <|eot_id|>"),
            ToolCallFormat::kLlama3Json);
  EXPECT_EQ(DetectToolCallFormat("<|eot_id|> without the other word"), ToolCallFormat::kNone);
  EXPECT_EQ(DetectToolCallFormat("{% for m in messages %}{{ m.content }}{% endfor %}"), ToolCallFormat::kNone);
  EXPECT_EQ(DetectToolCallFormat(""), ToolCallFormat::kNone);
}

// --- Hermes -------------------------------------------------------------------

TEST(HermesToolCallTest, ParsesOneCallWithContentBefore) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kHermes,
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
  ExpectMessage(m, "Let me check.\n", {{"get_weather", "{\"city\": \"Paris\"}"}});
}

TEST(HermesToolCallTest, ParsesSeveralCallsSeparatedByWhitespace) {
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kHermes,
                                       "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
                                       "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\n\n"
                                       "<tool_call>{\"name\":\"c\",\"arguments\":[1,2]}</tool_call>\n");
  ExpectMessage(m, "", {{"a", "{\"x\": 1}"}, {"b", "{}"}, {"c", "[1,2]"}});
}

TEST(HermesToolCallTest, HoldsBackAPartialOpenMarkerAcrossFragments) {
  ToolCallParser parser(ToolCallFormat::kHermes, kSeed);
  ParsedOutput out = parser.Feed("Sure. <tool_");
  EXPECT_EQ(out.content, "Sure. ");
  EXPECT_TRUE(out.tool_calls.empty());
  out = parser.Feed("call>{\"name\": \"f\", ");
  EXPECT_EQ(out.content, "");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "f");
  EXPECT_EQ(out.tool_calls[0].arguments, "");
  out = parser.Feed("\"arguments\": {\"q\": 1}}</tool_call>");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].index, 0);
  EXPECT_FALSE(out.tool_calls[0].name.has_value());
  EXPECT_EQ(out.tool_calls[0].arguments, "{\"q\": 1}");
  EXPECT_TRUE(parser.Finish().empty());
}

TEST(HermesToolCallTest, ReleasesHeldTextThatDidNotBecomeAMarker) {
  ToolCallParser parser(ToolCallFormat::kHermes, kSeed);
  EXPECT_EQ(parser.Feed("a <tool").content, "a ");
  EXPECT_EQ(parser.Feed("box> and <").content, "<toolbox> and ");
  EXPECT_EQ(parser.Finish().content, "<");
  EXPECT_EQ(parser.num_calls(), 0);
}

TEST(HermesToolCallTest, SendsTheNameAsSoonAsItIsCompleteThenStreamsArguments) {
  ToolCallParser parser(ToolCallFormat::kHermes, kSeed);
  EXPECT_TRUE(parser.Feed("<tool_call>{\"name\": \"get_wea").empty());
  ParsedOutput out = parser.Feed("ther\"");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "get_weather");
  ASSERT_TRUE(out.tool_calls[0].id.has_value());
  EXPECT_EQ(parser.num_calls(), 1);
  EXPECT_TRUE(parser.Feed(", \"arguments\": ").empty());
  out = parser.Feed("{\"city\": \"Pa");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments, "{\"city\": \"Pa");
  out = parser.Feed("ris\"}}\n</tool_call>");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments, "ris\"}");  // stops at the end of the value
  EXPECT_TRUE(parser.Finish().empty());
}

TEST(HermesToolCallTest, BuffersArgumentsThatComeBeforeTheName) {
  ToolCallParser parser(ToolCallFormat::kHermes, kSeed);
  EXPECT_TRUE(parser.Feed("<tool_call>{\"arguments\": {\"a\": [1, {\"b\": 2}]}, ").empty());
  ParsedOutput out = parser.Feed("\"name\": \"f\"}</tool_call>");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "f");
  EXPECT_EQ(out.tool_calls[0].arguments, "{\"a\": [1, {\"b\": 2}]}");

  const ParsedMessage m =
      ParseAllWays(ToolCallFormat::kHermes, "<tool_call>{\"arguments\": {\"a\": \"}\"}, \"name\": \"f\"}</tool_call>");
  ExpectMessage(m, "", {{"f", "{\"a\": \"}\"}"}});
}

TEST(HermesToolCallTest, KeepsNestedObjectsAndTrickyStringsVerbatim) {
  const std::string arguments =
      R"({"code": "if (x) { return \"}\"; }", "tag": "</tool_call>", "path": "C:\\dir\\", )"
      R"("nested": {"list": [{"a": "]"}, [[]], {}], "q": "say \"hi\""}, "n": -1.5e3, "t": true, "z": null})";
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kHermes,
      "<tool_call>\n{\"name\": \"run\", \"arguments\": " + arguments + "}\n</tool_call>after");
  ExpectMessage(m, "after", {{"run", arguments}});
}

TEST(HermesToolCallTest, PassesDoubleEncodedArgumentsThrough) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kHermes, R"(<tool_call>{"name": "f", "arguments": "{\"city\": \"Paris\"}"}</tool_call>)");
  ExpectMessage(m, "", {{"f", R"("{\"city\": \"Paris\"}")"}});
}

TEST(HermesToolCallTest, GivesACallWithoutArgumentsAnEmptyObject) {
  const ParsedMessage m =
      ParseAllWays(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"get_time\"}</tool_call>");
  ExpectMessage(m, "", {{"get_time", "{}"}});
}

TEST(HermesToolCallTest, IgnoresOtherKeysAndDecodesTheName) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kHermes,
      R"(<tool_call>{"type": "function", "id": {"x": "}"}, "name": "caf\u00e9_\"q\"", "arguments": {"k": 1}, )"
      R"("arguments": {"ignored": 2}, "extra": [1]}</tool_call>)");
  ExpectMessage(m, "", {{"caf\xC3\xA9_\"q\"", "{\"k\": 1}"}});
}

TEST(HermesToolCallTest, ReturnsBadJsonAsContent) {
  const std::string not_json = "<tool_call>\nnot json\n</tool_call>";
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, not_json), not_json, {});
  const std::string no_name = "<tool_call>{\"arguments\": {\"a\": 1}}</tool_call> then";
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, no_name), no_name, {});
  const std::string name_not_string = "<tool_call>{\"name\": 5, \"arguments\": {}}</tool_call>";
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, name_not_string), name_not_string, {});
  const std::string empty_name = "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>";
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, empty_name), empty_name, {});
  const std::string missing_colon = "<tool_call>{\"name\" \"f\"}</tool_call>";
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, missing_colon), missing_colon, {});
}

TEST(HermesToolCallTest, ParsesAValidCallAfterABadOne) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kHermes,
      "<tool_call>oops</tool_call>\n<tool_call>{\"name\": \"ok\", \"arguments\": {}}</tool_call>");
  ExpectMessage(m, "<tool_call>oops</tool_call>\n", {{"ok", "{}"}});
}

TEST(HermesToolCallTest, TreatsTextAfterACallAsContent) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kHermes,
      "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n\nDone, see above.");
  ExpectMessage(m, "Done, see above.", {{"a", "{}"}});
}

TEST(HermesToolCallTest, StartsTheNextCallWhenACloseMarkerIsMissing) {
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kHermes,
                                       "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n"
                                       "<tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>");
  ExpectMessage(m, "", {{"a", "{\"x\": 1}"}, {"b", "{}"}});
}

TEST(HermesToolCallTest, EndsACommittedCallAtBrokenJsonAndKeepsTheRestAsContent) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}}</tool_call>");
  ExpectMessage(m, "}</tool_call>", {{"f", "{\"a\": 1}"}});
}

TEST(HermesToolCallTest, FlushesAnUnfinishedCallWithANameAtFinish) {
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes,
                             "<tool_call>{\"name\": \"f\", \"arguments\": {\"city\": \"Par"),
                "", {{"f", "{\"city\": \"Par"}});
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\""), "", {{"f", "{}"}});
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": "), "",
                {{"f", "{}"}});
}

TEST(HermesToolCallTest, ReturnsAnUnfinishedCallWithoutANameAsContent) {
  for (const std::string text :
       {"<tool_call>", "<tool_call>\n{\"na", "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f",
        "Hi <tool_ca"}) {
    SCOPED_TRACE(text);
    ExpectMessage(ParseAllWays(ToolCallFormat::kHermes, text), text, {});
  }
}

TEST(HermesToolCallTest, KeepsAPartialCloseMarkerAtTheEndAsContent) {
  const ParsedMessage m =
      ParseAllWays(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": {}}\n</tool_");
  ExpectMessage(m, "</tool_", {{"f", "{}"}});
}

// --- Llama 3 JSON ---------------------------------------------------------------

TEST(Llama3JsonToolCallTest, ParsesACallWithParameters) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kLlama3Json, "\n {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}");
  ExpectMessage(m, "", {{"get_weather", "{\"city\": \"Paris\"}"}});
}

TEST(Llama3JsonToolCallTest, AcceptsPythonTagAndArgumentsKey) {
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kLlama3Json,
                                       "<|python_tag|>{\"name\": \"f\", \"arguments\": {\"x\": \"{;}\"}}");
  ExpectMessage(m, "", {{"f", "{\"x\": \"{;}\"}"}});
}

TEST(Llama3JsonToolCallTest, ParsesSeveralCallsSeparatedBySemicolons) {
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kLlama3Json,
                                       "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; "
                                       "{\"name\": \"b\", \"parameters\": {}};{\"name\": \"c\"};");
  ExpectMessage(m, "", {{"a", "{\"x\": 1}"}, {"b", "{}"}, {"c", "{}"}});
}

TEST(Llama3JsonToolCallTest, OutputNotStartingWithABraceIsContent) {
  const std::string text = "The call would be {\"name\": \"f\", \"parameters\": {}}";
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kLlama3Json, text);
  ExpectMessage(m, text, {});
  ToolCallParser parser(ToolCallFormat::kLlama3Json, kSeed);
  EXPECT_EQ(parser.Feed("  The").content, "  The");  // decided at the first letter, not held
}

TEST(Llama3JsonToolCallTest, JsonThatIsNotACallIsContent) {
  for (const std::string text :
       {"{\"result\": 5, \"items\": [1, 2]}", "{\"result\": 5} and more", "[1, 2, 3]", "<|python_tag|>print(1)",
        "   "}) {
    SCOPED_TRACE(text);
    ExpectMessage(ParseAllWays(ToolCallFormat::kLlama3Json, text), text, {});
  }
}

TEST(Llama3JsonToolCallTest, HoldsBackAPartialPythonTag) {
  ToolCallParser parser(ToolCallFormat::kLlama3Json, kSeed);
  EXPECT_TRUE(parser.Feed(" <|python").empty());
  ParsedOutput out = parser.Feed("_tag|>{\"name\": \"f\"");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "f");
  EXPECT_EQ(out.content, "");
}

TEST(Llama3JsonToolCallTest, TextAfterTheCallsIsContent) {
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kLlama3Json,
                                       "{\"name\": \"a\", \"parameters\": {}} I called it.");
  ExpectMessage(m, "I called it.", {{"a", "{}"}});
}

// --- Mistral ------------------------------------------------------------------

TEST(MistralToolCallTest, ParsesAnArrayOfCallsWithContentBefore) {
  const ParsedMessage m = ParseAllWays(
      ToolCallFormat::kMistral,
      "Checking both.[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, "
      "{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}, \"id\": \"abcdefghi\"}]");
  ExpectMessage(m, "Checking both.", {{"get_weather", "{\"city\": \"Paris\"}"}, {"get_time", "{\"tz\": \"CET\"}"}});
}

TEST(MistralToolCallTest, ParsesTheNameArgsFormRepeated) {
  const ParsedMessage m =
      ParseAllWays(ToolCallFormat::kMistral,
                   "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}"
                   "[TOOL_CALLS] get_time[ARGS] {\"tz\": \"[ARGS]\"}");
  ExpectMessage(m, "", {{"get_weather", "{\"city\": \"Paris\"}"}, {"get_time", "{\"tz\": \"[ARGS]\"}"}});
}

TEST(MistralToolCallTest, HoldsBackPartialMarkers) {
  ToolCallParser parser(ToolCallFormat::kMistral, kSeed);
  EXPECT_EQ(parser.Feed("ok [TOOL").content, "ok ");
  EXPECT_TRUE(parser.Feed("_CALLS]f[AR").empty());
  ParsedOutput out = parser.Feed("GS]{\"a\"");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "f");
  EXPECT_EQ(out.tool_calls[0].arguments, "{\"a\"");
}

TEST(MistralToolCallTest, ReturnsAnEmptyListAndBadCallsAsContent) {
  for (const std::string text : {"[TOOL_CALLS][]", "[TOOL_CALLS] [ ]", "[TOOL_CALLS] I will call a tool",
                                 "[TOOL_CALLS][{\"arguments\": {}}]", "[TOOL_CALLS][1]", "[TOOL_CALLS]",
                                 "[TOOL_CALLS]get_weather"}) {
    SCOPED_TRACE(text);
    ExpectMessage(ParseAllWays(ToolCallFormat::kMistral, text), text, {});
  }
}

TEST(MistralToolCallTest, KeepsGoodCallsBeforeABadElement) {
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kMistral,
                                       "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, {\"oops\": 1}]");
  ExpectMessage(m, "{\"oops\": 1}]", {{"a", "{}"}});
}

TEST(MistralToolCallTest, DropsArgumentsBufferedForAnObjectThatFailed) {
  const ParsedMessage m = ParseAllWays(ToolCallFormat::kMistral,
                                       "[TOOL_CALLS][{\"arguments\": {\"x\": 1}}] [TOOL_CALLS]f[ARGS]{\"y\": 2}");
  ExpectMessage(m, "[TOOL_CALLS][{\"arguments\": {\"x\": 1}}] ", {{"f", "{\"y\": 2}"}});
}

TEST(MistralToolCallTest, FlushesAnUnfinishedCallAtFinish) {
  ExpectMessage(ParseAllWays(ToolCallFormat::kMistral, "[TOOL_CALLS]f[ARGS]{\"a\": [1, 2"), "",
                {{"f", "{\"a\": [1, 2"}});
  ExpectMessage(ParseAllWays(ToolCallFormat::kMistral, "[TOOL_CALLS]f[ARGS]"), "", {{"f", "{}"}});
  ExpectMessage(ParseAllWays(ToolCallFormat::kMistral, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}},"), "",
                {{"a", "{}"}});
}

TEST(MistralToolCallTest, IdsAreNineDistinctAlphanumerics) {
  std::string text = "[TOOL_CALLS][";
  constexpr int kCalls = 300;
  for (int i = 0; i < kCalls; ++i) {
    if (i > 0) text += ", ";
    text += "{\"name\": \"f" + std::to_string(i) + "\", \"arguments\": {}}";
  }
  text += "]";
  const ParsedMessage m = ParseToolCalls(ToolCallFormat::kMistral, text, kSeed);
  ASSERT_EQ(m.calls.size(), static_cast<size_t>(kCalls));
  std::set<std::string> ids;
  for (const ToolCall& call : m.calls) {
    ASSERT_EQ(call.id.size(), 9u) << call.id;
    for (char c : call.id) EXPECT_TRUE(IsAlnum(c)) << call.id;
    ids.insert(call.id);
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(kCalls));
  const ParsedMessage other_seed = ParseToolCalls(ToolCallFormat::kMistral, text, kSeed + 1);
  const ParsedMessage same_seed = ParseToolCalls(ToolCallFormat::kMistral, text, kSeed);
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_NE(m.calls[i].id, other_seed.calls[i].id) << "call " << i;
    EXPECT_EQ(m.calls[i].id, same_seed.calls[i].id) << "call " << i;
  }
  // Not sequential-looking: consecutive ids differ in more than the last digit.
  EXPECT_NE(m.calls[0].id.substr(0, 8), m.calls[1].id.substr(0, 8));
}

// --- ids, none, misc ------------------------------------------------------------

TEST(ToolCallParserTest, IdsArePrefixedUniqueAndDependOnTheSeed) {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n";
  const ParsedMessage a = ParseToolCalls(ToolCallFormat::kHermes, text, 1);
  const ParsedMessage a_again = ParseToolCalls(ToolCallFormat::kHermes, text, 1);
  const ParsedMessage b = ParseToolCalls(ToolCallFormat::kHermes, text, 2);
  ASSERT_EQ(a.calls.size(), 50u);
  std::set<std::string> ids;
  for (size_t i = 0; i < a.calls.size(); ++i) {
    const std::string& id = a.calls[i].id;
    const std::string head = "call_" + std::to_string(i) + "_";
    ASSERT_EQ(id.substr(0, head.size()), head) << id;
    EXPECT_EQ(id.size(), head.size() + 16) << id;
    for (char c : id.substr(head.size())) EXPECT_TRUE(IsAlnum(c)) << id;
    EXPECT_EQ(id, a_again.calls[i].id) << "ids must be reproducible from the seed";
    EXPECT_NE(id, b.calls[i].id) << "different seeds must give different ids";
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), a.calls.size());

  const ParsedMessage custom = ParseToolCalls(
      ToolCallFormat::kLlama3Json, "{\"name\": \"f\", \"parameters\": {}}", 7, "chatcmpl-tool-");
  ASSERT_EQ(custom.calls.size(), 1u);
  EXPECT_EQ(custom.calls[0].id.substr(0, 16), "chatcmpl-tool-0_");
}

TEST(ToolCallParserTest, NoneFormatPassesEverythingThroughAsContent) {
  const std::string text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>[TOOL_CALLS]x[ARGS]{}";
  ExpectMessage(ParseAllWays(ToolCallFormat::kNone, text), text, {});
  ToolCallParser parser(ToolCallFormat::kNone, kSeed);
  EXPECT_EQ(parser.Feed("<tool_").content, "<tool_");  // nothing is held back
}

TEST(ToolCallParserTest, CoalescesOneCallIntoOneDeltaWhenFedWhole) {
  ToolCallParser parser(ToolCallFormat::kHermes, kSeed);
  ParsedOutput out = parser.Feed(
      "x<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": \"v\"}}</tool_call>"
      "<tool_call>{\"arguments\": [true], \"name\": \"b\"}</tool_call>");
  EXPECT_EQ(out.content, "x");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].index, 0);
  EXPECT_EQ(out.tool_calls[0].name, "a");
  EXPECT_EQ(out.tool_calls[0].arguments, "{\"k\": \"v\"}");
  EXPECT_EQ(out.tool_calls[1].index, 1);
  EXPECT_EQ(out.tool_calls[1].name, "b");
  EXPECT_EQ(out.tool_calls[1].arguments, "[true]");
  EXPECT_NE(out.tool_calls[0].id, out.tool_calls[1].id);
}

TEST(ToolCallParserTest, IgnoresInputAfterFinish) {
  ToolCallParser parser(ToolCallFormat::kHermes, kSeed);
  EXPECT_EQ(parser.Feed("a").content, "a");
  EXPECT_TRUE(parser.Finish().empty());
  EXPECT_TRUE(parser.Feed("<tool_call>{\"name\": \"f\"}</tool_call>").empty());
  EXPECT_TRUE(parser.Finish().empty());
  EXPECT_EQ(parser.num_calls(), 0);
}

// Every format over a mixed corpus: the merged result is the same whole, byte
// by byte and at random split points, and no text is lost when nothing parses.
TEST(ToolCallParserTest, ResultDoesNotDependOnFragmentation) {
  const std::vector<std::string> corpus = {
      "plain text with < and [ and { inside",
      "<tool_call>{\"name\": \"a\", \"arguments\": {\"s\": \"\\\\\\\"}\"}}</tool_call> tail <tool_call>{\"na",
      "{\"name\": \"a\", \"parameters\": {\"x\": [1, {\"y\": \"]}\"}]}}; {\"parameters\": 3, \"name\": \"b\"}",
      "pre [TOOL_CALLS][{\"name\": \"a\", \"arguments\": \"{}\"}] mid [TOOL_CALLS]b[ARGS]{\"z\": null} end",
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"</tool_call>\"}}\n</tool_call>\n<tool_call>bad",
      "[TOOL_CALLS]f[ARGS]123 [TOOL_CALLS][",
      "\n\n<|python_tag|>{\"name\": \"f\", \"arguments\": {}} trailing",
  };
  for (ToolCallFormat format : {ToolCallFormat::kNone, ToolCallFormat::kHermes, ToolCallFormat::kLlama3Json,
                                ToolCallFormat::kMistral}) {
    for (const std::string& text : corpus) {
      SCOPED_TRACE(::testing::Message() << ToolCallFormatName(format) << ": " << text);
      const ParsedMessage m = ParseAllWays(format, text);
      if (m.calls.empty()) {
        EXPECT_EQ(m.content, text);
      }
    }
  }
}

// Random texts built from marker pieces, JSON punctuation and fragments of
// both: every format must agree with itself under any split, and return the
// text verbatim when it finds no call.
TEST(ToolCallParserTest, RandomMarkerSoupDoesNotDependOnFragmentation) {
  const std::vector<std::string> atoms = {
      "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<tool_", "[TOOL", "{", "}",
      "[",           "]",            "\"name\"",      ": ",     "\"f\"",           "\"arguments\"", "\"parameters\"",
      ",",           ";",            "\"",            "\\",    " ",              "\n",           "x",     "12"};
  const uint32_t gtest_seed = static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
  for (uint32_t round = 0; round < 200; ++round) {
    const uint32_t seed = gtest_seed * 100000 + round;
    std::mt19937 rng(seed);
    std::uniform_int_distribution<size_t> pick(0, atoms.size() - 1);
    std::string text;
    const int n = std::uniform_int_distribution<int>(0, 40)(rng);
    for (int i = 0; i < n; ++i) text += atoms[pick(rng)];
    for (ToolCallFormat format : {ToolCallFormat::kHermes, ToolCallFormat::kLlama3Json, ToolCallFormat::kMistral}) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << ", " << ToolCallFormatName(format) << ": " << text);
      const ParsedMessage m = ParseAllWays(format, text);
      if (m.calls.empty()) {
        EXPECT_EQ(m.content, text);
      }
      if (::testing::Test::HasFailure()) return;  // one readable failure is enough
    }
  }
}

TEST(ToolCallParserTest, ParsesTheMixedCorpusAsExpected) {
  ExpectMessage(ParseAllWays(ToolCallFormat::kHermes,
                             "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"</tool_call>\"}}\n"
                             "</tool_call>\n<tool_call>bad"),
                "<tool_call>bad", {{"f", "{\"a\": \"</tool_call>\"}"}});
  ExpectMessage(ParseAllWays(ToolCallFormat::kMistral,
                             "pre [TOOL_CALLS][{\"name\": \"a\", \"arguments\": \"{}\"}] mid "
                             "[TOOL_CALLS]b[ARGS]{\"z\": null} end"),
                "pre mid end", {{"a", "\"{}\""}, {"b", "{\"z\": null}"}});
  ExpectMessage(ParseAllWays(ToolCallFormat::kMistral, "[TOOL_CALLS]f[ARGS]123 [TOOL_CALLS]["), "[TOOL_CALLS][",
                {{"f", "123"}});
  ExpectMessage(ParseAllWays(ToolCallFormat::kLlama3Json,
                             "{\"name\": \"a\", \"parameters\": {\"x\": [1, {\"y\": \"]}\"}]}}; "
                             "{\"parameters\": 3, \"name\": \"b\"}"),
                "", {{"a", "{\"x\": [1, {\"y\": \"]}\"}]}"}, {"b", "3"}});
}

}  // namespace
}  // namespace exl3serve::coordinator::http
