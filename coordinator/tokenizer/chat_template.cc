// The chat template interpreter: walks the syntax tree of
// chat_template_parser.h over chat_template_value.h values with jinja2's
// semantics (scoping, Undefined, filters, tests) and Python's (operators,
// string methods, str()).
#include "coordinator/tokenizer/chat_template.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/tokenizer/chat_template_parser.h"
#include "coordinator/tokenizer/chat_template_value.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "unicode/locid.h"
#include "unicode/unistr.h"

namespace exl3serve::coordinator {
namespace chat_template_internal {
namespace {

// The most output one render may produce; a template cannot loop forever
// (loops run over finite values) but `'x' * 10**12` could ask for anything.
constexpr size_t kMaxOutputBytes = size_t{256} << 20;
// The most statements and expressions one render may evaluate: nested loops
// over range() (each capped at 100000 items) could otherwise run for hours.
// Real templates take a few thousand steps per message.
constexpr int64_t kMaxRenderSteps = 5'000'000;

absl::Status StepBudgetError(int line) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "chat template line ", line, ": rendering took more than ", kMaxRenderSteps,
      " steps (the render step budget, kMaxRenderSteps); a template that loops this much is not a "
      "chat template"));
}

absl::Status RenderError(int line, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("chat template line ", line, ": ", absl::string_view(what.data(), what.size())));
}

// Python's str.upper/lower with full case mapping (ICU root locale).
std::string CaseMap(const std::string& s, bool upper) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  if (upper) {
    u.toUpper(icu::Locale::getRoot());
  } else {
    u.toLower(icu::Locale::getRoot());
  }
  std::string out;
  u.toUTF8String(out);
  return out;
}

