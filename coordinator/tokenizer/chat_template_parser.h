// coordinator/tokenizer/chat_template_parser.h — the syntax tree of a chat
// template and the lexer/parser that builds it (chat_template.h). Internal to
// exl3_tokenizer.
//
// The lexer follows jinja2's with trim_blocks and lstrip_blocks on: "\r\n" and
// "\r" become "\n", one trailing newline of the source is dropped, a block or
// comment tag eats the newline after it (unless written "+%}"), whitespace
// before a block or comment tag alone on its line is dropped (unless written
// "{%+"), and "-" on a tag strips all whitespace on that side.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_PARSER_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_PARSER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/tokenizer/chat_template_value.h"

namespace exl3serve::coordinator::chat_template_internal {

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // args
    kTuple,     // args
    kDict,      // args: key, value, key, value, ...
    kAttr,      // args[0].name
    kItem,      // args[0][args[1]]
    kSlice,     // args[0][args[1]:args[2]:args[3]], any of 1..3 may be null
    kCall,      // args[0](args[1..]), keyword names in kwnames (aligned with args[1..])
    kFilter,    // args[0] | name(args[1..])
    kTest,      // args[0] is [not] name(args[1..])
    kNot,       // not args[0]
    kNeg,       // -args[0]
    kPos,       // +args[0]
    kBinary,    // args[0] name args[1]; name is + - * / // % ** ~
    kCompare,   // args[0] ops[0] args[1] ops[1] args[2] ...
    kAnd,       // args[0] and args[1]
    kOr,        // args[0] or args[1]
    kCondition  // args[0] if args[1] else args[2] (args[2] may be null)
  };
  Kind kind = Kind::kLiteral;
  int line = 0;
  int column = 0;
  Value literal;
  std::string name;
  bool negated = false;
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::string> kwnames;  // kCall/kFilter/kTest: one per argument after args[0]
  std::vector<std::string> ops;      // kCompare
};

struct Stmt {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches, else_body
    kFor,       // for targets in expr [if condition]: body [else: else_body]
    kSet,       // set targets = expr, or set targets[0].attr = expr
    kSetBlock,  // set targets[0]: body
    kBreak,
    kContinue,
    kMacro,     // macro name(targets = defaults): body
    kBlock      // body rendered in place ({% generation %} of transformers)
  };
  Kind kind = Kind::kText;
  int line = 0;
  std::string text;  // kText: the text; kMacro: the macro's name
  std::unique_ptr<Expr> expr;
  std::unique_ptr<Expr> condition;  // kFor: the loop filter
  std::vector<std::string> targets;
  std::string attr;  // kSet on a namespace attribute
  std::vector<std::pair<std::unique_ptr<Expr>, std::vector<Stmt>>> branches;
  std::vector<Stmt> body;
  std::vector<Stmt> else_body;
  std::vector<std::unique_ptr<Expr>> defaults;  // kMacro: one per parameter (null: none)
};

struct Program {
  std::vector<Stmt> body;
};

// Parses a template. Errors: InvalidArgument "chat template line L, column C: ...".
absl::StatusOr<std::unique_ptr<Program>> ParseTemplate(const std::string& source);

}  // namespace exl3serve::coordinator::chat_template_internal

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_CHAT_TEMPLATE_PARSER_H_
