// One error family for the host side: an exception carrying a mokResult_t and a message
// that names what is wrong.  The C ABI (src/capi) turns it into a result code and the
// thread's last-error string; nothing throws across the ABI.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "mok/mok.h"

namespace mok {

class Error : public std::runtime_error {
 public:
  Error(mokResult_t code, const std::string& what) : std::runtime_error(what), code_(code) {}
  mokResult_t code() const { return code_; }

 private:
  mokResult_t code_;
};

}  // namespace mok

// MOK_FAIL(code, a << b << c): throw mok::Error with a streamed message.
#define MOK_FAIL(code, stream_expr)                 \
  do {                                              \
    std::ostringstream mok_fail_os_;                \
    mok_fail_os_ << stream_expr;                    \
    throw ::mok::Error((code), mok_fail_os_.str()); \
  } while (0)

// Argument checks: an invalid argument, detected before any launch.
#define MOK_CHECK_ARG(cond, stream_expr) \
  do {                                   \
    if (!(cond)) MOK_FAIL(mokInvalidArgument, stream_expr); \
  } while (0)

// Internal invariants: file:line in the message, since they are our bugs.
#define MOK_ASSERT(cond)                                                                       \
  do {                                                                                         \
    if (!(cond)) MOK_FAIL(mokInternalError, __FILE__ << ":" << __LINE__ << ": assertion `" #cond "` failed"); \
  } while (0)