std::string Strip(const std::string& s, const Value* chars, bool left, bool right) {
  const std::u32string u = ToU32(s);
  std::u32string set;
  const bool whitespace = chars == nullptr || chars->is_none() || chars->is_undefined();
  if (!whitespace) set = ToU32(chars->str());
  auto strip = [&](char32_t c) { return whitespace ? IsPythonSpace(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (left) {
    while (b < e && strip(u[b])) ++b;
  }
  if (right) {
    while (e > b && strip(u[e - 1])) --e;
  }
  return ToUtf8(std::u32string_view(u).substr(b, e - b));
}

// Python slice index normalisation (start/stop/step, any may be None).
std::vector<size_t> SliceIndices(int64_t n, const Value& start_v, const Value& stop_v, int64_t step) {
  auto norm = [&](const Value& v, int64_t dflt, bool is_start) -> int64_t {
    if (v.is_none() || v.is_undefined()) return dflt;
    int64_t i = std::clamp<int64_t>(v.integer(), -(int64_t{1} << 40), int64_t{1} << 40);
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    (void)is_start;
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  int64_t start = norm(start_v, step > 0 ? 0 : n - 1, true);
  int64_t stop = norm(stop_v, step > 0 ? n : -1, false);
  std::vector<size_t> out;
  if (step > 0) {
    for (int64_t i = start; i < stop; i += step) out.push_back(static_cast<size_t>(i));
  } else {
    for (int64_t i = start; i > stop; i += step) out.push_back(static_cast<size_t>(i));
  }
  return out;
}

struct Scope {
  absl::flat_hash_map<std::string, Value> vars;
  Scope* parent = nullptr;

  const Value* Find(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  absl::StatusOr<std::string> Run(const Program& program, Scope* globals) {
    std::string out;
    EXL3_ASSIGN_OR_RETURN(Flow flow, ExecBody(program.body, globals, &out));
    (void)flow;
    return out;
  }

 private:
  // ---------------------------------------------------------------- statements
  absl::StatusOr<Flow> ExecBody(const std::vector<Stmt>& body, Scope* scope, std::string* out) {
    for (const Stmt& s : body) {
      EXL3_ASSIGN_OR_RETURN(Flow flow, Exec(s, scope, out));
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  absl::Status Append(const std::string& text, int line, std::string* out) {
    if (out->size() + text.size() > kMaxOutputBytes) {
      return absl::ResourceExhaustedError(absl::StrCat("chat template line ", line, ": output passes ",
                                                       kMaxOutputBytes >> 20, " MiB"));
    }
    *out += text;
    return absl::OkStatus();
  }

  absl::StatusOr<Flow> Exec(const Stmt& s, Scope* scope, std::string* out) {
    if (++steps_ > kMaxRenderSteps) return StepBudgetError(s.line);
    switch (s.kind) {
      case Stmt::Kind::kText:
        EXL3_RETURN_IF_ERROR(Append(s.text, s.line, out));
        return Flow::kNormal;
      case Stmt::Kind::kOutput: {
        EXL3_ASSIGN_OR_RETURN(Value v, Eval(*s.expr, scope));
        EXL3_RETURN_IF_ERROR(Append(v.ToStr(), s.line, out));
        return Flow::kNormal;
      }
      case Stmt::Kind::kIf:
        for (const auto& [cond, body] : s.branches) {
          EXL3_ASSIGN_OR_RETURN(Value c, Eval(*cond, scope));
          if (c.Truthy()) return ExecBody(body, scope, out);
        }
        return ExecBody(s.else_body, scope, out);
      case Stmt::Kind::kFor:
        return ExecFor(s, scope, out);
      case Stmt::Kind::kSet: {
        EXL3_ASSIGN_OR_RETURN(Value v, Eval(*s.expr, scope));
        if (!s.attr.empty()) {
          const Value* ns = scope->Find(s.targets[0]);
          if (ns == nullptr || ns->kind() != Value::Kind::kNamespace) {
            return RenderError(s.line, "cannot assign attribute on non-namespace object");
          }
          ns->mutable_namespace().Set(s.attr, std::move(v));
          return Flow::kNormal;
        }
        return Assign(s.targets, std::move(v), s.line, scope);
      }
      case Stmt::Kind::kSetBlock: {
        std::string text;
        EXL3_ASSIGN_OR_RETURN(Flow flow, ExecBody(s.body, scope, &text));
        (void)flow;
        scope->vars[s.targets[0]] = Value::String(std::move(text));
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak:
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        return Flow::kContinue;
      case Stmt::Kind::kBlock:
        return ExecBody(s.body, scope, out);
      case Stmt::Kind::kMacro:
        scope->vars[s.text] = MakeMacro(s, scope);
        return Flow::kNormal;
    }
    return Flow::kNormal;
  }

  absl::StatusOr<Flow> Assign(const std::vector<std::string>& targets, Value v, int line, Scope* scope) {
    if (targets.size() == 1) {
      scope->vars[targets[0]] = std::move(v);
      return Flow::kNormal;
    }
    EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
    if (items.size() != targets.size()) {
      return RenderError(line, absl::StrCat("cannot unpack ", items.size(), " values into ", targets.size(), " names"));
    }
    for (size_t i = 0; i < targets.size(); ++i) scope->vars[targets[i]] = std::move(items[i]);
    return Flow::kNormal;
  }

  absl::StatusOr<std::vector<Value>> Iterate(const Value& v, int line) {
    switch (v.kind()) {
      case Value::Kind::kUndefined:
        return std::vector<Value>{};
      case Value::Kind::kList:
        return v.list();
      case Value::Kind::kDict: {
        std::vector<Value> keys;
        for (const auto& [k, item] : v.dict().items) keys.push_back(Value::String(k));
        return keys;
      }
      case Value::Kind::kString: {
        std::vector<Value> chars;
        for (char32_t c : ToU32(v.str())) chars.push_back(Value::String(ToUtf8(std::u32string_view(&c, 1))));
        return chars;
      }
      default:
        return RenderError(line, absl::StrCat("'", v.TypeName(), "' object is not iterable"));
    }
  }

  absl::StatusOr<Flow> ExecFor(const Stmt& s, Scope* scope, std::string* out) {
    EXL3_ASSIGN_OR_RETURN(Value seq, Eval(*s.expr, scope));
    EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(seq, s.line));
    if (s.condition != nullptr) {
      // The filter sees each item with the targets bound, before the loop counts it.
      std::vector<Value> kept;
      for (Value& item : items) {
        Scope filter_scope;
        filter_scope.parent = scope;
        EXL3_RETURN_IF_ERROR(Assign(s.targets, item, s.line, &filter_scope).status());
        EXL3_ASSIGN_OR_RETURN(Value keep, Eval(*s.condition, &filter_scope));
        if (keep.Truthy()) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      Scope else_scope;
      else_scope.parent = scope;
      EXL3_ASSIGN_OR_RETURN(Flow flow, ExecBody(s.else_body, &else_scope, out));
      (void)flow;
      return Flow::kNormal;
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      Scope body_scope;
      body_scope.parent = scope;
      auto loop = std::make_shared<DictData>();
      loop->items = {
          {"index0", Value::Int(i)},
          {"index", Value::Int(i + 1)},
          {"revindex0", Value::Int(n - i - 1)},
          {"revindex", Value::Int(n - i)},
          {"first", Value::Bool(i == 0)},
          {"last", Value::Bool(i == n - 1)},
          {"length", Value::Int(n)},
          {"depth", Value::Int(1)},
          {"depth0", Value::Int(0)},
          {"previtem", i > 0 ? items[i - 1] : Value::Undefined("there is no previous item")},
          {"nextitem", i + 1 < n ? items[i + 1] : Value::Undefined("there is no next item")},
      };
      loop->items.emplace_back(
          "cycle", Value::Callable("loop.cycle", [i](CallArgs& args) -> absl::StatusOr<Value> {
            if (args.positional.empty()) return absl::InvalidArgumentError("loop.cycle: no items given");
            return args.positional[static_cast<size_t>(i) % args.positional.size()];
          }));
      body_scope.vars["loop"] = Value::Dict(std::move(loop));
      EXL3_RETURN_IF_ERROR(Assign(s.targets, items[i], s.line, &body_scope).status());
      EXL3_ASSIGN_OR_RETURN(Flow flow, ExecBody(s.body, &body_scope, out));
      if (flow == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  Value MakeMacro(const Stmt& s, Scope* defining_scope) {
    const Stmt* macro = &s;
    return Value::Callable(s.text, [this, macro, defining_scope](CallArgs& args) -> absl::StatusOr<Value> {
      if (args.positional.size() > macro->targets.size()) {
        return RenderError(macro->line, absl::StrCat("macro '", macro->text, "' takes ", macro->targets.size(),
                                                     " arguments, got ", args.positional.size()));
      }
      Scope scope;
      scope.parent = defining_scope;
      for (size_t i = 0; i < macro->targets.size(); ++i) {
        if (i < args.positional.size()) {
          scope.vars[macro->targets[i]] = args.positional[i];
        } else if (macro->defaults[i] != nullptr) {
          EXL3_ASSIGN_OR_RETURN(scope.vars[macro->targets[i]], Eval(*macro->defaults[i], defining_scope));
        } else {
          scope.vars[macro->targets[i]] = Value::Undefined(absl::StrCat("'", macro->targets[i], "' is undefined"));
        }
      }
      for (auto& [name, value] : args.keyword) {
        if (std::find(macro->targets.begin(), macro->targets.end(), name) == macro->targets.end()) {
          return RenderError(macro->line, absl::StrCat("macro '", macro->text, "' has no parameter '", name, "'"));
        }
        scope.vars[name] = value;
      }
      if (++macro_depth_ > 64) {
        --macro_depth_;
        return RenderError(macro->line, "macro calls nested more than 64 deep");
      }
      std::string text;
      auto flow = ExecBody(macro->body, &scope, &text);
      --macro_depth_;
      if (!flow.ok()) return flow.status();
      return Value::String(std::move(text));
    });
  }

  // ---------------------------------------------------------------- expressions
  absl::Status UndefinedError(const Value& v, int line) {
    return RenderError(line, v.str().empty() ? "value is undefined" : v.str());
  }

  absl::StatusOr<Value> Eval(const Expr& e, Scope* scope) {
    if (++steps_ > kMaxRenderSteps) return StepBudgetError(e.line);
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName: {
        const Value* v = scope->Find(e.name);
        if (v == nullptr) return Value::Undefined(absl::StrCat("'", e.name, "' is undefined"));
        return *v;
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        for (const auto& a : e.args) {
          EXL3_ASSIGN_OR_RETURN(Value v, Eval(*a, scope));
          items.push_back(std::move(v));
        }
        return Value::List(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        auto dict = std::make_shared<DictData>();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          EXL3_ASSIGN_OR_RETURN(Value k, Eval(*e.args[i], scope));
          if (!k.is_string()) return RenderError(e.line, "dict literal keys must be strings here");
          EXL3_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i + 1], scope));
          dict->Set(k.str(), std::move(v));
        }
        return Value::Dict(std::move(dict));
      }
      case Expr::Kind::kAttr: {
        EXL3_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
        return GetAttr(obj, e.name, e.line);
      }
      case Expr::Kind::kItem: {
        EXL3_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
        EXL3_ASSIGN_OR_RETURN(Value key, Eval(*e.args[1], scope));
        return GetItem(obj, key, e.line);
      }
      case Expr::Kind::kSlice:
        return EvalSlice(e, scope);
      case Expr::Kind::kCall: {
        EXL3_ASSIGN_OR_RETURN(Value fn, Eval(*e.args[0], scope));
        EXL3_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, scope));
        if (fn.is_undefined()) return UndefinedError(fn, e.line);
        if (fn.kind() != Value::Kind::kCallable) {
          return RenderError(e.line, absl::StrCat("'", fn.TypeName(), "' object is not callable"));
        }
        auto result = fn.callable().fn(args);
        if (!result.ok() && result.status().message().find("chat template line") == std::string_view::npos &&
            fn.callable().name != "raise_exception") {
          return RenderError(e.line, std::string(result.status().message()));
        }
        return result;
      }
      case Expr::Kind::kFilter: {
        EXL3_ASSIGN_OR_RETURN(Value input, Eval(*e.args[0], scope));
        EXL3_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, scope));
        return ApplyFilter(e.name, std::move(input), args, e.line, scope);
      }
      case Expr::Kind::kTest: {
        EXL3_ASSIGN_OR_RETURN(Value input, Eval(*e.args[0], scope));
        EXL3_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, scope));
        EXL3_ASSIGN_OR_RETURN(bool r, ApplyTest(e.name, input, args, e.line));
        return Value::Bool(r != e.negated);
      }
      case Expr::Kind::kNot: {
        EXL3_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0], scope));
        return Value::Bool(!v.Truthy());
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        EXL3_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0], scope));
        if (v.is_undefined()) return UndefinedError(v, e.line);
        if (!v.is_number()) {
          return RenderError(e.line, absl::StrCat("bad operand type for unary ", e.kind == Expr::Kind::kNeg ? "-" : "+",
                                                  ": '", v.TypeName(), "'"));
        }
        if (e.kind == Expr::Kind::kPos) return v.kind() == Value::Kind::kBool ? Value::Int(v.integer()) : v;
        if (v.kind() == Value::Kind::kFloat) return Value::Float(-v.number());
        return CheckedInt('-', 0, v.integer(), e.line);
      }
      case Expr::Kind::kBinary: {
        EXL3_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0], scope));
        EXL3_ASSIGN_OR_RETURN(Value b, Eval(*e.args[1], scope));
        return BinaryOp(e.name, a, b, e.line);
      }
      case Expr::Kind::kCompare: {
        EXL3_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0], scope));
        for (size_t i = 0; i < e.ops.size(); ++i) {
          EXL3_ASSIGN_OR_RETURN(Value right, Eval(*e.args[i + 1], scope));
          EXL3_ASSIGN_OR_RETURN(bool r, Compare(e.ops[i], left, right, e.line));
          if (!r) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Expr::Kind::kAnd: {
        EXL3_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0], scope));
        if (!a.Truthy()) return a;
        return Eval(*e.args[1], scope);
      }
      case Expr::Kind::kOr: {
        EXL3_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0], scope));
        if (a.Truthy()) return a;
        return Eval(*e.args[1], scope);
      }
      case Expr::Kind::kCondition: {
        EXL3_ASSIGN_OR_RETURN(Value c, Eval(*e.args[1], scope));
        if (c.Truthy()) return Eval(*e.args[0], scope);
        if (e.args[2] == nullptr) return Value::Undefined("the inline if expression evaluated to false and no else section was defined");
        return Eval(*e.args[2], scope);
      }
    }
    return RenderError(e.line, "unknown expression");
  }

  absl::StatusOr<CallArgs> EvalArgs(const Expr& e, Scope* scope) {
    CallArgs args;
    for (size_t i = 1; i < e.args.size(); ++i) {
      EXL3_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i], scope));
      const std::string& kw = e.kwnames[i - 1];
      if (kw.empty()) {
        args.positional.push_back(std::move(v));
      } else {
        args.keyword.emplace_back(kw, std::move(v));
      }
    }
    return args;
  }

  absl::StatusOr<Value> EvalSlice(const Expr& e, Scope* scope) {
    EXL3_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
    Value parts[3] = {Value::None(), Value::None(), Value::None()};
    for (int i = 0; i < 3; ++i) {
      if (e.args[i + 1] == nullptr) continue;
      EXL3_ASSIGN_OR_RETURN(parts[i], Eval(*e.args[i + 1], scope));
      if (!parts[i].is_none() && !(parts[i].is_number() && parts[i].kind() != Value::Kind::kFloat)) {
        return RenderError(e.line, "slice indices must be integers or None");
      }
    }
    // Steps past +-2^40 step over any real sequence; clamping keeps the index arithmetic in range.
    const int64_t step = parts[2].is_none() ? 1 : std::clamp<int64_t>(parts[2].integer(), -(int64_t{1} << 40), int64_t{1} << 40);
    if (step == 0) return RenderError(e.line, "slice step cannot be zero");
    if (obj.is_undefined()) return UndefinedError(obj, e.line);
    if (obj.kind() == Value::Kind::kList) {
      std::vector<Value> out;
      for (size_t i : SliceIndices(static_cast<int64_t>(obj.list().size()), parts[0], parts[1], step)) out.push_back(obj.list()[i]);
      return Value::List(std::move(out), obj.is_tuple());
    }
    if (obj.is_string()) {
      const std::u32string u = ToU32(obj.str());
      std::u32string out;
      for (size_t i : SliceIndices(static_cast<int64_t>(u.size()), parts[0], parts[1], step)) out += u[i];
      return Value::String(ToUtf8(out));
    }
    return Value::Undefined(absl::StrCat("'", obj.TypeName(), " object' is not subscriptable"));
  }

  // jinja's description of a value's type in undefined-value messages.
  static std::string ObjectTypeRepr(const Value& v) {
    if (v.is_none()) return "None";
    return absl::StrCat(v.TypeName(), " object");
  }

  // jinja's getattr: the attribute (methods), then the item.
  absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined()) return UndefinedError(obj, line);
    if (auto method = Method(obj, name); method.has_value()) return *method;
    if (obj.is_mapping()) {
      if (const Value* v = obj.dict().Find(name)) return *v;
    }
    return Value::Undefined(absl::StrCat("'", ObjectTypeRepr(obj), "' has no attribute '", name, "'"));
  }

  // jinja's getitem: the item, then (string keys) the attribute.
  absl::StatusOr<Value> GetItem(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) return UndefinedError(obj, line);
    if (obj.kind() == Value::Kind::kDict && key.is_string()) {
      if (const Value* v = obj.dict().Find(key.str())) return *v;
    }
    if ((obj.kind() == Value::Kind::kList || obj.is_string()) && key.is_number() && key.kind() != Value::Kind::kFloat) {
      int64_t i = std::clamp<int64_t>(key.integer(), -(int64_t{1} << 40), int64_t{1} << 40);
      if (obj.kind() == Value::Kind::kList) {
        const int64_t n = static_cast<int64_t>(obj.list().size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return obj.list()[static_cast<size_t>(i)];
      } else {
        const std::u32string u = ToU32(obj.str());
        const int64_t n = static_cast<int64_t>(u.size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return Value::String(ToUtf8(std::u32string_view(&u[static_cast<size_t>(i)], 1)));
      }
      return Value::Undefined(absl::StrCat(ObjectTypeRepr(obj), " has no element ", key.integer()));
    }
    if (key.is_string()) return GetAttr(obj, key.str(), line);
    return Value::Undefined(absl::StrCat(ObjectTypeRepr(obj), " has no element ", key.Repr()));
  }

  static absl::Status ArgCount(const std::string& name, const CallArgs& args, size_t lo, size_t hi) {
    const size_t n = args.positional.size() + args.keyword.size();
    if (n < lo || n > hi) {
      return absl::InvalidArgumentError(absl::StrCat(name, "() takes ", lo == hi ? "" : absl::StrCat(lo, " to "), hi,
                                                     " arguments, got ", n));
    }
    return absl::OkStatus();
  }

  // The argument at `index` or named `name`, or null.
  static const Value* Arg(const CallArgs& args, size_t index, std::string_view name) {
    for (const auto& [k, v] : args.keyword) {
      if (k == name) return &v;
    }
    return index < args.positional.size() ? &args.positional[index] : nullptr;
  }

  static absl::StatusOr<std::string> StringArg(const CallArgs& args, size_t index, std::string_view name,
                                               const std::string& fn) {
    const Value* v = Arg(args, index, name);
    if (v == nullptr || !v->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(fn, "() argument ", index + 1, " must be str, not ",
                                                     v == nullptr ? "nothing" : v->TypeName()));
    }
    return v->str();
  }

  // Bound methods of str and dict that templates call.
  std::optional<Value> Method(const Value& obj, const std::string& name) {
    if (obj.is_string()) {
      const std::string s = obj.str();
      const std::string fn = "str." + name;
      if (name == "startswith" || name == "endswith") {
        const bool starts = name == "startswith";
        return Value::Callable(fn, [s, starts, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 1, 1));
          std::vector<Value> options;
          const Value& a = args.positional.empty() ? args.keyword[0].second : args.positional[0];
          if (a.kind() == Value::Kind::kList && a.is_tuple()) {
            options = a.list();
          } else {
            options.push_back(a);
          }
          for (const Value& o : options) {
            if (!o.is_string()) return absl::InvalidArgumentError(absl::StrCat(fn, " first arg must be str or a tuple of str, not ", o.TypeName()));
            if (starts ? std::string_view(s).starts_with(o.str()) : std::string_view(s).ends_with(o.str())) return Value::Bool(true);
          }
          return Value::Bool(false);
        });
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const bool left = name != "rstrip", right = name != "lstrip";
        return Value::Callable(fn, [s, left, right, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 0, 1));
          const Value* chars = Arg(args, 0, "chars");
          if (chars != nullptr && !chars->is_string() && !chars->is_none()) {
            return absl::InvalidArgumentError(absl::StrCat(fn, " arg must be None or str"));
          }
          return Value::String(Strip(s, chars, left, right));
        });
      }
      if (name == "split" || name == "rsplit") {
        const bool from_right = name == "rsplit";
        return Value::Callable(fn, [s, fn, from_right](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 0, 2));
          const Value* sep = Arg(args, 0, "sep");
          const Value* max_v = Arg(args, 1, "maxsplit");
          int64_t maxsplit = max_v != nullptr && max_v->is_number() ? max_v->integer() : -1;
          std::vector<Value> parts;
          if (sep == nullptr || sep->is_none()) {
            // Runs of whitespace, no empty strings.
            std::u32string u = ToU32(s);
            std::vector<std::u32string> words;
            size_t i = 0;
            while (i < u.size()) {
              while (i < u.size() && IsPythonSpace(u[i])) ++i;
              if (i >= u.size()) break;
              size_t j = i;
              while (j < u.size() && !IsPythonSpace(u[j])) ++j;
              words.push_back(u.substr(i, j - i));
              i = j;
            }
            if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
              return absl::UnimplementedError(absl::StrCat(fn, " with maxsplit and no separator is not supported"));
            }
            for (auto& w : words) parts.push_back(Value::String(ToUtf8(w)));
            return Value::List(std::move(parts));
          }
          if (!sep->is_string()) return absl::InvalidArgumentError(absl::StrCat(fn, "() sep must be str or None"));
          const std::string& d = sep->str();
          if (d.empty()) return absl::InvalidArgumentError("empty separator");
          std::vector<std::string> pieces;
          if (!from_right) {
            size_t start = 0;
            while (true) {
              const size_t p = s.find(d, start);
              if (p == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(pieces.size()) >= maxsplit)) break;
              pieces.push_back(s.substr(start, p - start));
              start = p + d.size();
            }
            pieces.push_back(s.substr(start));
          } else {
            size_t end = s.size();
            while (true) {
              if (end < d.size() || (maxsplit >= 0 && static_cast<int64_t>(pieces.size()) >= maxsplit)) break;
              const size_t p = s.rfind(d, end - d.size());
              if (p == std::string::npos) break;
              pieces.insert(pieces.begin(), s.substr(p + d.size(), end - p - d.size()));
              end = p;
            }
            pieces.insert(pieces.begin(), s.substr(0, end));
          }
          for (auto& p : pieces) parts.push_back(Value::String(std::move(p)));
          return Value::List(std::move(parts));
        });
      }
      if (name == "upper" || name == "lower") {
        const bool upper = name == "upper";
        return Value::Callable(fn, [s, upper, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 0, 0));
          return Value::String(CaseMap(s, upper));
        });
      }
      if (name == "replace") {
        return Value::Callable(fn, [s, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 2, 3));
          EXL3_ASSIGN_OR_RETURN(std::string from, StringArg(args, 0, "old", fn));
          EXL3_ASSIGN_OR_RETURN(std::string to, StringArg(args, 1, "new", fn));
          const Value* count_v = Arg(args, 2, "count");
          return Value::String(Replace(s, from, to, count_v != nullptr && count_v->is_number() ? count_v->integer() : -1));
        });
      }
      if (name == "find") {
        return Value::Callable(fn, [s, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 1, 1));
          EXL3_ASSIGN_OR_RETURN(std::string sub, StringArg(args, 0, "sub", fn));
          const size_t p = s.find(sub);
          if (p == std::string::npos) return Value::Int(-1);
          return Value::Int(static_cast<int64_t>(ToU32(std::string_view(s).substr(0, p)).size()));
        });
      }
      if (name == "join") {
        return Value::Callable(fn, [s, fn, this](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 1, 1));
          EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(args.positional.empty() ? args.keyword[0].second : args.positional[0], 0));
          std::string out;
          for (size_t i = 0; i < items.size(); ++i) {
            if (!items[i].is_string()) return absl::InvalidArgumentError(absl::StrCat("sequence item ", i, ": expected str instance, ", items[i].TypeName(), " found"));
            if (i > 0) out += s;
            out += items[i].str();
          }
          return Value::String(std::move(out));
        });
      }
      if (name == "title" || name == "capitalize") {
        const bool title = name == "title";
        return Value::Callable(fn, [s, title, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 0, 0));
          return Value::String(title ? TitleWords(s, /*python_str=*/true) : Capitalize(s));
        });
      }
      return std::nullopt;
    }
    if (obj.kind() == Value::Kind::kDict) {
      const Value self = obj;
      const std::string fn = "dict." + name;
      if (name == "items" || name == "keys" || name == "values") {
        const int which = name == "items" ? 0 : name == "keys" ? 1 : 2;
        return Value::Callable(fn, [self, which, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 0, 0));
          std::vector<Value> out;
          for (const auto& [k, v] : self.dict().items) {
            if (which == 0) {
              out.push_back(Value::List({Value::String(k), v}, /*is_tuple=*/true));
            } else {
              out.push_back(which == 1 ? Value::String(k) : v);
            }
          }
          return Value::List(std::move(out));
        });
      }
      if (name == "get") {
        return Value::Callable(fn, [self, fn](CallArgs& args) -> absl::StatusOr<Value> {
          EXL3_RETURN_IF_ERROR(ArgCount(fn, args, 1, 2));
          const Value* key = Arg(args, 0, "key");
          const Value* dflt = Arg(args, 1, "default");
          if (key != nullptr && key->is_string()) {
            if (const Value* v = self.dict().Find(key->str())) return *v;
          }
          return dflt != nullptr ? *dflt : Value::None();
        });
      }
    }
    return std::nullopt;
  }

  static std::string Replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
    if (from.empty()) {
      // Python inserts `to` between every character (and at both ends).
      std::string out;
      int64_t done = 0;
      const std::u32string u = ToU32(s);
      for (char32_t c : u) {
        if (count < 0 || done < count) {
          out += to;
          ++done;
        }
        out += ToUtf8(std::u32string_view(&c, 1));
      }
      if (count < 0 || done < count) out += to;
      return out;
    }
    std::string out;
    size_t start = 0;
    int64_t done = 0;
    while (count < 0 || done < count) {
      const size_t p = s.find(from, start);
      if (p == std::string::npos) break;
      out += s.substr(start, p - start) + to;
      start = p + from.size();
      ++done;
    }
    return out + s.substr(start);
  }

  static std::string Capitalize(const std::string& s) {
    const std::u32string u = ToU32(s);
    if (u.empty()) return s;
    return CaseMap(ToUtf8(u.substr(0, 1)), true) + CaseMap(ToUtf8(u.substr(1)), false);
  }

  // python_str: str.title() (words are runs of letters); otherwise jinja's
  // title filter (words start after spaces, '-', '(', '{', '[' or '<').
  static std::string TitleWords(const std::string& s, bool python_str) {
    const std::u32string u = ToU32(s);
    std::string out;
    bool word_start = true;
    for (char32_t c : u) {
      const std::string ch = ToUtf8(std::u32string_view(&c, 1));
      const bool letter = CaseMap(ch, true) != CaseMap(ch, false);
      const bool boundary = python_str ? !letter : (IsPythonSpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<');
      out += boundary ? ch : CaseMap(ch, word_start);
      if (python_str) {
        word_start = !letter;
      } else {
        word_start = boundary;
      }
    }
    return out;
  }

  // ---------------------------------------------------------------- operators
  static std::string OperandError(const std::string& op, const Value& a, const Value& b) {
    return absl::StrCat("unsupported operand type(s) for ", op, ": '", a.TypeName(), "' and '", b.TypeName(), "'");
  }

  // 64-bit integer arithmetic; Python's integers do not overflow, so an
  // overflow is an error rather than a wrong number.
  static absl::StatusOr<Value> CheckedInt(char op, int64_t x, int64_t y, int line) {
    int64_t r;
    const bool overflow = op == '+' ? __builtin_add_overflow(x, y, &r)
                          : op == '-' ? __builtin_sub_overflow(x, y, &r)
                                      : __builtin_mul_overflow(x, y, &r);
    if (overflow) return RenderError(line, "integer overflow (values beyond 64 bits are not supported)");
    return Value::Int(r);
  }

  absl::StatusOr<Value> BinaryOp(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "~") {
      std::string s = a.ToStr() + b.ToStr();
      if (s.size() > kMaxOutputBytes) return absl::ResourceExhaustedError("chat template: string too long");
      return Value::String(std::move(s));
    }
    if (a.is_undefined()) return UndefinedError(a, line);
    if (b.is_undefined()) return UndefinedError(b, line);
    const bool numbers = a.is_number() && b.is_number();
    const bool floats = numbers && (a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat);
    if (op == "+") {
      if (numbers) return floats ? Value::Float(a.number() + b.number()) : CheckedInt('+', a.integer(), b.integer(), line);
      if (a.is_string() && b.is_string()) {
        if (a.str().size() + b.str().size() > kMaxOutputBytes) return absl::ResourceExhaustedError("chat template: string too long");
        return Value::String(a.str() + b.str());
      }
      if (a.kind() == Value::Kind::kList && b.kind() == Value::Kind::kList && a.is_tuple() == b.is_tuple()) {
        std::vector<Value> items = a.list();
        items.insert(items.end(), b.list().begin(), b.list().end());
        return Value::List(std::move(items), a.is_tuple());
      }
      if (a.is_string()) return RenderError(line, absl::StrCat("can only concatenate str (not \"", b.TypeName(), "\") to str"));
      return RenderError(line, OperandError(op, a, b));
    }
    if (op == "*" && (a.is_string() || a.kind() == Value::Kind::kList || b.is_string() || b.kind() == Value::Kind::kList)) {
      const Value& seq = a.is_number() ? b : a;
      const Value& count = a.is_number() ? a : b;
      if (!count.is_number() || count.kind() == Value::Kind::kFloat) return RenderError(line, OperandError(op, a, b));
      const int64_t n = std::max<int64_t>(0, count.integer());
      const size_t unit = seq.is_string() ? seq.str().size() : seq.list().size() * 16;
      if (unit != 0 && static_cast<uint64_t>(n) > kMaxOutputBytes / unit) return absl::ResourceExhaustedError("chat template: repetition too long");
      if (seq.is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq.str();
        return Value::String(std::move(out));
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < n; ++i) items.insert(items.end(), seq.list().begin(), seq.list().end());
      return Value::List(std::move(items), seq.is_tuple());
    }
    if (!numbers) {
      if (op == "%" && a.is_string()) return RenderError(line, "printf-style string formatting ('...' % x) is not supported");
      return RenderError(line, OperandError(op, a, b));
    }
    if (op == "-") return floats ? Value::Float(a.number() - b.number()) : CheckedInt('-', a.integer(), b.integer(), line);
    if (op == "*") return floats ? Value::Float(a.number() * b.number()) : CheckedInt('*', a.integer(), b.integer(), line);
    if (op == "/") {
      if (b.number() == 0) return RenderError(line, "division by zero");
      return Value::Float(a.number() / b.number());
    }
    if (op == "//" || op == "%") {
      if (b.number() == 0) return RenderError(line, op == "%" ? "modulo by zero" : "integer division or modulo by zero");
      if (floats) {
        const double x = a.number(), y = b.number();
        double m = std::fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        if (op == "%") return Value::Float(m);
        return Value::Float(std::floor((x - m) / y + 0.5));
      }
      const int64_t x = a.integer(), y = b.integer();
      if (x == INT64_MIN && y == -1) return RenderError(line, "integer overflow (values beyond 64 bits are not supported)");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        m += y;
        --q;
      }
      return op == "%" ? Value::Int(m) : Value::Int(q);
    }
    if (op == "**") {
      if (!floats && b.integer() >= 0) {
        Value r = Value::Int(1);
        for (int64_t i = 0; i < b.integer(); ++i) {
          EXL3_ASSIGN_OR_RETURN(r, CheckedInt('*', r.integer(), a.integer(), line));
          if (r.integer() == 0 || r.integer() == 1) break;
        }
        return r;
      }
      return Value::Float(std::pow(a.number(), b.number()));
    }
    return RenderError(line, absl::StrCat("unknown operator ", op));
  }

  absl::StatusOr<bool> Compare(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return a.Equals(b);
    if (op == "!=") return !a.Equals(b);
    if (op == "in" || op == "not in") {
      EXL3_ASSIGN_OR_RETURN(bool in, Contains(b, a, line));
      return in == (op == "in");
    }
    if (a.is_undefined()) return UndefinedError(a, line);
    if (b.is_undefined()) return UndefinedError(b, line);
    int c;
    if (a.is_number() && b.is_number()) {
      c = a.number() < b.number() ? -1 : a.number() > b.number() ? 1 : 0;
    } else if (a.is_string() && b.is_string()) {
      c = a.str().compare(b.str());  // UTF-8 byte order is code point order
    } else {
      return RenderError(line, absl::StrCat("'", op, "' not supported between instances of '", a.TypeName(), "' and '",
                                            b.TypeName(), "'"));
    }
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  absl::StatusOr<bool> Contains(const Value& container, const Value& item, int line) {
    switch (container.kind()) {
      case Value::Kind::kUndefined:
        return false;
      case Value::Kind::kString:
        if (!item.is_string()) {
          return RenderError(line, absl::StrCat("'in <string>' requires string as left operand, not ", item.TypeName()));
        }
        return container.str().find(item.str()) != std::string::npos;
      case Value::Kind::kList:
        for (const Value& v : container.list()) {
          if (v.Equals(item)) return true;
        }
        return false;
      case Value::Kind::kDict:
        return item.is_string() && container.dict().Find(item.str()) != nullptr;
      default:
        return RenderError(line, absl::StrCat("argument of type '", container.TypeName(), "' is not iterable"));
    }
  }

  // ---------------------------------------------------------------- tests
  absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v, const CallArgs& args, int line) {
    const Value* arg = Arg(args, 0, "");
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.kind() == Value::Kind::kDict;
    if (name == "boolean") return v.kind() == Value::Kind::kBool;
    if (name == "false") return v.kind() == Value::Kind::kBool && !v.boolean();
    if (name == "true") return v.kind() == Value::Kind::kBool && v.boolean();
    if (name == "integer") return v.kind() == Value::Kind::kInt;
    if (name == "float") return v.kind() == Value::Kind::kFloat;
    if (name == "number") return v.is_number();
    if (name == "iterable") {
      return v.is_undefined() || v.is_string() || v.kind() == Value::Kind::kList || v.kind() == Value::Kind::kDict;
    }
    if (name == "sequence") {
      return v.is_undefined() || v.is_string() || v.kind() == Value::Kind::kList || v.kind() == Value::Kind::kDict;
    }
    if (name == "callable") return v.kind() == Value::Kind::kCallable;
    if (name == "lower" || name == "upper") {
      return v.is_string() && CaseMap(v.str(), name == "upper") == v.str();
    }
    if (name == "even" || name == "odd" || name == "divisibleby") {
      if (!v.is_number() || v.kind() == Value::Kind::kFloat) return RenderError(line, absl::StrCat("test '", name, "' needs an integer"));
      if (name == "divisibleby") {
        if (arg == nullptr || !arg->is_number() || arg->integer() == 0) return RenderError(line, "divisibleby needs a non-zero integer");
        return v.integer() % arg->integer() == 0;
      }
      return (v.integer() % 2 == 0) == (name == "even");
    }
    static const std::pair<const char*, const char*> kCompareTests[] = {
        {"eq", "=="}, {"equalto", "=="}, {"==", "=="}, {"ne", "!="}, {"!=", "!="}, {"lt", "<"}, {"lessthan", "<"},
        {"<", "<"}, {"le", "<="}, {"<=", "<="}, {"gt", ">"}, {"greaterthan", ">"}, {">", ">"}, {"ge", ">="}, {">=", ">="}};
    for (const auto& [test, op] : kCompareTests) {
      if (name == test) {
        if (arg == nullptr) return RenderError(line, absl::StrCat("test '", name, "' needs an argument"));
        return Compare(op, v, *arg, line);
      }
    }
    if (name == "in") {
      if (arg == nullptr) return RenderError(line, "test 'in' needs an argument");
      return Contains(*arg, v, line);
    }
    if (name == "sameas") {
      if (arg == nullptr) return RenderError(line, "test 'sameas' needs an argument");
      if (v.kind() != arg->kind()) return false;
      if (v.is_none() || v.is_undefined()) return true;
      if (v.kind() == Value::Kind::kBool) return v.boolean() == arg->boolean();
      return v.Equals(*arg);
    }
    return RenderError(line, absl::StrCat("test '", name, "' is not supported by this chat template interpreter"));
  }

  // ---------------------------------------------------------------- filters
  absl::StatusOr<Value> ApplyFilter(const std::string& name, Value v, const CallArgs& args, int line, Scope* scope) {
    auto need_string = [&](const Value& x) -> absl::StatusOr<std::string> {
      if (x.is_undefined()) return std::string();
      return x.ToStr();
    };
    if (name == "trim") {
      EXL3_ASSIGN_OR_RETURN(std::string s, need_string(v));
      return Value::String(Strip(s, Arg(args, 0, "chars"), true, true));
    }
    if (name == "length" || name == "count") {
      switch (v.kind()) {
        case Value::Kind::kUndefined: return Value::Int(0);
        case Value::Kind::kString: return Value::Int(static_cast<int64_t>(ToU32(v.str()).size()));
        case Value::Kind::kList: return Value::Int(static_cast<int64_t>(v.list().size()));
        case Value::Kind::kDict: return Value::Int(static_cast<int64_t>(v.dict().items.size()));
        default: return RenderError(line, absl::StrCat("object of type '", v.TypeName(), "' has no len()"));
      }
    }
    if (name == "tojson") {
      const Value* indent = Arg(args, 0, "indent");
      for (const auto& [k, kv] : args.keyword) {
        if (k != "indent" && !(k == "ensure_ascii" && !kv.Truthy()) && !(k == "sort_keys" && !kv.Truthy()) &&
            !(k == "separators" && kv.is_none())) {
          return RenderError(line, absl::StrCat("tojson: argument '", k, "' is not supported"));
        }
      }
      absl::StatusOr<std::string> json;
      if (indent == nullptr || indent->is_none()) {
        json = v.ToJson(-1);
      } else if (indent->is_string()) {
        json = v.ToJson(0, &indent->str());
      } else if (indent->is_number() && indent->kind() != Value::Kind::kFloat) {
        json = v.ToJson(static_cast<int>(std::clamp<int64_t>(indent->integer(), 0, 64)));
      } else {
        return RenderError(line, "tojson: indent must be an integer, a string or None");
      }
      if (!json.ok()) return RenderError(line, v.is_undefined() ? v.str() : std::string(json.status().message()));
      return Value::String(*std::move(json));
    }
    if (name == "string") return Value::String(v.ToStr());
    if (name == "lower" || name == "upper") {
      EXL3_ASSIGN_OR_RETURN(std::string s, need_string(v));
      return Value::String(CaseMap(s, name == "upper"));
    }
    if (name == "capitalize") {
      EXL3_ASSIGN_OR_RETURN(std::string s, need_string(v));
      return Value::String(Capitalize(s));
    }
    if (name == "title") {
      EXL3_ASSIGN_OR_RETURN(std::string s, need_string(v));
      return Value::String(TitleWords(s, /*python_str=*/false));
    }
    if (name == "default" || name == "d") {
      const Value* dflt = Arg(args, 0, "default_value");
      const Value* boolean = Arg(args, 1, "boolean");
      const bool use_default = v.is_undefined() || (boolean != nullptr && boolean->Truthy() && !v.Truthy());
      if (use_default) return dflt != nullptr ? *dflt : Value::String("");
      return v;
    }
    if (name == "first" || name == "last") {
      if (v.kind() == Value::Kind::kList && v.list().empty()) return Value::Undefined("no first item, sequence was empty");
      EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
      if (items.empty()) return Value::Undefined(absl::StrCat("no ", name, " item, sequence was empty"));
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") {
      EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
      return Value::List(std::move(items));
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::u32string u = ToU32(v.str());
        std::reverse(u.begin(), u.end());
        return Value::String(ToUtf8(u));
      }
      EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
      std::reverse(items.begin(), items.end());
      return Value::List(std::move(items));
    }
    if (name == "join") {
      EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
      const Value* sep = Arg(args, 0, "d");
      const Value* attribute = Arg(args, 1, "attribute");
      std::string out;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0 && sep != nullptr) out += sep->ToStr();
        Value item = items[i];
        if (attribute != nullptr) {
          EXL3_ASSIGN_OR_RETURN(item, GetItem(item, *attribute, line));
        }
        out += item.ToStr();
      }
      return Value::String(std::move(out));
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::List({});
      if (v.kind() != Value::Kind::kDict) return RenderError(line, "can only get item pairs from a mapping");
      std::vector<Value> out;
      for (const auto& [k, item] : v.dict().items) out.push_back(Value::List({Value::String(k), item}, true));
      return Value::List(std::move(out));
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep_if = name == "selectattr" || name == "select";
      EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
      CallArgs test_args;
      size_t first_test_arg = by_attr ? 2 : 1;
      const Value* attr = by_attr ? Arg(args, 0, "") : nullptr;
      if (by_attr && (attr == nullptr || !attr->is_string())) return RenderError(line, absl::StrCat(name, " needs an attribute name"));
      const Value* test = Arg(args, by_attr ? 1 : 0, "");
      for (size_t i = first_test_arg; i < args.positional.size(); ++i) test_args.positional.push_back(args.positional[i]);
      std::vector<Value> out;
      for (const Value& item : items) {
        Value subject = item;
        if (by_attr) {
          // Dotted attribute paths ("function.name").
          size_t start = 0;
          const std::string& path = attr->str();
          while (true) {
            const size_t dot = path.find('.', start);
            const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
            EXL3_ASSIGN_OR_RETURN(subject, GetItem(subject, Value::String(part), line));
            if (dot == std::string::npos) break;
            start = dot + 1;
          }
        }
        bool r;
        if (test == nullptr) {
          r = subject.Truthy();
        } else {
          if (!test->is_string()) return RenderError(line, absl::StrCat(name, ": the test must be given by name"));
          EXL3_ASSIGN_OR_RETURN(r, ApplyTest(test->str(), subject, test_args, line));
        }
        if (r == keep_if) out.push_back(item);
      }
      return Value::List(std::move(out));
    }
    if (name == "map") {
      EXL3_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v, line));
      const Value* attribute = Arg(args, 99, "attribute");
      std::vector<Value> out;
      if (attribute != nullptr) {
        const Value* dflt = Arg(args, 99, "default");
        for (const Value& item : items) {
          EXL3_ASSIGN_OR_RETURN(Value x, GetItem(item, *attribute, line));
          if (x.is_undefined() && dflt != nullptr) x = *dflt;
          out.push_back(std::move(x));
        }
        return Value::List(std::move(out));
      }
      if (args.positional.empty() || !args.positional[0].is_string()) return RenderError(line, "map needs a filter name or attribute=");
      CallArgs rest;
      rest.positional.assign(args.positional.begin() + 1, args.positional.end());
      rest.keyword = args.keyword;
      for (const Value& item : items) {
        EXL3_ASSIGN_OR_RETURN(Value x, ApplyFilter(args.positional[0].str(), item, rest, line, scope));
        out.push_back(std::move(x));
      }
      return Value::List(std::move(out));
    }
    if (name == "replace") {
      EXL3_ASSIGN_OR_RETURN(std::string s, need_string(v));
      const Value* from = Arg(args, 0, "old");
      const Value* to = Arg(args, 1, "new");
      const Value* count = Arg(args, 2, "count");
      if (from == nullptr || to == nullptr) return RenderError(line, "replace needs old and new");
      return Value::String(Replace(s, from->ToStr(), to->ToStr(), count != nullptr && count->is_number() ? count->integer() : -1));
    }
    if (name == "int") {
      if (v.is_number()) return Value::Int(v.kind() == Value::Kind::kFloat ? static_cast<int64_t>(v.number()) : v.integer());
      const Value* dflt = Arg(args, 0, "default");
      if (v.is_string()) {
        const std::string t = Strip(v.str(), nullptr, true, true);
        char* end = nullptr;
        const long long i = std::strtoll(t.c_str(), &end, 10);
        if (!t.empty() && end != nullptr && *end == '\0') return Value::Int(i);
      }
      return dflt != nullptr ? *dflt : Value::Int(0);
    }
    if (name == "float") {
      if (v.is_number()) return Value::Float(v.number());
      if (v.is_string()) {
        const std::string t = Strip(v.str(), nullptr, true, true);
        char* end = nullptr;
        const double f = std::strtod(t.c_str(), &end);
        if (!t.empty() && end != nullptr && *end == '\0') return Value::Float(f);
      }
      const Value* dflt = Arg(args, 0, "default");
      return dflt != nullptr ? *dflt : Value::Float(0);
    }
    if (name == "abs") {
      if (!v.is_number()) return RenderError(line, absl::StrCat("bad operand type for abs(): '", v.TypeName(), "'"));
      return v.kind() == Value::Kind::kFloat ? Value::Float(std::fabs(v.number())) : Value::Int(std::abs(v.integer()));
    }
    if (name == "round") {
      if (!v.is_number()) return RenderError(line, "round needs a number");
      const Value* precision = Arg(args, 0, "precision");
      const int p = precision != nullptr && precision->is_number() ? static_cast<int>(precision->integer()) : 0;
      const double scale = std::pow(10.0, p);
      return Value::Float(std::round(v.number() * scale) / scale);
    }
    if (name == "indent") {
      EXL3_ASSIGN_OR_RETURN(std::string s, need_string(v));
      const Value* width = Arg(args, 0, "width");
      const Value* first = Arg(args, 1, "first");
      const Value* blank = Arg(args, 2, "blank");
      const std::string pad = width == nullptr ? std::string(4, ' ')
                              : width->is_string() ? width->str()
                                                    : std::string(static_cast<size_t>(std::clamp<int64_t>(width->integer(), 0, 256)), ' ');
      std::vector<std::string> lines;
      size_t start = 0;
      while (true) {
        const size_t nl = s.find('\n', start);
        lines.push_back(s.substr(start, nl == std::string::npos ? std::string::npos : nl - start));
        if (nl == std::string::npos) break;
        start = nl + 1;
      }
      std::string out;
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i > 0) out += '\n';
        const bool indent_line = (i > 0 || (first != nullptr && first->Truthy())) &&
                                 (!lines[i].empty() || (blank != nullptr && blank->Truthy()));
        if (indent_line) out += pad;
        out += lines[i];
      }
      return Value::String(std::move(out));
    }
    if (name == "safe") return v;
    if (name == "e" || name == "escape") {
      EXL3_ASSIGN_OR_RETURN(std::string s, need_string(v));
      std::string out;
      for (char c : s) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value::String(std::move(out));
    }
    return RenderError(line, absl::StrCat("filter '", name, "' is not supported by this chat template interpreter"));
  }

  int macro_depth_ = 0;
  int64_t steps_ = 0;  // statements + expressions evaluated (kMaxRenderSteps)
};

