// constraint_mask_bench — structured output's per-token cost at the Qwen3
// vocabulary (151,936 ids): for JSON schemas, regexes, a grammar and a
// choice, real outputs are tokenized with the Qwen3 tokenizer and replayed
// through a TokenMatcher; each step times FillNextTokenMask + AcceptToken.
// Prints compile time, mask p50/p99/max per constraint, and two reference
// lines: the floor (one memset + popcount pass over a mask row) and the
// naive mask (a full vocabulary-trie walk from the same state, sampled).
//
//   build/tests/constraint_mask_bench [TOKENIZER_DIR] [--naive-steps N]
//
// TOKENIZER_DIR defaults to $EXL3_BUILD_DIR/demo-tokenizer, then
// build/demo-tokenizer (scripts/fetch-demo-tokenizer.sh).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/json_key_tracker.h"
#include "coordinator/constrained/mask_cache.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace cs = exl3serve::coordinator::constrained;
using exl3serve::coordinator::Tokenizer;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kModelVocab = 151936;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

struct Case {
  const char* name;
  cs::ConstraintSpec spec;
  std::vector<std::string> outputs;  // valid outputs to replay
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  cases.push_back({"json: flat object",
                   {.kind = cs::ConstraintKind::kJsonSchema,
                    .text = R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0,"maximum":150},"email":{"type":"string","format":"email"},"active":{"type":"boolean"},"role":{"enum":["admin","user","guest"]}},"required":["name","age","active","role"],"additionalProperties":false})"},
                   {R"({"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada@example.org", "active": true, "role": "admin"})",
                    R"({"name":"José Müller — Zürich 🇨🇭","age":7,"active":false,"role":"guest"})"}});
  cases.push_back({"json: nested + refs",
                   {.kind = cs::ConstraintKind::kJsonSchema,
                    .text = R"({"$defs":{"item":{"type":"object","properties":{"sku":{"type":"string","pattern":"^[A-Z]{3}-[0-9]{4}$"},"qty":{"type":"integer","minimum":1},"price":{"type":"number","minimum":0},"tags":{"type":"array","items":{"type":"string"},"maxItems":5}},"required":["sku","qty","price"]},"address":{"type":"object","properties":{"street":{"type":"string"},"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["street","city"]}},"type":"object","properties":{"order_id":{"type":"string","format":"uuid"},"created":{"type":"string","format":"date-time"},"customer":{"type":"object","properties":{"id":{"type":"integer"},"name":{"type":"string"},"shipping":{"$ref":"#/$defs/address"}},"required":["id","name"]},"items":{"type":"array","items":{"$ref":"#/$defs/item"},"minItems":1},"notes":{"anyOf":[{"type":"string"},{"type":"null"}]}},"required":["order_id","customer","items"]})"},
                   {R"({"order_id": "123e4567-e89b-12d3-a456-426614174000", "created": "2024-05-01T12:30:00Z", "customer": {"id": 42, "name": "Grace Hopper", "shipping": {"street": "1 Navy Way", "city": "Arlington", "zip": "22202"}}, "items": [{"sku": "ABC-1234", "qty": 2, "price": 19.99, "tags": ["red", "sale"]}, {"sku": "XYZ-0001", "qty": 1, "price": 5}], "notes": null})",
                    R"({"order_id":"00000000-0000-0000-0000-000000000000","customer":{"id":-1,"name":"\"quoted\" name\nwith newline"},"items":[{"sku":"QQQ-9999","qty":100,"price":0.5}],"notes":"leave at the door, please"})"}});
  cases.push_back({"json: any value ({})",
                   {.kind = cs::ConstraintKind::kJsonSchema, .text = "{}"},
                   {R"({"results": [{"id": 1, "score": 0.93, "label": "positive", "spans": [[0, 4], [10, 22]]}, {"id": 2, "score": -1.5e-3, "label": null, "meta": {"source": "web", "lang": "de", "ok": true}}], "count": 2})"}});
  // response_format json_object: free keys, so the unique-key filter works
  // at every key (json_key_tracker.h).
  cases.push_back({"json: json_object",
                   {.kind = cs::ConstraintKind::kJsonSchema, .text = R"({"type":"object"})"},
                   {R"({"answer": "Paris is the capital of France.", "confidence": 0.97, "sources": [{"title": "France", "url": "https://en.wikipedia.org/wiki/France"}, {"title": "Paris", "url": "https://en.wikipedia.org/wiki/Paris"}], "follow_up": ["What is the population of Paris?", "When was it founded?"], "metadata": {"model": "qwen3", "tokens": 412, "cached": false, "lang": "en"}, "id": "a1", "ok": true, "name": "capital", "names": ["Paris"]})"}});
  cases.push_back({"json: tool call",
                   {.kind = cs::ConstraintKind::kJsonSchema,
                    .text = R"({"type":"object","properties":{"name":{"const":"get_weather"},"arguments":{"type":"object","properties":{"location":{"type":"string","description":"City and country"},"unit":{"type":"string","enum":["celsius","fahrenheit"]},"days":{"type":"integer","minimum":1,"maximum":14}},"required":["location","unit"],"additionalProperties":false}},"required":["name","arguments"],"additionalProperties":false})"},
                   {R"({"name": "get_weather", "arguments": {"location": "San Francisco, USA", "unit": "fahrenheit", "days": 3}})"}});
  cases.push_back({"json: long free text",
                   {.kind = cs::ConstraintKind::kJsonSchema,
                    .text = R"({"type":"object","properties":{"title":{"type":"string"},"summary":{"type":"string"},"keywords":{"type":"array","items":{"type":"string"},"minItems":1,"maxItems":8}},"required":["title","summary","keywords"],"additionalProperties":false})"},
                   {R"({"title": "On the Masking of Tokens", "summary": "Structured output constrains a language model's sampling so that every generated text parses: a pushdown automaton over bytes follows the grammar, and each step the tokens whose bytes would leave the grammar are masked out before sampling. The cost per step must stay well below the forward pass, which at 32 streams is a few milliseconds; a per-position cache of context-independent tokens makes the common case (inside a string) a single bitmask copy.", "keywords": ["structured output", "grammar", "JSON Schema", "decoding"]})"}});
  cases.push_back({"regex: email",
                   {.kind = cs::ConstraintKind::kRegex, .text = R"([a-z0-9._%+-]{1,40}@[a-z0-9-]{1,30}(\.[a-z]{2,10}){1,3})"},
                   {"john.smith+news@mail-server.example.co.uk"}});
  cases.push_back({"regex: free sentence",
                   {.kind = cs::ConstraintKind::kRegex, .text = R"([A-Z][^\n]{10,400}[.!?])"},
                   {"The quick brown fox jumps over the lazy dog, and then it rests under the old oak tree for a while!"}});
  cases.push_back({"grammar: arithmetic",
                   {.kind = cs::ConstraintKind::kGrammar,
                    .text = "root ::= expr\nexpr ::= term ((\" + \" | \" - \") term)*\nterm ::= factor ((\" * \" | \" / \") factor)*\n"
                            "factor ::= [0-9]+ | \"(\" expr \")\"\n"},
                   {"(12 + 7) * 3 - 42 / (6 - 4) + (((1)))"}});
  cases.push_back({"choice: 4 labels",
                   {.kind = cs::ConstraintKind::kChoice, .choices = {"positive", "negative", "neutral", "mixed"}},
                   {"neutral"}});
  return cases;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int naive_steps = 12;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--naive-steps") == 0 && i + 1 < argc) {
      naive_steps = std::atoi(argv[++i]);
    } else {
      dir = argv[i];
    }
  }
  if (dir.empty()) {
    const char* b = std::getenv("EXL3_BUILD_DIR");
    dir = std::string(b != nullptr ? b : "build") + "/demo-tokenizer";
  }
  if (!std::filesystem::exists(dir + "/tokenizer.json")) {
    std::fprintf(stderr, "no tokenizer.json in %s (scripts/fetch-demo-tokenizer.sh)\n", dir.c_str());
    return 2;
  }
  auto tok = Tokenizer::Load(dir);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::vector<int32_t> eos;
  for (const char* t : {"<|im_end|>", "<|endoftext|>"}) {
    if (auto id = (*tok)->TokenToId(t)) eos.push_back(*id);
  }
  auto t0 = Clock::now();
  auto vocab = cs::TokenVocabulary::FromTokenizer(**tok, kModelVocab, eos);
  if (!vocab.ok()) {
    std::fprintf(stderr, "%s\n", vocab.status().ToString().c_str());
    return 1;
  }
  std::printf("vocabulary: %lld ids (tokenizer %d), trie %u nodes, built in %.0f ms\n",
              static_cast<long long>((*vocab)->size()), (*tok)->vocab_size(),
              cs::AsByteVocabulary(**vocab).trie().size(), Micros(Clock::now() - t0) / 1000);

  // Floor: one pass that clears and counts a mask row.
  std::vector<uint32_t> row((*vocab)->mask_words());
  std::vector<double> floor_us;
  for (int r = 0; r < 2000; ++r) {
    auto a = Clock::now();
    std::memset(row.data(), r & 1, row.size() * 4);
    int64_t bits = 0;
    for (uint32_t w : row) bits += __builtin_popcount(w);
    asm volatile("" : : "r"(bits) : "memory");
    floor_us.push_back(Micros(Clock::now() - a));
  }

  std::printf("\n%-24s %10s %11s %8s %8s %6s %9s %9s %9s %9s %11s\n", "constraint", "compile_ms", "eager/pos",
              "cold_p99", "cache_MB", "steps", "mask_p50", "mask_p99", "mask_max", "accept_p50", "naive_p50");
  std::printf("%-24s %10s %11s %8s %8s %6s %9s %9s %9s %9s %11s\n", "", "", "", "(us)", "", "", "(us)", "(us)", "(us)",
              "(us)", "(us)");
  bool ok = true;
  std::vector<double> all_mask;
  for (const Case& c : Cases()) {
    auto ct = Clock::now();
    auto compiled = cs::CompileConstraint(c.spec, *vocab);
    const double compile_ms = Micros(Clock::now() - ct) / 1000;
    if (!compiled.ok()) {
      std::printf("%-24s compile failed: %s\n", c.name, compiled.status().ToString().c_str());
      ok = false;
      continue;
    }
    const auto& gc = static_cast<const cs::GrammarConstraint&>(**compiled);
    const size_t eager = gc.cache().num_computed();
    std::vector<double> mask_us, accept_us, naive_us, cold_us;
    // Pass 0 (cold: entries past the eager budget are computed on first
    // use; checked against the naive walk), pass 1 (warm: the figures).
    for (int pass = 0; pass < 2; ++pass)
    for (const std::string& out : c.outputs) {
      std::vector<int32_t> ids = (*tok)->Encode(out);
      ids.push_back(eos.at(0));
      cs::TokenMatcher m(*compiled);
      std::vector<uint32_t> mask(m.mask_words());
      for (size_t step = 0; step < ids.size(); ++step) {
        auto a = Clock::now();
        m.FillNextTokenMask(mask);
        (pass == 0 ? cold_us : mask_us).push_back(Micros(Clock::now() - a));
        const int32_t id = ids[step];
        if (!((mask[id >> 5] >> (id & 31)) & 1)) {
          std::printf("%-24s step %zu: token %d (%s) not allowed\n", c.name, step, id,
                      std::string((*vocab)->token_bytes(id).value_or("<eos>")).c_str());
          ok = false;
          break;
        }
        if (pass == 0 && static_cast<int>(naive_us.size()) < naive_steps) {
          // The naive mask: every trie path walked from this state. Built
          // through a second matcher's state: replay the prefix.
          cs::NodeArena arena(false), scratch(false);
          std::vector<cs::Stack> state;
          gc.pda().Initial(arena, state);
          std::vector<cs::Stack> next;
          for (size_t k = 0; k < step; ++k) {
            for (char ch : std::string((*vocab)->token_bytes(ids[k]).value_or(""))) {
              gc.pda().Advance(state, static_cast<uint8_t>(ch), arena, next);
              state.swap(next);
            }
          }
          std::vector<uint32_t> naive(mask.size(), 0);
          cs::TrieWalkScratch walk;
          auto n0 = Clock::now();
          cs::MarkAcceptedTokens(gc.pda(), gc.bytes().trie(), state, scratch, walk, naive);
          naive_us.push_back(Micros(Clock::now() - n0));
          for (int32_t e : eos) {
            if (m.IsComplete()) naive[e >> 5] |= 1u << (e & 31);
          }
          if (c.spec.kind == cs::ConstraintKind::kJsonSchema) {
            // JSON Schema masks also drop tokens repeating an object key.
            cs::JsonKeyTracker keys;
            for (size_t k = 0; k < step; ++k) keys.Append((*vocab)->token_bytes(ids[k]).value_or(""));
            for (int32_t q : gc.quote_tokens().WithAtLeast(1)) {
              if (keys.WouldRepeatKey(*(*vocab)->token_bytes(q))) naive[q >> 5] &= ~(1u << (q & 31));
            }
          }
          if (naive != mask) {
            std::printf("%-24s step %zu: cached mask differs from the naive walk\n", c.name, step);
            ok = false;
          }
        }
        auto b = Clock::now();
        const absl::Status st = m.AcceptToken(id);
        if (pass == 1) accept_us.push_back(Micros(Clock::now() - b));
        if (!st.ok()) {
          std::printf("%-24s step %zu: %s\n", c.name, step, st.ToString().c_str());
          ok = false;
          break;
        }
      }
      if (!m.IsTerminated()) {
        std::printf("%-24s output did not end the constraint\n", c.name);
        ok = false;
      }
    }
    all_mask.insert(all_mask.end(), mask_us.begin(), mask_us.end());
    std::printf("%-24s %10.1f %5zu/%-5zu %8.1f %8.1f %6zu %9.1f %9.1f %9.1f %9.1f %11.0f\n", c.name, compile_ms,
                eager, gc.cache().stats().positions, Percentile(cold_us, 0.99),
                static_cast<double>(gc.cache().stats().memory_bytes) / 1e6, mask_us.size(),
                Percentile(mask_us, 0.5), Percentile(mask_us, 0.99),
                *std::max_element(mask_us.begin(), mask_us.end()), Percentile(accept_us, 0.5),
                Percentile(naive_us, 0.5));
  }
  std::printf("\nall steps: mask p50 %.1f us, p99 %.1f us, max %.1f us (%zu steps)\n", Percentile(all_mask, 0.5),
              Percentile(all_mask, 0.99), *std::max_element(all_mask.begin(), all_mask.end()), all_mask.size());
  std::printf("floor (memset + popcount of one %zu-word row): p50 %.2f us\n", row.size(), Percentile(floor_us, 0.5));
  std::printf("goal: mask p99 < 1000 us per token per sequence: %s\n",
              Percentile(all_mask, 0.99) < 1000 ? "met" : "NOT met");
  return ok ? 0 : 1;
}
