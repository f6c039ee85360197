/* A host crash's native stack on stderr (issue 25: sanitizer workers that died without a line).
 * LD_PRELOAD it: a constructor installs handlers for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT
 * that print the signal, the faulting address and the stack (glibc backtrace), then die of the
 * same signal. Handlers installed later (Python's faulthandler, a tool's) run first and chain to
 * it, or replace it. Every thread gets an alternate signal stack (pthread_create is wrapped), so
 * a thread's stack overflow still prints: without one, a SIGSEGV from an overflow in a thread
 * that is not Python's main thread kills the process without a line (faulthandler's own
 * alternate stack serves the thread that enabled it only).
 *   gcc -O1 -g -shared -fPIC -o build/probes/libcrash_backtrace.so tools/probes/crash_backtrace.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { kAltStack = 1 << 16 };

/* The calling thread's alternate signal stack (leaked with the thread: a diagnostic build). */
static void alt_stack(void) {
  stack_t ss;
  memset(&ss, 0, sizeof ss);
  ss.ss_sp = malloc(kAltStack);
  ss.ss_size = kAltStack;
  if (ss.ss_sp) sigaltstack(&ss, NULL);
}

struct start {
  void* (*fn)(void*);
  void* arg;
};

static void* with_alt_stack(void* p) {
  struct start s = *(struct start*)p;
  free(p);
  alt_stack();
  return s.fn(s.arg);
}

int pthread_create(pthread_t* t, const pthread_attr_t* attr, void* (*fn)(void*), void* arg) {
  static int (*real)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  if (!real) *(void**)&real = dlsym(RTLD_NEXT, "pthread_create");
  struct start* s = malloc(sizeof *s);
  if (!s) return real(t, attr, fn, arg);
  s->fn = fn;
  s->arg = arg;
  int r = real(t, attr, with_alt_stack, s);
  if (r) free(s);
  return r;
}

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
  alt_stack();
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; ++i) sigaction(sigs[i], &sa, NULL);
  void* warm[1];
  backtrace(warm, 1); /* loads libgcc_s now, not inside a signal handler */
}
