// coordinator/tokenizer/chat_template_value.h — the values of the chat
// template interpreter (chat_template.h), modelled on the Python objects
// jinja2 works with: None, bool, int, float, str, list/tuple, dict (insertion
// ordered), jinja's Undefined and namespace, and callables (global functions,
// bound methods, macros). Internal to exl3_tokenizer.
//
// Lists and dicts are shared by reference, as in Python; the interpreter only
// ever mutates namespaces (`{% set ns.x = ... %}`), as an immutable sandbox
// does. Strings are UTF-8 and are indexed, sliced and measured in code points.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_VALUE_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_VALUE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator::chat_template_internal {

class Value;

struct ListData {
  std::vector<Value> items;
  bool is_tuple = false;  // only changes how str() prints it
};

// Insertion-ordered string-keyed mapping (JSON objects, dict literals,
// namespaces, the loop object).
struct DictData {
  std::vector<std::pair<std::string, Value>> items;
  const Value* Find(std::string_view key) const;
  void Set(std::string key, Value value);
};

// Positional and keyword arguments of a call.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct CallableData {
  std::string name;  // for messages: "raise_exception", "str.split", ...
  std::function<absl::StatusOr<Value>(CallArgs&)> fn;
};

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable };

  Value() = default;  // Undefined
  static Value Undefined(std::string hint);  // hint: why it is undefined, for errors
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double f);
  static Value String(std::string s);
  static Value List(std::vector<Value> items, bool is_tuple = false);
  static Value Dict(std::shared_ptr<DictData> dict);
  static Value Namespace(std::shared_ptr<DictData> attrs);
  static Value Callable(std::string name, std::function<absl::StatusOr<Value>(CallArgs&)> fn);
  static Value FromJson(const nlohmann::ordered_json& json);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_mapping() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }

  bool boolean() const { return b_; }
  int64_t integer() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }
  double number() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(integer()); }
  const std::string& str() const { return s_; }  // string value, or the undefined hint
  const std::vector<Value>& list() const { return list_->items; }
  bool is_tuple() const { return list_->is_tuple; }
  const DictData& dict() const { return *dict_; }
  DictData& mutable_namespace() const { return *dict_; }
  const CallableData& callable() const { return *fn_; }

  // Python truthiness (Undefined is false).
  bool Truthy() const;
  // Python str(); Undefined prints as "".
  std::string ToStr() const;
  // Python repr().
  std::string Repr() const;
  // json.dumps(value, ensure_ascii=False, indent=indent) with indent < 0 for
  // None; `indent_text` overrides indent when set (a string indent).
  absl::StatusOr<std::string> ToJson(int indent, const std::string* indent_text = nullptr) const;
  // Python type name, for messages ("str", "NoneType", "dict", ...).
  std::string TypeName() const;
  // Python ==.
  bool Equals(const Value& other) const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<ListData> list_;
  std::shared_ptr<DictData> dict_;
  std::shared_ptr<const CallableData> fn_;
};

// Python float repr (shortest round-trip: 1.0, 0.1, 1e-05, 1e+16, inf, nan).
std::string PythonFloatRepr(double f);
// Python str.isspace() for one code point.
bool IsPythonSpace(char32_t c);
// Decodes UTF-8 (input is valid UTF-8: it came from JSON or the template).
std::u32string ToU32(std::string_view s);
std::string ToUtf8(std::u32string_view s);

}  // namespace exl3serve::coordinator::chat_template_internal

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_VALUE_H_
