// sharding/progress_bar.h — progress of long work (conversion), with ETA.
//
// On a terminal (stderr is a TTY) it redraws one line in place, at most every
// 100 ms: "[#######.....]  58%  1520/2600 tiles  4.1k tiles/s  ETA 0:03  layer 3 mlp".
// Otherwise it prints a plain line at every 10 % step, so logs stay readable.
//
// Thread safety: thread-safe (Update may be called from worker threads).
#ifndef EXL3SERVE_SHARDING_PROGRESS_BAR_H_
#define EXL3SERVE_SHARDING_PROGRESS_BAR_H_

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

namespace exl3serve::sharding {

class ProgressBar {
 public:
  // `unit` names what is counted ("tiles"). `enabled` false makes it silent.
  ProgressBar(std::string unit, uint64_t total, bool enabled);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Adds `delta` done units; `detail` (may be empty) replaces the trailing text.
  void Advance(uint64_t delta, std::string_view detail = {});
  // Sets the detail text without advancing.
  void SetDetail(std::string_view detail);
  // Draws the final state and ends the line (idempotent).
  void Finish();

 private:
  void DrawLocked(bool force);

  const std::string unit_;
  const uint64_t total_;
  const bool enabled_;
  const bool tty_;
  const std::chrono::steady_clock::time_point start_;
  std::mutex mu_;
  uint64_t done_ = 0;             // guarded by mu_
  std::string detail_;            // guarded by mu_
  std::chrono::steady_clock::time_point last_draw_;  // guarded by mu_
  int last_decile_ = -1;          // guarded by mu_
  bool finished_ = false;         // guarded by mu_
};

// "1:02:03" / "3:07" for a number of seconds.
std::string FormatDuration(double seconds);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_PROGRESS_BAR_H_
