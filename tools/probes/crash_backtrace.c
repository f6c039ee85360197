/* A host crash's native stack on stderr (issue 25: sanitizer workers that died without a line).
 * LD_PRELOAD it: a constructor installs handlers for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT
 * that print the signal, the faulting address and the stack (glibc backtrace), then die of the
 * same signal. Handlers installed later (Python's faulthandler, a tool's) run first and chain to
 * it, or replace it.
 *   gcc -O1 -g -shared -fPIC -o build/probes/libcrash_backtrace.so tools/probes/crash_backtrace.c
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig, siginfo_t* info, void* ctx) {
  (void)ctx;
  char line[160];
  int n = snprintf(line, sizeof line, "\n[crash_backtrace] pid %d: signal %d (%s), address %p\n",
                   (int)getpid(), sig, strsignal(sig), info ? info->si_addr : NULL);
  if (n > 0) (void)!write(2, line, (size_t)n);
  void* frames[64];
  int k = backtrace(frames, 64);
  backtrace_symbols_fd(frames, k, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  static const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; ++i) sigaction(sigs[i], &sa, NULL);
  void* warm[1];
  backtrace(warm, 1); /* loads libgcc_s now, not inside a signal handler */
}
