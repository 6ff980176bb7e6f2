#include "coordinator/tokenizer/chat_template_parser.h"

#include <cerrno>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace exl3serve::coordinator::chat_template_internal {
namespace {

// Deepest nesting of expressions and statements the parser accepts; real
// templates stay below 10, and the limit keeps the recursion off the stack's end.
constexpr int kMaxNesting = 200;

enum class Tok { kData, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type = Tok::kEof;
  std::string text;  // data, name, operator, or the decoded string literal
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
  int column = 1;
};

absl::Status SyntaxError(int line, int column, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("chat template line ", line, ", column ", column, ": ", absl::string_view(what.data(), what.size())));
}

// Python str.isspace() on the code point starting at s[i]; *len gets its size.
bool SpaceAt(std::string_view s, size_t i, size_t* len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    *len = 1;
    return IsPythonSpace(c);
  }
  size_t n = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 1;
  if (i + n > s.size()) n = 1;
  *len = n;
  const std::u32string cp = ToU32(s.substr(i, n));
  return cp.size() == 1 && IsPythonSpace(cp[0]);
}

std::string RStripSpace(std::string_view s) {
  // Walk forward remembering where the trailing whitespace run starts.
  size_t end = 0, i = 0;
  while (i < s.size()) {
    size_t len;
    const bool space = SpaceAt(s, i, &len);
    i += len;
    if (!space) end = i;
  }
  return std::string(s.substr(0, end));
}

size_t SkipSpace(std::string_view s, size_t i) {
  size_t len;
  while (i < s.size() && SpaceAt(s, i, &len)) i += len;
  return i;
}

