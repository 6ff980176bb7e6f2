// StopStringMatcher (coordinator/stop_strings.h): hold-back of a possible
// stop-string start, release of text that did not become one, earliest match.
#include "coordinator/stop_strings.h"

#include <string>

#include "gtest/gtest.h"

namespace exl3serve::coordinator {
namespace {

TEST(StopStringMatcherTest, HoldsBackAPossibleStartAndCutsAtTheMatch) {
  StopStringMatcher stops({"THE END", "\n\n"});
  std::string emitted;
  emitted += stops.Append("Once upon a time. TH");
  EXPECT_EQ(emitted, "Once upon a time. ");  // "TH" might start "THE END"
  emitted += stops.Append("E E");
  EXPECT_FALSE(stops.stopped());
  emitted += stops.Append("ND and more");
  EXPECT_TRUE(stops.stopped());
  EXPECT_EQ(stops.matched(), "THE END");
  EXPECT_EQ(emitted, "Once upon a time. ");
  EXPECT_EQ(stops.Append("x"), "");
  EXPECT_EQ(stops.Flush(), "");
}

TEST(StopStringMatcherTest, ReleasesHeldTextThatDidNotBecomeAStop) {
  StopStringMatcher stops({"abc"});
  EXPECT_EQ(stops.Append("xab"), "x");
  EXPECT_EQ(stops.Append("d"), "abd");
  EXPECT_EQ(stops.Append("a"), "");
  EXPECT_EQ(stops.Flush(), "a");
  EXPECT_FALSE(stops.stopped());
}

TEST(StopStringMatcherTest, EarliestMatchWins) {
  StopStringMatcher stops({"cd", "bcx", "b"});
  EXPECT_EQ(stops.Append("abcd"), "a");
  EXPECT_EQ(stops.matched(), "b");
}

}  // namespace
}  // namespace exl3serve::coordinator
