// sm_90a build of csrc/dkv_cluster_check.cuh for tests/gpu/test_cluster_gpu.py: host launchers, one
// cluster of two blocks of 128 threads each, raw device pointers; each returns the launch status.
#include "dkv_cluster_check.cuh"
#include "dkv_tma.cu"

namespace cc = dkv::cluster_check;

extern "C" int dkv_check_cluster_pair_sum(const float* a, float* out, int rounds, cudaStream_t stream) {
  const cc::PairArgs p{a, out, rounds, cc::kStageBytes};
  cc::pair_sum<<<2, 128, cc::kSmemBytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

// src: a (rows, 64) bf16 tensor; returns the encoder's status when it fails, else the launch status.
extern "C" int dkv_check_cluster_multicast(void* src, int64_t rows, uint16_t* out, int rounds, cudaStream_t stream) {
  cc::MulticastArgs p{};
  const int status = dkv::encode_tma_desc(p.src, src, true, rows, 1, cc::kT, cc::kT, cc::kT * rows, cc::kT);
  if (status != 0) return status;
  p.out = out;
  p.rounds = rounds;
  cc::multicast<<<2, 128, cc::kSmemBytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}