bool AllSpace(std::string_view s) {
  return !s.empty() && SkipSpace(s, 0) == s.size();
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  absl::StatusOr<std::vector<Token>> Run() {
    std::vector<Token> out;
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t start = std::string::npos;
      for (const char* opener : {"{{", "{%", "{#"}) {
        const size_t p = src_.find(opener, pos);
        if (p < start) start = p;
      }
      if (start == std::string::npos) {
        EmitData(src_.substr(pos), pos, &out);
        break;
      }
      const char kind = src_[start + 1];
      const char sign = start + 2 < src_.size() ? src_[start + 2] : '\0';
      std::string text = src_.substr(pos, start - pos);
      if (sign == '-') {
        text = RStripSpace(text);
      } else if (sign != '+' && kind != '{') {
        const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l_pos > 0 || line_starting) && AllSpace(std::string_view(text).substr(l_pos))) {
          text.resize(l_pos);
        }
      }
      EmitData(text, pos, &out);
      size_t p = start + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        const size_t end = src_.find("#}", p);
        if (end == std::string::npos) return Error(start, "missing end of comment tag");
        const char before = end > p ? src_[end - 1] : '\0';
        pos = end + 2;
        if (before == '-') {
          pos = SkipSpace(src_, pos);
        } else if (before != '+' && pos < src_.size() && src_[pos] == '\n') {
          ++pos;
        }
        line_starting = src_[pos - 1] == '\n';
        continue;
      }
      out.push_back(MakeToken(kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", start));
      EXL3_ASSIGN_OR_RETURN(pos, LexTag(p, kind == '%', &out));
      line_starting = src_[pos - 1] == '\n';
    }
    Token eof = MakeToken(Tok::kEof, "", src_.size());
    out.push_back(eof);
    return out;
  }

 private:
  void EmitData(std::string text, size_t offset, std::vector<Token>* out) {
    if (text.empty()) return;
    out->push_back(MakeToken(Tok::kData, std::move(text), offset));
  }

  Token MakeToken(Tok type, std::string text, size_t offset) {
    Token t;
    t.type = type;
    t.text = std::move(text);
    Locate(offset, &t.line, &t.column);
    return t;
  }

  void Locate(size_t offset, int* line, int* column) {
    // Positions only grow, so count lines incrementally.
    if (offset < located_offset_) {
      located_offset_ = 0;
      located_line_ = 1;
      located_line_start_ = 0;
    }
    for (; located_offset_ < offset && located_offset_ < src_.size(); ++located_offset_) {
      if (src_[located_offset_] == '\n') {
        ++located_line_;
        located_line_start_ = located_offset_ + 1;
      }
    }
    *line = located_line_;
    *column = static_cast<int>(offset - located_line_start_) + 1;
  }

  absl::Status Error(size_t offset, std::string_view what) {
    int line, column;
    Locate(offset, &line, &column);
    return SyntaxError(line, column, what);
  }

  // Lexes the inside of a tag from `p`; returns the position after its end.
  absl::StatusOr<size_t> LexTag(size_t p, bool block, std::vector<Token>* out) {
    std::string balance;
    while (true) {
      p = SkipSpace(src_, p);
      if (p >= src_.size()) {
        return Error(p, block ? "unexpected end of template, expected end of statement block ('%}')"
                              : "unexpected end of template, expected end of print statement ('}}')");
      }
      if (balance.empty()) {
        const std::string_view rest = std::string_view(src_).substr(p);
        if (block && (rest.starts_with("-%}") || rest.starts_with("+%}") || rest.starts_with("%}"))) {
          out->push_back(MakeToken(Tok::kBlockEnd, "", p));
          if (rest[0] == '-') return SkipSpace(src_, p + 3);
          if (rest[0] == '+') return p + 3;
          p += 2;
          if (p < src_.size() && src_[p] == '\n') ++p;
          return p;
        }
        if (!block && (rest.starts_with("-}}") || rest.starts_with("}}"))) {
          out->push_back(MakeToken(Tok::kVarEnd, "", p));
          return rest[0] == '-' ? SkipSpace(src_, p + 3) : p + 2;
        }
      }
      const char c = src_[p];
      if (std::isdigit(static_cast<unsigned char>(c))) {
        EXL3_ASSIGN_OR_RETURN(p, LexNumber(p, out));
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        out->push_back(MakeToken(Tok::kName, src_.substr(p, e - p), p));
        p = e;
      } else if (c == '\'' || c == '"') {
        EXL3_ASSIGN_OR_RETURN(p, LexString(p, out));
      } else {
        static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
        std::string op;
        for (std::string_view two : kTwo) {
          if (std::string_view(src_).substr(p).starts_with(two)) op = std::string(two);
        }
        if (op.empty() && std::string_view("+-/*%~[](){}><=.:|,;").find(c) != std::string_view::npos) op = std::string(1, c);
        if (op.empty()) return Error(p, absl::StrCat("unexpected char '", std::string(1, c), "'"));
        if (op == "(" || op == "[" || op == "{") {
          balance += op == "(" ? ')' : op == "[" ? ']' : '}';
        } else if (op == ")" || op == "]" || op == "}") {
          if (balance.empty()) return Error(p, absl::StrCat("unexpected '", op, "'"));
          if (balance.back() != op[0]) {
            return Error(p, absl::StrCat("unexpected '", op, "', expected '", std::string(1, balance.back()), "'"));
          }
          balance.pop_back();
        }
        out->push_back(MakeToken(Tok::kOp, op, p));
        p += op.size();
      }
    }
  }

  absl::StatusOr<size_t> LexNumber(size_t p, std::vector<Token>* out) {
    auto digits = [&](size_t i) {
      while (i < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[i])) ||
                                 (src_[i] == '_' && i + 1 < src_.size() && std::isdigit(static_cast<unsigned char>(src_[i + 1]))))) {
        ++i;
      }
      return i;
    };
    size_t e = digits(p);
    bool is_float = false;
    if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      e = digits(e + 1);
      is_float = true;
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t x = e + 1;
      if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
      if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
        e = digits(x);
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = p; i < e; ++i) {
      if (src_[i] != '_') text += src_[i];
    }
    Token t = MakeToken(is_float ? Tok::kFloat : Tok::kInt, text, p);
    if (is_float) {
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) return Error(p, absl::StrCat("integer literal ", text, " is too large"));
    }
    out->push_back(std::move(t));
    return e;
  }

  // A string literal with Python's escapes (jinja decodes them with
  // "unicode-escape"); unknown escapes stay as written.
  absl::StatusOr<size_t> LexString(size_t p, std::vector<Token>* out) {
    const char quote = src_[p];
    std::u32string value;
    size_t i = p + 1;
    auto hex = [&](size_t at, int n, char32_t* cp) {
      if (at + n > src_.size()) return false;
      *cp = 0;
      for (int k = 0; k < n; ++k) {
        const char h = src_[at + k];
        if (!std::isxdigit(static_cast<unsigned char>(h))) return false;
        *cp = *cp * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      return true;
    };
    while (true) {
      if (i >= src_.size()) return Error(p, "unexpected char: unterminated string literal");
      const char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        size_t e = i + 1;
        while (e < src_.size() && src_[e] != quote && src_[e] != '\\') ++e;
        value += ToU32(std::string_view(src_).substr(i, e - i));
        i = e;
        continue;
      }
      if (i + 1 >= src_.size()) return Error(p, "unexpected char: unterminated string literal");
      const char n = src_[i + 1];
      i += 2;
      switch (n) {
        case '\n': break;
        case '\\': value += U'\\'; break;
        case '\'': value += U'\''; break;
        case '"': value += U'"'; break;
        case 'a': value += U'\a'; break;
        case 'b': value += U'\b'; break;
        case 'f': value += U'\f'; break;
        case 'n': value += U'\n'; break;
        case 'r': value += U'\r'; break;
        case 't': value += U'\t'; break;
        case 'v': value += U'\v'; break;
        case 'x':
        case 'u':
        case 'U': {
          const int width = n == 'x' ? 2 : n == 'u' ? 4 : 8;
          char32_t cp;
          if (!hex(i, width, &cp) || cp > 0x10ffff) return Error(i - 2, absl::StrCat("bad \\", std::string(1, n), " escape in string literal"));
          value += cp;
          i += width;
          break;
        }
        case 'N':
          return Error(i - 2, "\\N{...} escapes are not supported in string literals");
        default:
          if (n >= '0' && n <= '7') {
            char32_t cp = n - '0';
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k, ++i) cp = cp * 8 + (src_[i] - '0');
            value += cp;
          } else {
            value += U'\\';
            --i;  // the character after the backslash is taken as written
          }
      }
    }
    out->push_back(MakeToken(Tok::kString, ToUtf8(value), p));
    return i + 1;
  }

  std::string src_;
  size_t located_offset_ = 0;
  int located_line_ = 1;
  size_t located_line_start_ = 0;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  absl::StatusOr<std::unique_ptr<Program>> Run() {
    auto program = std::make_unique<Program>();
    std::string stop;
    EXL3_ASSIGN_OR_RETURN(program->body, ParseBody({}, &stop));
    return program;
  }

 private:
  const Token& Peek(size_t ahead = 0) const {
    const size_t i = pos_ + ahead;
    return i < toks_.size() ? toks_[i] : toks_.back();
  }
  const Token& Next() {
    const Token& t = Peek();
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool IsOp(const Token& t, std::string_view op) const { return t.type == Tok::kOp && t.text == op; }
  bool IsName(const Token& t, std::string_view name) const { return t.type == Tok::kName && t.text == name; }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof: return "end of template";
      case Tok::kBlockEnd: return "end of statement block";
      case Tok::kVarEnd: return "end of print statement";
      case Tok::kString: return "string";
      case Tok::kInt:
      case Tok::kFloat: return "number";
      default: return absl::StrCat("'", t.text, "'");
    }
  }

  absl::Status ErrorAt(const Token& t, std::string_view what) const { return SyntaxError(t.line, t.column, what); }
  absl::Status Expected(std::string_view what) const {
    return ErrorAt(Peek(), absl::StrCat("expected ", absl::string_view(what.data(), what.size()), ", got ", Describe(Peek())));
  }
  absl::Status ExpectOp(std::string_view op) {
    if (!IsOp(Peek(), op)) return Expected(absl::StrCat("'", absl::string_view(op.data(), op.size()), "'"));
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectBlockEnd() {
    if (Peek().type != Tok::kBlockEnd) return Expected("end of statement block");
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName() {
    if (Peek().type != Tok::kName) return Expected("a name");
    return Next().text;
  }

  struct DepthGuard {
    explicit DepthGuard(int* d) : depth(d) { ++*depth; }
    ~DepthGuard() { --*depth; }
    int* depth;
  };
  absl::Status CheckDepth() const {
    if (depth_ > kMaxNesting) return ErrorAt(Peek(), absl::StrCat("nested more than ", kMaxNesting, " deep"));
    return absl::OkStatus();
  }

  // Parses statements until a block tag whose keyword is in `stops` (left
  // unconsumed after "{%", its name in *stop) or the end of the template
  // (allowed only when `stops` is empty).
  absl::StatusOr<std::vector<Stmt>> ParseBody(const std::vector<std::string_view>& stops, std::string* stop) {
    DepthGuard guard(&depth_);
    EXL3_RETURN_IF_ERROR(CheckDepth());
    std::vector<Stmt> body;
    while (true) {
      const Token& t = Peek();
      if (t.type == Tok::kEof) {
        if (stops.empty()) return body;
        std::string want;
        for (std::string_view s : stops) absl::StrAppend(&want, want.empty() ? "" : " or ", "'", absl::string_view(s.data(), s.size()), "'");
        return ErrorAt(t, absl::StrCat("unexpected end of template, expected ", want));
      }
      if (t.type == Tok::kData) {
        Stmt s;
        s.kind = Stmt::Kind::kText;
        s.line = t.line;
        s.text = t.text;
        body.push_back(std::move(s));
        Next();
        continue;
      }
      if (t.type == Tok::kVarBegin) {
        Next();
        Stmt s;
        s.kind = Stmt::Kind::kOutput;
        s.line = t.line;
        EXL3_ASSIGN_OR_RETURN(s.expr, ParseTuple(/*allow_condition=*/true));
        if (Peek().type != Tok::kVarEnd) return Expected("end of print statement");
        Next();
        body.push_back(std::move(s));
        continue;
      }
      if (t.type != Tok::kBlockBegin) return ErrorAt(t, absl::StrCat("unexpected ", Describe(t)));
      const Token& keyword = Peek(1);
      if (keyword.type != Tok::kName) {
        Next();
        return Expected("a statement name");
      }
      for (std::string_view s : stops) {
        if (keyword.text == s) {
          *stop = keyword.text;
          Next();
          Next();
          return body;
        }
      }
      Next();
      EXL3_ASSIGN_OR_RETURN(Stmt stmt, ParseStatement());
      body.push_back(std::move(stmt));
    }
  }

  absl::StatusOr<Stmt> ParseStatement() {
    const Token keyword = Next();
    Stmt s;
    s.line = keyword.line;
    const std::string& k = keyword.text;
    std::string stop;
    if (k == "if") {
      s.kind = Stmt::Kind::kIf;
      while (true) {
        EXL3_ASSIGN_OR_RETURN(auto cond, ParseTuple(true));
        EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
        EXL3_ASSIGN_OR_RETURN(auto body, ParseBody({"elif", "else", "endif"}, &stop));
        s.branches.emplace_back(std::move(cond), std::move(body));
        if (stop == "elif") continue;
        if (stop == "else") {
          EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
          EXL3_ASSIGN_OR_RETURN(s.else_body, ParseBody({"endif"}, &stop));
        }
        break;
      }
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      return s;
    }
    if (k == "for") {
      s.kind = Stmt::Kind::kFor;
      EXL3_ASSIGN_OR_RETURN(s.targets, ParseTargets());
      if (!IsName(Peek(), "in")) return Expected("'in'");
      Next();
      EXL3_ASSIGN_OR_RETURN(s.expr, ParseTuple(/*allow_condition=*/false));
      if (IsName(Peek(), "if")) {
        Next();
        EXL3_ASSIGN_OR_RETURN(s.condition, ParseTuple(true));
      }
      if (IsName(Peek(), "recursive")) return ErrorAt(Peek(), "recursive for loops are not supported");
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      EXL3_ASSIGN_OR_RETURN(s.body, ParseBody({"else", "endfor"}, &stop));
      if (stop == "else") {
        EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
        EXL3_ASSIGN_OR_RETURN(s.else_body, ParseBody({"endfor"}, &stop));
      }
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      return s;
    }
    if (k == "set") {
      EXL3_ASSIGN_OR_RETURN(std::string first, ExpectName());
      if (IsOp(Peek(), ".")) {
        Next();
        EXL3_ASSIGN_OR_RETURN(s.attr, ExpectName());
        s.targets.push_back(first);
      } else {
        s.targets.push_back(first);
        while (IsOp(Peek(), ",")) {
          Next();
          if (Peek().type != Tok::kName) break;
          s.targets.push_back(Next().text);
        }
      }
      if (Peek().type == Tok::kBlockEnd && s.attr.empty() && s.targets.size() == 1) {
        Next();
        s.kind = Stmt::Kind::kSetBlock;
        EXL3_ASSIGN_OR_RETURN(s.body, ParseBody({"endset"}, &stop));
        EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
        return s;
      }
      s.kind = Stmt::Kind::kSet;
      EXL3_RETURN_IF_ERROR(ExpectOp("="));
      EXL3_ASSIGN_OR_RETURN(s.expr, ParseTuple(true));
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      return s;
    }
    if (k == "break" || k == "continue") {
      s.kind = k == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      return s;
    }
    if (k == "generation") {
      s.kind = Stmt::Kind::kBlock;
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      EXL3_ASSIGN_OR_RETURN(s.body, ParseBody({"endgeneration"}, &stop));
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      return s;
    }
    if (k == "macro") {
      s.kind = Stmt::Kind::kMacro;
      EXL3_ASSIGN_OR_RETURN(s.text, ExpectName());
      EXL3_RETURN_IF_ERROR(ExpectOp("("));
      while (!IsOp(Peek(), ")")) {
        if (!s.targets.empty()) EXL3_RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(Peek(), ")")) break;
        EXL3_ASSIGN_OR_RETURN(std::string param, ExpectName());
        s.targets.push_back(param);
        std::unique_ptr<Expr> def;
        if (IsOp(Peek(), "=")) {
          Next();
          EXL3_ASSIGN_OR_RETURN(def, ParseExpression(true));
        }
        s.defaults.push_back(std::move(def));
      }
      Next();
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      EXL3_ASSIGN_OR_RETURN(s.body, ParseBody({"endmacro"}, &stop));
      if (Peek().type == Tok::kName) Next();  // {% endmacro name %}
      EXL3_RETURN_IF_ERROR(ExpectBlockEnd());
      return s;
    }
    static constexpr std::string_view kEnds[] = {"elif", "else", "endif", "endfor", "endset", "endmacro", "endgeneration"};
    for (std::string_view e : kEnds) {
      if (k == e) return ErrorAt(keyword, absl::StrCat("unexpected '", k, "'"));
    }
    return ErrorAt(keyword, absl::StrCat("statement '", k, "' is not supported by this chat template interpreter"));
  }

  absl::StatusOr<std::vector<std::string>> ParseTargets() {
    std::vector<std::string> targets;
    const bool paren = IsOp(Peek(), "(");
    if (paren) Next();
    while (true) {
      EXL3_ASSIGN_OR_RETURN(std::string name, ExpectName());
      targets.push_back(name);
      if (!IsOp(Peek(), ",")) break;
      Next();
    }
    if (paren) EXL3_RETURN_IF_ERROR(ExpectOp(")"));
    return targets;
  }

  std::unique_ptr<Expr> MakeExpr(Expr::Kind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->column = at.column;
    return e;
  }

  // expr (, expr)* — a bare tuple where commas appear.
  absl::StatusOr<std::unique_ptr<Expr>> ParseTuple(bool allow_condition) {
    const Token start = Peek();
    EXL3_ASSIGN_OR_RETURN(auto first, ParseExpression(allow_condition));
    if (!IsOp(Peek(), ",")) return first;
    auto tuple = MakeExpr(Expr::Kind::kTuple, start);
    tuple->args.push_back(std::move(first));
    while (IsOp(Peek(), ",")) {
      Next();
      if (Peek().type == Tok::kBlockEnd || Peek().type == Tok::kVarEnd) break;
      EXL3_ASSIGN_OR_RETURN(auto item, ParseExpression(allow_condition));
      tuple->args.push_back(std::move(item));
    }
    return tuple;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseExpression(bool allow_condition) {
    DepthGuard guard(&depth_);
    EXL3_RETURN_IF_ERROR(CheckDepth());
    const Token start = Peek();
    EXL3_ASSIGN_OR_RETURN(auto expr, ParseOr());
    while (allow_condition && IsName(Peek(), "if")) {
      Next();
      auto cond = MakeExpr(Expr::Kind::kCondition, start);
      EXL3_ASSIGN_OR_RETURN(auto test, ParseOr());
      cond->args.push_back(std::move(expr));
      cond->args.push_back(std::move(test));
      if (IsName(Peek(), "else")) {
        Next();
        EXL3_ASSIGN_OR_RETURN(auto other, ParseExpression(true));
        cond->args.push_back(std::move(other));
      } else {
        cond->args.push_back(nullptr);
      }
      expr = std::move(cond);
    }
    return expr;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseOr() {
    EXL3_ASSIGN_OR_RETURN(auto left, ParseAnd());
    while (IsName(Peek(), "or")) {
      const Token op = Next();
      EXL3_ASSIGN_OR_RETURN(auto right, ParseAnd());
      auto e = MakeExpr(Expr::Kind::kOr, op);
      e->args.push_back(std::move(left));
      e->args.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseAnd() {
    EXL3_ASSIGN_OR_RETURN(auto left, ParseNot());
    while (IsName(Peek(), "and")) {
      const Token op = Next();
      EXL3_ASSIGN_OR_RETURN(auto right, ParseNot());
      auto e = MakeExpr(Expr::Kind::kAnd, op);
      e->args.push_back(std::move(left));
      e->args.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseNot() {
    if (IsName(Peek(), "not")) {
      const Token op = Next();
      DepthGuard guard(&depth_);
      EXL3_RETURN_IF_ERROR(CheckDepth());
      EXL3_ASSIGN_OR_RETURN(auto inner, ParseNot());
      auto e = MakeExpr(Expr::Kind::kNot, op);
      e->args.push_back(std::move(inner));
      return e;
    }
    return ParseCompare();
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseCompare() {
    const Token start = Peek();
    EXL3_ASSIGN_OR_RETURN(auto left, ParseMath1());
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      const Token& t = Peek();
      if (t.type == Tok::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" ||
                                 t.text == "<=" || t.text == ">=")) {
        op = t.text;
        Next();
      } else if (IsName(t, "in")) {
        op = "in";
        Next();
      } else if (IsName(t, "not") && IsName(Peek(1), "in")) {
        op = "not in";
        Next();
        Next();
      } else {
        break;
      }
      if (cmp == nullptr) {
        cmp = MakeExpr(Expr::Kind::kCompare, start);
        cmp->args.push_back(std::move(left));
      }
      EXL3_ASSIGN_OR_RETURN(auto right, ParseMath1());
      cmp->ops.push_back(op);
      cmp->args.push_back(std::move(right));
    }
    if (cmp != nullptr) return cmp;
    return left;
  }

  absl::StatusOr<std::unique_ptr<Expr>> Binary(std::unique_ptr<Expr> left, const Token& op, std::unique_ptr<Expr> right) {
    auto e = MakeExpr(Expr::Kind::kBinary, op);
    e->name = op.text;
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseMath1() {
    EXL3_ASSIGN_OR_RETURN(auto left, ParseConcat());
    while (IsOp(Peek(), "+") || IsOp(Peek(), "-")) {
      const Token op = Next();
      EXL3_ASSIGN_OR_RETURN(auto right, ParseConcat());
      EXL3_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, std::move(right)));
    }
    return left;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseConcat() {
    EXL3_ASSIGN_OR_RETURN(auto left, ParseMath2());
    while (IsOp(Peek(), "~")) {
      const Token op = Next();
      EXL3_ASSIGN_OR_RETURN(auto right, ParseMath2());
      EXL3_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, std::move(right)));
    }
    return left;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseMath2() {
    EXL3_ASSIGN_OR_RETURN(auto left, ParsePow());
    while (IsOp(Peek(), "*") || IsOp(Peek(), "/") || IsOp(Peek(), "//") || IsOp(Peek(), "%")) {
      const Token op = Next();
      EXL3_ASSIGN_OR_RETURN(auto right, ParsePow());
      EXL3_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, std::move(right)));
    }
    return left;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParsePow() {
    EXL3_ASSIGN_OR_RETURN(auto left, ParseUnary(true));
    while (IsOp(Peek(), "**")) {
      const Token op = Next();
      EXL3_ASSIGN_OR_RETURN(auto right, ParseUnary(true));
      EXL3_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, std::move(right)));
    }
    return left;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseUnary(bool with_filter) {
    DepthGuard guard(&depth_);
    EXL3_RETURN_IF_ERROR(CheckDepth());
    std::unique_ptr<Expr> node;
    if (IsOp(Peek(), "-") || IsOp(Peek(), "+")) {
      const Token op = Next();
      EXL3_ASSIGN_OR_RETURN(auto inner, ParseUnary(false));
      node = MakeExpr(op.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, op);
      node->args.push_back(std::move(inner));
    } else {
      EXL3_ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    EXL3_ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      EXL3_ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParsePrimary() {
    const Token t = Peek();
    switch (t.type) {
      case Tok::kName: {
        Next();
        auto e = MakeExpr(Expr::Kind::kLiteral, t);
        if (t.text == "true" || t.text == "True") {
          e->literal = Value::Bool(true);
        } else if (t.text == "false" || t.text == "False") {
          e->literal = Value::Bool(false);
        } else if (t.text == "none" || t.text == "None") {
          e->literal = Value::None();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        return e;
      }
      case Tok::kString: {
        std::string text;
        while (Peek().type == Tok::kString) text += Next().text;  // adjacent literals join
        auto e = MakeExpr(Expr::Kind::kLiteral, t);
        e->literal = Value::String(std::move(text));
        return e;
      }
      case Tok::kInt:
      case Tok::kFloat: {
        Next();
        auto e = MakeExpr(Expr::Kind::kLiteral, t);
        e->literal = t.type == Tok::kInt ? Value::Int(t.int_value) : Value::Float(t.float_value);
        return e;
      }
      case Tok::kOp:
        if (t.text == "(") {
          Next();
          if (IsOp(Peek(), ")")) {
            Next();
            return MakeExpr(Expr::Kind::kTuple, t);
          }
          EXL3_ASSIGN_OR_RETURN(auto first, ParseExpression(true));
          if (IsOp(Peek(), ")")) {
            Next();
            return first;
          }
          auto tuple = MakeExpr(Expr::Kind::kTuple, t);
          tuple->args.push_back(std::move(first));
          while (IsOp(Peek(), ",")) {
            Next();
            if (IsOp(Peek(), ")")) break;
            EXL3_ASSIGN_OR_RETURN(auto item, ParseExpression(true));
            tuple->args.push_back(std::move(item));
          }
          EXL3_RETURN_IF_ERROR(ExpectOp(")"));
          return tuple;
        }
        if (t.text == "[") {
          Next();
          auto list = MakeExpr(Expr::Kind::kList, t);
          while (!IsOp(Peek(), "]")) {
            if (!list->args.empty()) EXL3_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp(Peek(), "]")) break;
            EXL3_ASSIGN_OR_RETURN(auto item, ParseExpression(true));
            list->args.push_back(std::move(item));
          }
          Next();
          return list;
        }
        if (t.text == "{") {
          Next();
          auto dict = MakeExpr(Expr::Kind::kDict, t);
          while (!IsOp(Peek(), "}")) {
            if (!dict->args.empty()) EXL3_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp(Peek(), "}")) break;
            EXL3_ASSIGN_OR_RETURN(auto key, ParseExpression(true));
            EXL3_RETURN_IF_ERROR(ExpectOp(":"));
            EXL3_ASSIGN_OR_RETURN(auto value, ParseExpression(true));
            dict->args.push_back(std::move(key));
            dict->args.push_back(std::move(value));
          }
          Next();
          return dict;
        }
        break;
      default:
        break;
    }
    return ErrorAt(t, absl::StrCat("unexpected ", Describe(t)));
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParsePostfix(std::unique_ptr<Expr> node) {
    while (true) {
      const Token t = Peek();
      if (IsOp(t, ".")) {
        Next();
        const Token& a = Peek();
        if (a.type == Tok::kName) {
          auto e = MakeExpr(Expr::Kind::kAttr, t);
          e->name = Next().text;
          e->args.push_back(std::move(node));
          node = std::move(e);
        } else if (a.type == Tok::kInt) {
          auto e = MakeExpr(Expr::Kind::kItem, t);
          auto index = MakeExpr(Expr::Kind::kLiteral, a);
          index->literal = Value::Int(Next().int_value);
          e->args.push_back(std::move(node));
          e->args.push_back(std::move(index));
          node = std::move(e);
        } else {
          return Expected("an attribute name");
        }
      } else if (IsOp(t, "[")) {
        Next();
        std::unique_ptr<Expr> parts[3];
        int n = 0;
        bool slice = false;
        while (true) {
          if (!IsOp(Peek(), ":") && !IsOp(Peek(), "]")) {
            EXL3_ASSIGN_OR_RETURN(parts[n], ParseExpression(true));
          }
          if (IsOp(Peek(), ":") && n < 2) {
            Next();
            slice = true;
            ++n;
            continue;
          }
          break;
        }
        EXL3_RETURN_IF_ERROR(ExpectOp("]"));
        if (!slice && parts[0] == nullptr) return ErrorAt(t, "expected a subscript");
        auto e = MakeExpr(slice ? Expr::Kind::kSlice : Expr::Kind::kItem, t);
        e->args.push_back(std::move(node));
        e->args.push_back(std::move(parts[0]));
        if (slice) {
          e->args.push_back(std::move(parts[1]));
          e->args.push_back(std::move(parts[2]));
        }
        node = std::move(e);
      } else if (IsOp(t, "(")) {
        auto e = MakeExpr(Expr::Kind::kCall, t);
        e->args.push_back(std::move(node));
        EXL3_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  // "(" args ")" into e->args[1..] / e->kwnames.
  absl::Status ParseCallArgs(Expr* e) {
    EXL3_RETURN_IF_ERROR(ExpectOp("("));
    bool first = true;
    while (!IsOp(Peek(), ")")) {
      if (!first) EXL3_RETURN_IF_ERROR(ExpectOp(","));
      first = false;
      if (IsOp(Peek(), ")")) break;
      std::string kw;
      if (Peek().type == Tok::kName && IsOp(Peek(1), "=")) {
        kw = Next().text;
        Next();
      } else if (!e->kwnames.empty() && !e->kwnames.back().empty()) {
        return ErrorAt(Peek(), "positional argument follows keyword argument");
      }
      EXL3_ASSIGN_OR_RETURN(auto arg, ParseExpression(true));
      e->args.push_back(std::move(arg));
      e->kwnames.push_back(kw);
    }
    Next();
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Expr>> ParseFilterExpr(std::unique_ptr<Expr> node) {
    while (true) {
      const Token t = Peek();
      if (IsOp(t, "|")) {
        Next();
        auto e = MakeExpr(Expr::Kind::kFilter, t);
        EXL3_ASSIGN_OR_RETURN(e->name, ExpectName());
        while (IsOp(Peek(), ".")) {  // dotted filter names
          Next();
          EXL3_ASSIGN_OR_RETURN(std::string part, ExpectName());
          e->name += "." + part;
        }
        e->args.push_back(std::move(node));
        if (IsOp(Peek(), "(")) EXL3_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        node = std::move(e);
      } else if (IsName(t, "is")) {
        Next();
        auto e = MakeExpr(Expr::Kind::kTest, t);
        if (IsName(Peek(), "not")) {
          Next();
          e->negated = true;
        }
        EXL3_ASSIGN_OR_RETURN(e->name, ExpectName());
        e->args.push_back(std::move(node));
        const Token& a = Peek();
        if (IsOp(a, "(")) {
          EXL3_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        } else if ((a.type == Tok::kName && a.text != "else" && a.text != "or" && a.text != "and" &&
                    a.text != "if" && a.text != "in" && a.text != "not" && a.text != "is") ||
                   a.type == Tok::kString || a.type == Tok::kInt || a.type == Tok::kFloat ||
                   IsOp(a, "[") || IsOp(a, "{") || IsOp(a, "-") || IsOp(a, "+")) {
          // One argument without parentheses: "is divisibleby 3", "is sameas false".
          EXL3_ASSIGN_OR_RETURN(auto arg, ParseUnary(false));
          e->args.push_back(std::move(arg));
          e->kwnames.push_back("");
        }
        node = std::move(e);
      } else if (IsOp(t, "(")) {
        auto e = MakeExpr(Expr::Kind::kCall, t);
        e->args.push_back(std::move(node));
        EXL3_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int depth_ = 0;
};

// jinja's source preparation: \r\n and \r become \n; one trailing newline goes.
std::string NormalizeNewlines(const std::string& source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Program>> ParseTemplate(const std::string& source) {
  Lexer lexer(NormalizeNewlines(source));
  EXL3_ASSIGN_OR_RETURN(std::vector<Token> tokens, lexer.Run());
  Parser parser(std::move(tokens));
  return parser.Run();
}

}  // namespace exl3serve::coordinator::chat_template_internal
