// Prints the workspace pool's decisions (ffi/runtime/ws_class.h) for tests/test_ws_class.py:
//   class BYTES            -> "class BYTES CLASS" for each BYTES argument
//   key SITE BYTES EXACT   -> "key SITE' BYTES' EXACT'" (group {0, 1}, partials, no gather)
//   min / cap              -> the constants
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "runtime/ws_class.h"

using jaxoverlap::WsKey;

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "class") && i + 1 < argc) {
      const long long b = std::atoll(argv[++i]);
      std::printf("class %lld %lld\n", b, (long long)jaxoverlap::size_class(b));
    } else if (!std::strcmp(argv[i], "key") && i + 3 < argc) {
      const WsKey k{std::atoll(argv[i + 1]), {0, 1}, std::atoll(argv[i + 2]), true, false,
                    std::atoi(argv[i + 3]) != 0};
      const WsKey p = jaxoverlap::pool_key(k);
      const bool same_as_self = !(p < jaxoverlap::pool_key(k)) && !(jaxoverlap::pool_key(k) < p);
      std::printf("key %lld %lld %d %d\n", (long long)p.site, (long long)p.block_bytes,
                  (int)p.exact, (int)same_as_self);
      i += 3;
    } else if (!std::strcmp(argv[i], "min")) {
      std::printf("min %lld\n", (long long)jaxoverlap::kMinClassBytes);
    } else if (!std::strcmp(argv[i], "cap")) {
      std::printf("cap %d\n", jaxoverlap::kMaxExactWorkspaces);
    } else {
      std::fprintf(stderr, "bad argument %s\n", argv[i]);
      return 2;
    }
  }
  return 0;
}