void AddGlobals(Scope* globals) {
  globals->vars["raise_exception"] = Value::Callable("raise_exception", [](CallArgs& args) -> absl::StatusOr<Value> {
    const std::string message = args.positional.empty() ? std::string() : args.positional[0].ToStr();
    return absl::InvalidArgumentError(message);
  });
  globals->vars["strftime_now"] = Value::Callable("strftime_now", [](CallArgs& args) -> absl::StatusOr<Value> {
    if (args.positional.empty() || !args.positional[0].is_string()) {
      return absl::InvalidArgumentError("strftime_now() needs a format string");
    }
    const std::time_t now = std::time(nullptr);
    std::tm local;
    localtime_r(&now, &local);
    char buf[512];
    const size_t n = std::strftime(buf, sizeof(buf), args.positional[0].str().c_str(), &local);
    return Value::String(std::string(buf, n));
  });
  globals->vars["namespace"] = Value::Callable("namespace", [](CallArgs& args) -> absl::StatusOr<Value> {
    auto attrs = std::make_shared<DictData>();
    for (const Value& p : args.positional) {
      if (p.kind() != Value::Kind::kDict) return absl::InvalidArgumentError("namespace() takes keyword arguments or a dict");
      for (const auto& [k, v] : p.dict().items) attrs->Set(k, v);
    }
    for (const auto& [k, v] : args.keyword) attrs->Set(k, v);
    return Value::Namespace(std::move(attrs));
  });
  globals->vars["dict"] = Value::Callable("dict", [](CallArgs& args) -> absl::StatusOr<Value> {
    auto d = std::make_shared<DictData>();
    for (const Value& p : args.positional) {
      if (p.kind() != Value::Kind::kDict) return absl::InvalidArgumentError("dict() takes keyword arguments or a dict");
      for (const auto& [k, v] : p.dict().items) d->Set(k, v);
    }
    for (const auto& [k, v] : args.keyword) d->Set(k, v);
    return Value::Dict(std::move(d));
  });
  globals->vars["range"] = Value::Callable("range", [](CallArgs& args) -> absl::StatusOr<Value> {
    std::vector<int64_t> p;
    for (const Value& v : args.positional) {
      if (!v.is_number() || v.kind() == Value::Kind::kFloat) return absl::InvalidArgumentError("range() takes integers");
      p.push_back(v.integer());
    }
    if (p.empty() || p.size() > 3 || !args.keyword.empty()) return absl::InvalidArgumentError("range() takes 1 to 3 integers");
    const int64_t start = p.size() == 1 ? 0 : p[0];
    const int64_t stop = p.size() == 1 ? p[0] : p[1];
    const int64_t step = p.size() == 3 ? p[2] : 1;
    if (step == 0) return absl::InvalidArgumentError("range() arg 3 must not be zero");
    std::vector<Value> out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (out.size() >= 100000) return absl::ResourceExhaustedError("range() longer than 100000 items");
      out.push_back(Value::Int(i));
    }
    return Value::List(std::move(out));
  });
}

}  // namespace
}  // namespace chat_template_internal

