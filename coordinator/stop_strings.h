// coordinator/stop_strings.h — ends generation at the first occurrence of any
// of a request's stop strings in the streamed text, and holds back text that
// might still become the start of one, so no part of a stop string is ever
// emitted.
//
//   StopStringMatcher stops({"\n\n", "THE END"});
//   std::string ready = stops.Append(piece);  // emit `ready`
//   if (stops.stopped()) ...;                 // the stop string itself is dropped
//   std::string rest = stops.Flush();         // at the end of generation
#ifndef EXL3SERVE_COORDINATOR_STOP_STRINGS_H_
#define EXL3SERVE_COORDINATOR_STOP_STRINGS_H_

#include <string>
#include <string_view>
#include <vector>

namespace exl3serve::coordinator {

// Thread safety: thread-compatible. Ownership: owns copies of the strings.
class StopStringMatcher {
 public:
  // Empty stop strings are ignored.
  explicit StopStringMatcher(std::vector<std::string> stop_strings);

  // Adds generated text; returns the text that can be emitted now: all of it
  // except a tail that is a proper prefix of a stop string, and nothing from
  // the first stop string on. After a match, stopped() is true and further
  // calls return "".
  std::string Append(std::string_view text);

  // The held-back tail (generation ended without completing a stop string);
  // "" after a match.
  std::string Flush();

  bool stopped() const { return stopped_; }
  // The stop string that matched ("" before a match).
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_STOP_STRINGS_H_
