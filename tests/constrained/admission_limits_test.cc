// Constraints the matcher could not follow are refused when compiled (at
// admission: a 400 naming the limit), not at the first token that reaches
// the limit mid-generation (issue 41: a 100,000-value enum failed with a 500
// after its opening quote).
#include <string>

#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/grammar.h"
#include "coordinator/constrained/pda.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using ::testing::HasSubstr;

std::string EnumSchema(int n) {
  nlohmann::json values = nlohmann::json::array();
  for (int i = 0; i < n; ++i) values.push_back("v" + std::to_string(i));
  return nlohmann::json({{"enum", values}}).dump();
}

TEST(AdmissionLimits, AnEnumTheMatcherCannotFollowIsRefusedAtCompileTime) {
  auto vocab = test_util::ByteVocab();
  for (int n : {2049, 100000}) {
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = EnumSchema(n)}, vocab);
    ASSERT_FALSE(c.ok()) << n << " values compiled";
    EXPECT_TRUE(absl::IsResourceExhausted(c.status())) << c.status();
    EXPECT_THAT(std::string(c.status().message()), HasSubstr("kMaxRuleAlternatives"));
  }
  std::vector<std::string> choices;
  for (int i = 0; i < 3000; ++i) choices.push_back("c" + std::to_string(i));
  auto c = CompileConstraint({.kind = ConstraintKind::kChoice, .choices = choices}, vocab);
  EXPECT_FALSE(c.ok()) << "3000 choices sharing a first byte compiled";
}

// At the limit the constraint compiles and every value can be generated:
// the stacks after the shared opening quote fit.
TEST(AdmissionLimits, AnEnumAtTheLimitCompilesAndAcceptsItsValues) {
  auto vocab = test_util::ByteVocab();
  auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = EnumSchema(kMaxRuleAlternatives)}, vocab);
  ASSERT_TRUE(c.ok()) << c.status();
  for (int i : {0, 1, 777, static_cast<int>(kMaxRuleAlternatives) - 1}) {
    EXPECT_TRUE(test_util::Accepts(*c, "\"v" + std::to_string(i) + "\"")) << i;
  }
  EXPECT_FALSE(test_util::Accepts(*c, "\"v" + std::to_string(kMaxRuleAlternatives) + "\""));
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