ChatTemplate::ChatTemplate(std::shared_ptr<const chat_template_internal::Program> program)
    : program_(std::move(program)) {}

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string source) {
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<chat_template_internal::Program> program,
                        chat_template_internal::ParseTemplate(source));
  return ChatTemplate(std::shared_ptr<const chat_template_internal::Program>(std::move(program)));
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  using chat_template_internal::Value;
  if (!context.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("chat template context must be a JSON object, got ", context.type_name()));
  }
  chat_template_internal::Scope globals;
  chat_template_internal::AddGlobals(&globals);
  chat_template_internal::Scope top;
  top.parent = &globals;
  for (const auto& [key, value] : context.items()) top.vars[key] = Value::FromJson(value);
  chat_template_internal::Renderer renderer;
  return renderer.Run(*program_, &top);
}

absl::StatusOr<std::string> RenderChatPrompt(const Tokenizer& tokenizer, const nlohmann::ordered_json& messages,
                                             const ChatPromptOptions& options) {
  if (tokenizer.chat_template().empty()) {
    return absl::FailedPreconditionError("the model has no chat template (tokenizer_config.json has no chat_template)");
  }
  if (!messages.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat("chat messages must be a JSON array, got ", messages.type_name()));
  }
  if (!options.extra_context.is_null() && !options.extra_context.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template extra context must be a JSON object, got ", options.extra_context.type_name()));
  }
  EXL3_ASSIGN_OR_RETURN(ChatTemplate tmpl, ChatTemplate::Parse(tokenizer.chat_template()));
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  const SpecialTokenIds& special = tokenizer.special_token_ids();
  const std::pair<const char*, std::optional<int32_t>> tokens[] = {
      {"bos_token", special.bos}, {"eos_token", special.eos}, {"pad_token", special.pad}};
  for (const auto& [name, id] : tokens) {
    if (!id.has_value()) continue;
    if (std::optional<std::string> text = tokenizer.IdToToken(*id)) context[name] = *text;
  }
  context["messages"] = messages;
  context["tools"] = options.tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = options.add_generation_prompt;
  if (options.extra_context.is_object()) {
    for (const auto& [key, value] : options.extra_context.items()) context[key] = value;
  }
  return tmpl.Render(context);
}

}  // namespace exl3serve::coordinator
