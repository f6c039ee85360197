// Stock CUTLASS against our tile kernel as plain GEMMs, on ONE GPU (issue 23): is the gap to
// cuBLASLt CUTLASS's mainloop, or our scheduler and epilogue?
//
//   tile_stock_probe FILE [--json OUT] [--rounds R]: per shape of FILE (tools/shapes.py lines,
//   "<set> <tp> M K N"; w row-major), timed interleaved (BENCHMARKS.md: every variant in turn,
//   R rounds (default 9) of ~5 ms each, median; spread = (max - min) / median):
//     ref       the GEMM runner's searched cuBLASLt plan (ffi/runtime/gemm.h)
//     ours:E    menu entry E of the tile kernel as a plain GEMM (mode 2: our ClaimScheduler and
//               TileEpilogue, no communication) at raster band 1 and 8
//     stock:S   stock CUTLASS 4.2 (stock/stock_gemm.cuh: the collective builders' TMA mainloop
//               and TMA warp-specialised epilogue, CUTLASS's persistent or stream-K scheduler)
//               at max_swizzle_size 1 and 8, raster heuristic
//     hybrid:S  our TileKernel (mainloop + TileEpilogue, plain) with CUTLASS's persistent
//               scheduler instead of ours (stock/hybrid_gemm.cuh), the same swizzles
//     var:S     our TileKernel with an experiment variant of our scheduler (stock_api.h's
//               VARIANT_LIST; hybv1: a static order, no counter, no ring; hybv2: that order
//               through the claim ring), at raster band 1, 8
//     hybridF:, varF:  the same followed by our launches' epoch advance kernel (as ours are)
//   Each variant's output is first checked against cuBLASLt's (max |diff| / max |ref|).
//   --order shuffle (default) | fixed: each round runs the variants in a fresh random order
//   (seeded), or always in the order above. Fixed order biased the comparison: the same launch
//   measured 0.96 right after cuBLASLt and 1.12 later in the round (tile_rs_probe, long K).
//   After every sample a one-thread kernel reads the SM clock (clock64 over 20 us of
//   %globaltimer); each variant prints the median clock after its samples ("end") and after the
//   sample before them ("start").
//   --only A,B,...: only the variants whose name contains one of the substrings (and ref);
//   --dup: the first "ours" variant twice (named ...#2): the same launch, two positions.
//   --epi V,W,...: "ours" with each TileRsArgs::epi value (default 0; named ours:E/swS/epiV for
//   V != 0; e.g. 4 = kTileEpiTensorStores, 1 = the ping-pong entries' lanes' stores -- in tools
//   builds with -DJAXOVERLAP_TILE_PP_TENSOR_ONLY=0 only: the default build's ping-pong kernels
//   have one store path and ignore the bits).
//   (--epi applies to the hybrids and the variants as well.)
//   --mode M,N,...: "ours", the hybrids and the variants in each TileRsArgs::mode (default 2;
//   named .../m<M> for M != 2): 9 = the plain GEMM whose epilogue stores nothing (its output is
//   not checked), which separates the stores' cost from the scheduler's and the mainloop's.
//   --prof: no timing; per shape one launch of cuBLASLt, ours at band 8 and stock at swizzle 1
//   (with --only: every variant it names, at the swizzle it names) between
//   cudaProfilerStart/Stop (ncu --profile-from-start off), after two unprofiled ones.
//   Build: STOCK=1 tools/probes/build_tile_rs_probe.sh (CPU machine).
#include <cuda_bf16.h>
#include <random>
#include <cuda_profiler_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/fill.h"
#include "kernels/tile_rs.h"
#include "probe_check.h"
#include "runtime/gemm.h"
#include "stock/stock_api.h"

using namespace jaxoverlap;

namespace {

struct Variant {
  std::string name;
  std::function<cudaError_t()> run;
};

struct StockEntry {
  const char* name;
  stock::Run run;
};
#define STOCK_ENTRY(NAME, ...) {#NAME, stock::run_##NAME},
#define HYBRID_ENTRY(NAME, ...) {#NAME, stock::run_##NAME},
const StockEntry kStock[] = {STOCK_LIST(STOCK_ENTRY) HYBRID_LIST(HYBRID_ENTRY)
                                 VARIANT_LIST(HYBRID_ENTRY)};
#undef HYBRID_ENTRY
#undef STOCK_ENTRY

double geomean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += std::log(x);
  return v.empty() ? NAN : std::exp(s / v.size());
}

