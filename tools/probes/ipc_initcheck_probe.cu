// initcheck and another process's writes (issue 25): process B allocates a buffer and exports it
// (cudaIpcGetMemHandle); process A opens it and fills it with cudaMemcpy (its copy engine, as the
// copy-engine handlers' peers push into a rank's staging); then B reads every word in a kernel and
// checks the values. Run B under compute-sanitizer --tool initcheck: if initcheck reports B's
// reads as uninitialised although every value is right, another process's writes are invisible
// to it. Mode "self": B fills the buffer itself with the same cudaMemcpy (the control).
//
//   ipc_initcheck_probe b DIR [self]   (B: exports DIR/handle, waits for DIR/done, reads)
//   ipc_initcheck_probe a DIR          (A: opens DIR/handle, fills, writes DIR/done)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_) {                                                                        \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

constexpr int kWords = 1 << 16;  // 256 KiB of uint32

__global__ void check_kernel(const unsigned* buf, int n, unsigned* wrong) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    if (buf[i] != (unsigned)i * 2654435761u) atomicAdd(wrong, 1u);
}

static bool wait_file(const std::string& path, double seconds) {
  auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      std::fclose(f);
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string role = argv[1], dir = argv[2];
  const bool self = argc > 3 && std::strcmp(argv[3], "self") == 0;
  std::vector<unsigned> host(kWords);
  for (int i = 0; i < kWords; ++i) host[i] = (unsigned)i * 2654435761u;
  if (role == "b") {
    unsigned *buf = nullptr, *wrong = nullptr;
    CK(cudaMalloc(&buf, kWords * 4));
    CK(cudaMalloc(&wrong, 4));
    CK(cudaMemset(wrong, 0, 4));
    if (self) {
      CK(cudaMemcpy(buf, host.data(), kWords * 4, cudaMemcpyHostToDevice));
    } else {
      cudaIpcMemHandle_t h;
      CK(cudaIpcGetMemHandle(&h, buf));
      const std::string tmp = dir + "/handle.tmp";
      FILE* f = std::fopen(tmp.c_str(), "wb");
      std::fwrite(&h, sizeof(h), 1, f);
      std::fclose(f);
      std::rename(tmp.c_str(), (dir + "/handle").c_str());
      if (!wait_file(dir + "/done", 30)) {
        std::printf("b: no done from a\n");
        return 1;
      }
    }
    check_kernel<<<64, 256>>>(buf, kWords, wrong);
    unsigned w = 0;
    CK(cudaMemcpy(&w, wrong, 4, cudaMemcpyDeviceToHost));
    std::printf("b (%s) %s: %u of %d words wrong\n", self ? "self-written" : "written by process a",
                w == 0 ? "OK" : "FAILED", w, kWords);
    return w == 0 ? 0 : 1;
  }
  if (!wait_file(dir + "/handle", 30)) {
    std::printf("a: no handle from b\n");
    return 1;
  }
  cudaIpcMemHandle_t h;
  FILE* f = std::fopen((dir + "/handle").c_str(), "rb");
  if (std::fread(&h, sizeof(h), 1, f) != 1) return 1;
  std::fclose(f);
  void* peer = nullptr;
  CK(cudaIpcOpenMemHandle(&peer, h, cudaIpcMemLazyEnablePeerAccess));
  CK(cudaMemcpy(peer, host.data(), kWords * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  CK(cudaIpcCloseMemHandle(peer));
  if (FILE* d = std::fopen((dir + "/done").c_str(), "wb")) std::fclose(d);
  std::printf("a: filled process b's buffer\n");
  return 0;
}
