// libmok.so is mok_core linked whole; this file gives the shared library a source and checks
// that mok.h's version string and numbers agree (CMake and pyproject.toml read the same lines).
#include "mok/mok.h"

namespace {
constexpr bool same(const char* a, const char* b) { return *a == *b && (*a == '\0' || same(a + 1, b + 1)); }
#define MOK_STR2(x) #x
#define MOK_STR(x) MOK_STR2(x)
static_assert(same(MOK_VERSION_STRING, MOK_STR(MOK_VERSION_MAJOR) "." MOK_STR(MOK_VERSION_MINOR) "." MOK_STR(
                                           MOK_VERSION_PATCH)),
              "MOK_VERSION_STRING must equal MOK_VERSION_MAJOR.MINOR.PATCH");
#undef MOK_STR
#undef MOK_STR2
}  // namespace