// out[0] = max |a - b|, out[1] = max |b| over n bf16 values (as float bits: non-negative floats
// order as unsigned ints); a non-finite a counts as +inf.
__global__ void diff_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                            unsigned* out) {
  float d = 0, mx = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    d = fmaxf(d, isfinite(x) ? fabsf(x - y) : INFINITY);
    mx = fmaxf(mx, fabsf(y));
  }
  atomicMax(out, __float_as_uint(d));
  atomicMax(out + 1, __float_as_uint(mx));
}

// The SM clock: cycles (clock64) over ~20 us of %globaltimer, one thread.
__global__ void clock_kernel(unsigned long long* out) {
  unsigned long long t0, t1;
  const long long c0 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  } while (t1 - t0 < 20000);
  const long long c1 = clock64();
  out[0] = (unsigned long long)(c1 - c0);
  out[1] = t1 - t0;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2) {
    std::printf("usage: tile_stock_probe FILE [--json OUT] [--rounds R] [--order shuffle|fixed] "
                "[--only A,B,...] [--dup] [--epi V,W,...] [--mode M,N,...] [--prof]\n");
    return 2;
  }
  const char* json = nullptr;
  int rounds = 9;
  bool prof = false, shuffle = true, dup = false;
  std::vector<std::string> only;
  std::vector<int> epis = {0}, modes = {2};
  auto int_list = [](const char* c) {
    std::vector<int> v;
    while (*c) {
      v.push_back(std::atoi(c));
      while (*c && *c != ',') ++c;
      if (*c) ++c;
    }
    return v;
  };
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--prof") prof = true;
    else if (arg == "--dup") dup = true;
    else if (arg == "--json" && i + 1 < argc) json = argv[++i];
    else if (arg == "--rounds" && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (arg == "--order" && i + 1 < argc) shuffle = std::string(argv[++i]) != "fixed";
    else if (arg == "--epi" && i + 1 < argc) epis = int_list(argv[++i]);
    else if (arg == "--mode" && i + 1 < argc) modes = int_list(argv[++i]);
    else if (arg == "--only" && i + 1 < argc) {
      std::string l = argv[++i];
      for (size_t a = 0, b; a <= l.size(); a = b + 1) {
        b = l.find(',', a);
        if (b == std::string::npos) b = l.size();
        if (b > a) only.push_back(l.substr(a, b - a));
      }
    } else {
      std::printf("unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  auto wanted = [&](const std::string& name) {
    if (only.empty()) return true;
    for (const std::string& o : only)
      if (name.find(o) != std::string::npos) return true;
    return false;
  };
  unsigned long long* dclock;
  CK(cudaMalloc(&dclock, 16));
  CK(cudaSetDevice(0));
  const int E = tile_rs_menu_size();
  for (int e = 0; e < E; ++e) CK(preload_tile_entry(e, false));
  GemmRunner lt;
  if (std::string e = lt.init(); !e.empty()) {
    std::printf("cuBLASLt: %s\n", e.c_str());
    return 1;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t ws_bytes = 64 << 20;  // stream-K's partials
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  FILE* jf = json ? std::fopen(json, "w") : nullptr;
  if (jf)
    std::fprintf(jf,
                 "{\"tool\": \"tools/probes/tile_stock_probe.cu\", \"rounds\": %d, \"order\": \"%s\", "
                 "\"rows\": [",
                 rounds, shuffle ? "shuffle" : "fixed");
  std::vector<std::string> names;
  std::vector<std::vector<double>> ratios;  // per variant, per judged shape: ms / ref
  FILE* f = std::fopen(argv[1], "r");
  if (!f) {
    std::printf("cannot read %s\n", argv[1]);
    return 2;
  }
  char set[64];
  int tp;
  long long M, K, N;
  bool first_row = true;
  while (std::fscanf(f, "%63s %d %lld %lld %lld", set, &tp, &M, &K, &N) == 5) {
    const int64_t m = M / tp;
    if (!tile_rs_unsupported(DType::kBF16, tp, m, N, K, nullptr, nullptr, nullptr).empty() ||
        M % tp) {
      std::printf("skipped %s %lld %lld %lld\n", set, M, K, N);
      continue;
    }
    __nv_bfloat16 *x, *w, *out;
    CK(cudaMalloc(&x, M * K * 2));
    CK(cudaMalloc(&w, K * N * 2));
    CK(cudaMalloc(&out, M * N * 2));
    CK(launch_fill_uniform(x, M * K, FillType::kBF16, 5, nullptr));
    CK(launch_fill_uniform(w, K * N, FillType::kBF16, 7, nullptr));
    // Our kernel's claim counters and epoch (mode 2 uses no staging); the hybrids and variants
    // get their own: their epoch advances (the F variants) must not touch ours, whose claim
    // counter of a call is reset by the call before it (two advances in a row without a launch
    // of ours between them leave it exhausted: the launch then computes nothing).
    Flags *flags, *hflags;
    CK(cudaMalloc(&flags, sizeof(Flags)));
    CK(cudaMemset(flags, 0, sizeof(Flags)));
    CK(cudaMalloc(&hflags, sizeof(Flags)));
    CK(cudaMemset(hflags, 0, sizeof(Flags)));
    char* stage;
    const int64_t stage_bytes = (tp - 1) * tile_rs_slot_bytes(m, N);
    CK(cudaMalloc(&stage, stage_bytes));
    CK(cudaMemset(stage, 0, stage_bytes));
    CK(cudaDeviceSynchronize());
    const GemmShape gs{M, N, K, DType::kBF16, false, 0, false};
    std::vector<Variant> vs;
    vs.push_back({"ref", [&] {
                    std::string e = lt.run(gs, x, w, nullptr, out, s);
                    return e.empty() ? cudaSuccess : cudaErrorUnknown;
                  }});
    for (int e = 0; e < E; ++e)
      for (int sw : {1, 8})
      for (int epi : epis)
      for (int mode : modes) {
        TileRsArgs a{};
        a.peers.n = tp;
        a.peers.rank = 0;
        a.peers.device = 0;
        for (int r = 0; r < tp; ++r) a.peers.stage[r] = stage, a.peers.flags[r] = flags;
        a.x = x, a.w = w, a.out = out, a.m = m, a.N = N, a.K = K;
        a.dtype = DType::kBF16;
        a.slot_bytes = tile_rs_slot_bytes(m, N);
        a.sm_count = sms, a.swizzle = sw, a.entry = e, a.mode = mode, a.stall_rank = -1;
        a.op = kOpGemmRs;
        a.epi = epi;
        a.timeout_ns = 2000000000ull;
        const std::string name = std::string("ours:") + tile_rs_entry_name(e) + "/sw" +
                                 std::to_string(sw) + (epi ? "/epi" + std::to_string(epi) : "") +
                                 (mode != 2 ? "/m" + std::to_string(mode) : "");
        if (!wanted(name)) continue;
        // (the kernel ends the call itself: the emulated peers' release, the epoch)
        vs.push_back({name, [&, a] { return launch_tile_rs(a, s); }});
      }
    for (const StockEntry& se : kStock)
      for (int sw : {1, 8})
      for (int epi : epis)
      for (int mode : modes) {
        const std::string kind = std::string(se.name).rfind("hybv", 0) == 0 ? "var"
                                 : se.name[0] == 'h'                        ? "hybrid"
                                                                            : "stock";
        // stock kernels have neither store paths nor modes
        if (kind == "stock" && (mode != modes[0] || epi != epis[0])) continue;
        stock::Problem p{x, w, out, M, N, K, sms, sw, 0, ws, ws_bytes, hflags, mode, epi};
        const std::string tail =
            std::string(se.name) + "/sw" + std::to_string(sw) +
            (kind != "stock" && epi ? "/epi" + std::to_string(epi) : "") +
            (kind != "stock" && mode != 2 ? "/m" + std::to_string(mode) : "");
        if (wanted(kind + ":" + tail))
          vs.push_back({kind + ":" + tail, [&s, p, run = se.run] { return run(p, s); }});
        // the hybrids and variants with the epoch's advance after each, by a kernel (as ours
        // until session 12, when our kernel took it over: tile_rs.cuh, end_call)
        if (kind != "stock" && wanted(kind + "F:" + tail))
          vs.push_back({kind + "F:" + tail, [&s, p, tp, hflags, run = se.run] {
                          if (cudaError_t err = run(p, s)) return err;
                          return tile_rs_finish_emulated(hflags, tp, s);
                        }});
      }
    if (dup)  // the same launch twice, at two positions of a fixed order
      for (size_t v = 1; v < vs.size(); ++v)
        if (vs[v].name.rfind("ours:", 0) == 0) {
          vs.push_back({vs[v].name + "#2", vs[v].run});
          break;
        }
    // Correctness against cuBLASLt, and which variants can run this shape.
    __nv_bfloat16* ref_out;
    CK(cudaMalloc(&ref_out, M * N * 2));
    unsigned *dd, hd[2];
    CK(cudaMalloc(&dd, 8));
    std::vector<bool> ok(vs.size(), true);
    std::printf("%s tp %d %lld x %lld x %lld:", set, tp, M, K, N);
    for (size_t v = 0; v < vs.size(); ++v) {
      CK(cudaMemsetAsync(out, 0xff, M * N * 2, s));  // NaN: an unwritten element shows
      cudaError_t err = vs[v].run();
      if (err == cudaSuccess) err = cudaStreamSynchronize(s);
      if (err != cudaSuccess) {
        std::printf(" [%s cannot run: %s]", vs[v].name.c_str(), cudaGetErrorString(err));
        (void)cudaGetLastError();
        ok[v] = false;
        continue;
      }
      if (v == 0) {
        CK(cudaMemcpy(ref_out, out, M * N * 2, cudaMemcpyDeviceToDevice));
        continue;
      }
      if (vs[v].name.find("/m9") != std::string::npos) continue;  // stores nothing: unchecked
      CK(cudaMemsetAsync(dd, 0, 8, s));
      diff_kernel<<<1024, 256, 0, s>>>(out, ref_out, M * N, dd);
      CK(cudaMemcpyAsync(hd, dd, 8, cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      float fd, fm;
      std::memcpy(&fd, &hd[0], 4), std::memcpy(&fm, &hd[1], 4);
      const double d = fd / (fm > 0 ? fm : 1);
      if (!(d < 1e-2)) {
        std::printf(" [%s WRONG: %.2e]", vs[v].name.c_str(), d);
        ok[v] = false;
      }
    }
    std::printf("\n");
    cudaFree(ref_out), cudaFree(dd);
    if (prof) {
      std::vector<size_t> pv;
      for (size_t v = 0; v < vs.size(); ++v)
        if (ok[v] && (!only.empty() || v == 0 ||
                      vs[v].name.find(vs[v].name[0] == 'o' ? "/sw8" : "/sw1") != std::string::npos))
          pv.push_back(v);
      for (int i = 0; i < 2; ++i)
        for (size_t v : pv) CK(vs[v].run());
      CK(cudaStreamSynchronize(s));
      CK(cudaProfilerStart());
      std::printf("  profiled:");
      for (size_t v : pv) {
        CK(vs[v].run());
        CK(cudaStreamSynchronize(s));
        std::printf(" %s", vs[v].name.c_str());
      }
      CK(cudaProfilerStop());
      std::printf("\n");
      cudaFree(x), cudaFree(w), cudaFree(out), cudaFree(flags), cudaFree(hflags), cudaFree(stage);
      continue;
    }
    // ~5 ms per round of a variant
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(vs[0].run());
    CK(cudaEventRecord(a, s));
    CK(vs[0].run());
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float est = 1;
    CK(cudaEventElapsedTime(&est, a, b));
    const int reps = std::max(2, std::min(20, (int)(5.0f / std::max(est, 1e-3f))));
    for (size_t v = 0; v < vs.size(); ++v)
      for (int i = 0; ok[v] && i < std::max(2, reps / 4); ++i) CK(vs[v].run());
    std::vector<std::vector<float>> ts(vs.size());
    std::vector<std::vector<double>> mhz_end(vs.size()), mhz_start(vs.size());
    double last_mhz = NAN;
    std::vector<size_t> order(vs.size());
    for (int rep = 0; rep < rounds; ++rep) {
      for (size_t v = 0; v < vs.size(); ++v) order[v] = v;
      if (shuffle) {
        std::mt19937 rng(1000u * (unsigned)rep + (unsigned)(M ^ K ^ N));
        std::shuffle(order.begin(), order.end(), rng);
      }
      for (size_t v : order) {
        if (!ok[v]) continue;
        CK(cudaEventRecord(a, s));
        for (int i = 0; i < reps; ++i) CK(vs[v].run());
        CK(cudaEventRecord(b, s));
        clock_kernel<<<1, 1, 0, s>>>(dclock);
        unsigned long long hc[2];
        CK(cudaMemcpyAsync(hc, dclock, 16, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        ts[v].push_back(ms / reps);
        const double mhz = hc[1] ? 1e3 * (double)hc[0] / (double)hc[1] : NAN;
        mhz_end[v].push_back(mhz);
        if (!std::isnan(last_mhz)) mhz_start[v].push_back(last_mhz);
        last_mhz = mhz;
      }
    }
    cudaEventDestroy(a), cudaEventDestroy(b);
    std::vector<double> med(vs.size(), NAN), spread(vs.size(), NAN);
    for (size_t v = 0; v < vs.size(); ++v) {
      if (!ok[v]) continue;
      std::sort(ts[v].begin(), ts[v].end());
      med[v] = ts[v][ts[v].size() / 2];
      spread[v] = (ts[v].back() - ts[v].front()) / med[v];
    }
    const double flop = 2.0 * M * K * N;
    std::printf("  ref %.4f ms (%.0f%%), %.0f TFLOP/s, MHz start/end %.0f/%.0f\n", med[0],
                100 * spread[0], flop / med[0] * 1e-9, median(mhz_start[0]), median(mhz_end[0]));
    if (names.empty())
      for (auto& v : vs) names.push_back(v.name), ratios.emplace_back();
    for (size_t v = 1; v < vs.size(); ++v) {
      std::printf("  %-30s %s %.3f (%.0f%%) MHz %.0f/%.0f\n", vs[v].name.c_str(), ok[v] ? "" : "n/a",
                  med[v] / med[0], 100 * spread[v], median(mhz_start[v]), median(mhz_end[v]));
      if (flop >= 1e11 && ok[v] && v < ratios.size()) ratios[v].push_back(med[v] / med[0]);
    }
    if (jf) {
      std::fprintf(jf, "%s\n  {\"set\": \"%s\", \"tp\": %d, \"M\": %lld, \"K\": %lld, \"N\": %lld, \"ms\": {",
                   first_row ? "" : ",", set, tp, M, K, N);
      for (size_t v = 0; v < vs.size(); ++v)
        if (ok[v]) std::fprintf(jf, "%s\"%s\": %.5f", v ? ", " : "", vs[v].name.c_str(), med[v]);
      std::fprintf(jf, "}, \"mhz_end\": {");
      for (size_t v = 0; v < vs.size(); ++v)
        if (ok[v])
          std::fprintf(jf, "%s\"%s\": %.0f", v ? ", " : "", vs[v].name.c_str(), median(mhz_end[v]));
      std::fprintf(jf, "}, \"spread\": {");
      for (size_t v = 0; v < vs.size(); ++v)
        if (ok[v]) std::fprintf(jf, "%s\"%s\": %.3f", v ? ", " : "", vs[v].name.c_str(), spread[v]);
      std::fprintf(jf, "}}");
      std::fflush(jf);
      first_row = false;
    }
    cudaFree(x), cudaFree(w), cudaFree(out), cudaFree(flags), cudaFree(hflags), cudaFree(stage);
  }
  std::fclose(f);
  if (jf) std::fprintf(jf, "\n]}\n"), std::fclose(jf);
  std::printf("\ngeomean over judged shapes (2MKN >= 1e11), ms / ref (n: shapes):\n");
  for (size_t v = 1; v < names.size(); ++v)
    std::printf("STOCK %-28s %.3f (%zu)\n", names[v].c_str(), geomean(ratios[v]), ratios[v].size());
  return 0;
}
