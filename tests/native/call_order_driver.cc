// Test driver of ffi/runtime/call_order.h (tests/test_call_order.py): reads "rank run tag
// [captured]" lines, the calls of one workspace in the order the ranks' hosts issue them, and
// prints for each one "<same> <reported>": 1 if it is the same logical call as the first rank's
// call of its number, and 1 if this call's line carries the report of a difference.
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "runtime/call_order.h"

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2;
  jaxoverlap::CallOrder order;
  std::string line, why;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    int rank, captured = 0;
    long long run, tag;
    if (!(in >> rank >> run >> tag)) continue;
    in >> captured;
    const bool same = order.issue(rank, n, jaxoverlap::CallId{run, tag, captured != 0}, &why);
    std::cout << (same ? 1 : 0) << ' ' << (why.empty() ? 0 : 1) << '\n';
    if (!why.empty()) std::cerr << why << '\n';
  }
  return 0;
}
