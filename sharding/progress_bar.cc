#include "sharding/progress_bar.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_format.h"

namespace exl3serve::sharding {

std::string FormatDuration(double seconds) {
  if (!(seconds >= 0) || seconds > 360000) return "--:--";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

ProgressBar::ProgressBar(std::string unit, uint64_t total, bool enabled)
    : unit_(std::move(unit)),
      total_(total),
      enabled_(enabled),
      tty_(enabled && ::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Advance(uint64_t delta, std::string_view detail) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ = std::min(total_, done_ + delta);
  if (!detail.empty()) detail_ = std::string(detail);
  DrawLocked(false);
}

void ProgressBar::SetDetail(std::string_view detail) {
  std::lock_guard<std::mutex> lock(mu_);
  detail_ = std::string(detail);
  DrawLocked(false);
}

void ProgressBar::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  DrawLocked(true);
  finished_ = true;
  if (tty_) std::fputc('\n', stderr);
}

void ProgressBar::DrawLocked(bool force) {
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double fraction = total_ == 0 ? 1.0 : static_cast<double>(done_) / total_;
  const double rate = elapsed > 0 ? done_ / elapsed : 0.0;
  const double eta = rate > 0 ? (total_ - done_) / rate : -1.0;
  if (tty_) {
    if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::string bar(filled, '#');
    bar.append(kWidth - filled, '.');
    std::fprintf(stderr, "\r[%s] %3d%%  %llu/%llu %s  %.0f %s/s  ETA %s  %-28.28s", bar.c_str(),
                 static_cast<int>(fraction * 100), static_cast<unsigned long long>(done_),
                 static_cast<unsigned long long>(total_), unit_.c_str(), rate, unit_.c_str(),
                 FormatDuration(eta).c_str(), detail_.c_str());
    std::fflush(stderr);
    return;
  }
  const int decile = static_cast<int>(fraction * 10);
  if (!force && decile == last_decile_) return;
  if (force && decile == last_decile_ && done_ != total_) return;
  last_decile_ = decile;
  std::fprintf(stderr, "progress: %3d%%  %llu/%llu %s  elapsed %s  ETA %s  %s\n",
               static_cast<int>(fraction * 100), static_cast<unsigned long long>(done_),
               static_cast<unsigned long long>(total_), unit_.c_str(),
               FormatDuration(elapsed).c_str(), FormatDuration(eta).c_str(), detail_.c_str());
}

}  // namespace exl3serve::sharding
