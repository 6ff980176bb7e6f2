#include "common/json_depth.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"

namespace exl3serve {
namespace {

struct Frame {
  bool object = false;
  bool expect_key = false;  // objects: the next string is a key
  std::string key;          // objects: the member being read (raw, escapes kept)
  int64_t index = 0;        // arrays: the element being read
};

std::string PathOf(const std::vector<Frame>& stack) {
  std::string path;
  // stack[0] is the root container; each frame names the member or element
  // its child sits in, so the path of the innermost container has one
  // component per frame except the last.
  int components = 0;
  for (size_t i = 0; i + 1 < stack.size(); ++i) {
    if (components == JsonDepthExcess::kPathComponents) {
      path += "...";
      break;
    }
    const Frame& f = stack[i];
    if (f.object) {
      if (!path.empty()) path += '.';
      path += f.key.size() <= 64 ? f.key : f.key.substr(0, 64) + "...";
    } else {
      absl::StrAppend(&path, "[", f.index, "]");
    }
    ++components;
  }
  return path;
}

}  // namespace

std::optional<JsonDepthExcess> FindJsonNestingBeyond(std::string_view text, int max_depth) {
  std::vector<Frame> stack;
  bool in_string = false;
  bool escaped = false;
  bool string_is_key = false;
  std::string key;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
        if (string_is_key) stack.back().key = std::move(key);
        continue;
      }
      if (string_is_key && key.size() <= 64) key += c;
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        string_is_key = !stack.empty() && stack.back().object && stack.back().expect_key;
        if (string_is_key) {
          stack.back().expect_key = false;
          key.clear();
        }
        break;
      case '{':
      case '[':
        if (static_cast<int>(stack.size()) >= max_depth) {
          stack.push_back({});
          return JsonDepthExcess{PathOf(stack), static_cast<int>(stack.size())};
        }
        stack.push_back(Frame{c == '{', c == '{', "", 0});
        break;
      case '}':
      case ']':
        if (!stack.empty()) stack.pop_back();
        break;
      case ',':
        if (!stack.empty()) {
          if (stack.back().object) {
            stack.back().expect_key = true;
          } else {
            ++stack.back().index;
          }
        }
        break;
      default:
        break;
    }
  }
  return std::nullopt;
}

std::string JoinJsonPath(std::string_view parent, std::string_view path) {
  if (path.empty()) return std::string(parent);
  if (parent.empty()) return std::string(path);
  std::string out(parent);
  if (path.front() != '[') out += '.';
  out.append(path);
  return out;
}

}  // namespace exl3serve
