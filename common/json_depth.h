// common/json_depth.h — how deep a JSON text nests, found without recursion,
// before any parser builds (or any code later copies, dumps or renders) a
// tree from it.
//
// Every untrusted JSON value (an HTTP body, a gRPC field that carries JSON
// text, a schema) is checked with FindJsonNestingBeyond(text, kMaxJsonDepth)
// first: nlohmann::json parses iteratively, but copying, dump() and the chat
// template's conversion recurse once per level, so a 160 KB value nested
// 20 000 deep would overflow a thread's stack. 256 is the schema compiler's
// limit too (4 x kMaxSchemaDepth).
//
// The scan is a single pass over bytes with a stack bounded by the limit; it
// does not validate (invalid JSON is the parser's to refuse) but counts
// brackets outside strings exactly as a parser would for valid JSON.
#ifndef EXL3SERVE_COMMON_JSON_DEPTH_H_
#define EXL3SERVE_COMMON_JSON_DEPTH_H_

#include <optional>
#include <string>
#include <string_view>

namespace exl3serve {

inline constexpr int kMaxJsonDepth = 256;

struct JsonDepthExcess {
  // Where the value first nests past the limit, as keys and indices from the
  // root ("chat_template_kwargs.a.a.a", "messages[0].content"); at most
  // kPathComponents components, then "...".
  std::string path;
  int depth = 0;  // the depth reached there: max_depth + 1
  static constexpr int kPathComponents = 8;
};

// Nothing when `text` nests at most `max_depth` arrays/objects deep (the root
// object is depth 1); otherwise where it goes deeper first.
std::optional<JsonDepthExcess> FindJsonNestingBeyond(std::string_view text, int max_depth = kMaxJsonDepth);

// `path` joined under `parent` as the error's field name: parent.path, or
// parent + "[0]..." for a path that starts with an index.
std::string JoinJsonPath(std::string_view parent, std::string_view path);

}  // namespace exl3serve

#endif  // EXL3SERVE_COMMON_JSON_DEPTH_H_
