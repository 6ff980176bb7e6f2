#include "coordinator/stop_strings.h"

#include <algorithm>
#include <utility>

namespace exl3serve::coordinator {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stop_strings) {
  for (std::string& s : stop_strings) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

std::string StopStringMatcher::Append(std::string_view text) {
  if (stopped_) return "";
  pending_.append(text);
  // Earliest match wins; among matches at the same place, the longest.
  size_t best = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = pending_.find(s);
    if (at == std::string::npos) continue;
    if (best == std::string::npos || at < best || (at == best && s.size() > matched_.size())) {
      best = at;
      matched_ = s;
    }
  }
  if (best != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, best);
    pending_.clear();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopStringMatcher::Flush() {
  if (stopped_) return "";
  return std::exchange(pending_, std::string());
}

}  // namespace exl3serve::coordinator
