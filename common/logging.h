// common/logging.h — minimal leveled logging to stderr, and CHECK for our own bugs.
//
//   EXL3_LOG(kInfo) << "loaded " << n << " tensors";
//   EXL3_CHECK(k % 16 == 0) << "k=" << k;      // aborts: broken invariant only
//
// The level threshold comes from SetLogLevel() (the CLI sets it from --log-level);
// nothing here reads the environment. Thread-safe: each message is written with
// one write(2) call.
#ifndef EXL3SERVE_COMMON_LOGGING_H_
#define EXL3SERVE_COMMON_LOGGING_H_

#include <sstream>

namespace exl3serve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();

namespace internal {

// Collects one message and emits it on destruction; kFatal aborts afterwards.
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Swallows the stream when the level is below the threshold.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace exl3serve

#define EXL3_LOG(level)                                                              \
  (::exl3serve::LogLevel::level < ::exl3serve::GetLogLevel())                        \
      ? (void)0                                                                      \
      : ::exl3serve::internal::LogVoidify() &                                        \
            ::exl3serve::internal::LogMessage(::exl3serve::LogLevel::level, __FILE__, \
                                              __LINE__)                              \
                .stream()

#define EXL3_CHECK(cond)                                                                    \
  (cond) ? (void)0                                                                          \
         : ::exl3serve::internal::LogVoidify() &                                            \
               ::exl3serve::internal::LogMessage(::exl3serve::LogLevel::kFatal, __FILE__,   \
                                                 __LINE__)                                  \
                       .stream()                                                            \
                   << "CHECK failed: " #cond " "

#endif  // EXL3SERVE_COMMON_LOGGING_H_
