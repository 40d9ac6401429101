// Check kernels for csrc/dkv_cluster.cuh: clusters of two blocks of 128 threads. Written with the
// project's device abstractions so that the same source runs on an sm_90 GPU (tests/gpu/cluster_check.cu,
// tests/gpu/test_cluster_gpu.py) and on the CPU emulation (-DDKV_EMULATE: csrc/emulation/emulate.py
// --cluster). Not part of the extension.
//
//   pair_sum    the exchange a paired-block dQ would make: each block holds a 64 x 64 fp32 tile per round
//               and owns half of its columns; it sends the other half into the peer's staging buffer by
//               st.async (counted on the peer's mbarrier), the owner adds its own half on top and writes
//               the sum, then frees the peer's next send by an arrival on the peer's barrier. Several
//               rounds, so the barriers' phases and the announcement racing the peer's bytes are exercised.
//   multicast   one block's bulk tensor copy lands in both blocks (round r issued by block r % 2); each
//               block writes out what it received.
#pragma once

#include <cstdint>

#include "dkv_cluster.cuh"

namespace dkv {
namespace cluster_check {

constexpr int kT = 64;                            // tile side
constexpr int kHalf = kT / 2;                     // the columns one block owns
constexpr int kStageBytes = kT * kHalf * 4;       // a half tile of fp32
constexpr int kBoxBytes = kT * kT * 2;            // a 64 x 64 bf16 box
constexpr int kSmemBytes = kStageBytes + kBoxBytes + 64 + 1024;  // staging, box, barriers, alignment

struct PairArgs {
  const float* a;  // (rounds, 2, 64, 64): round r's tile of block b at a[r][b]
  float* out;      // (rounds, 64, 64): a[r][0] + a[r][1]
  int rounds;
  int announce;    // the bytes each block announces per round (kStageBytes; fewer, with one round, plants a bug)
};

struct MulticastArgs {
  TmaDesc src;     // a (rows, 1, 64) bf16 tensor in boxes of 64 rows (encode_tma_desc)
  uint16_t* out;   // (rounds, 2, 64, 64): rows 64 r .. 64 r + 63 of the tensor as block b received them
  int rounds;
};

DKV_GLOBAL void DKV_CLUSTER_DIMS(2) DKV_LAUNCH_BOUNDS(128) pair_sum(const DKV_GRID_CONSTANT PairArgs p) {
  unsigned char* smem = sm90::dynamic_smem_1024();
  float* stage = reinterpret_cast<float*>(smem);  // 64 rows x 32 columns: the owned half, from the peer
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStageBytes + kBoxBytes);  // the peer's half landed
  uint64_t* freed = full + 1;  // (the sender's barrier) the peer has read what this block sent
  const int rank = sm90::cluster_rank(), peer = rank ^ 1;
  const int t = thread_idx(), row = t / 2, half = t % 2;
  const bool owner = half == rank;
  if (t == 0) {
    sm90::mbar_init(full, 1);
    sm90::mbar_init(freed, kT);  // the peer's 64 owner threads
    sm90::fence_mbar_init_cluster();
  }
  sm90::cluster_sync();
  const sm90::RemoteSmem peer_stage = sm90::remote(stage, peer), peer_full = sm90::remote(full, peer);
  const sm90::RemoteSmem peer_freed = sm90::remote(freed, peer);
  for (int r = 0; r < p.rounds; ++r) {
    const float* mine = p.a + ((static_cast<int64_t>(r) * 2 + rank) * kT + row) * kT + kHalf * half;
    // An owner announces: a sender could run a round ahead and announce into the phase still open.
    if (t == rank) sm90::mbar_arrive_expect_tx(full, p.announce);
    // (the planted bug) announced before any byte lands, so that the count deterministically ends below
    // zero instead of, with the bytes first, never reaching it (a hang)
    if (p.announce != kStageBytes) sm90::cluster_sync();
    if (!owner) {
      if (r > 0) sm90::mbar_wait(freed, (r - 1) & 1);
      for (int c = 0; c < kHalf; c += 4)
        sm90::st_async_f32x4(sm90::offset(peer_stage, (row * kHalf + c) * 4), mine[c], mine[c + 1], mine[c + 2], mine[c + 3],
                             peer_full);
    } else {
      sm90::mbar_wait(full, r & 1);
      float* o = p.out + (static_cast<int64_t>(r) * kT + row) * kT + kHalf * half;
      for (int c = 0; c < kHalf; ++c) o[c] = mine[c] + stage[row * kHalf + c];
      sm90::mbar_arrive_remote(peer_freed);
    }
  }
  sm90::cluster_sync();  // no block leaves while its peer may still reach its shared memory
}

DKV_GLOBAL void DKV_CLUSTER_DIMS(2) DKV_LAUNCH_BOUNDS(128) multicast(const DKV_GRID_CONSTANT MulticastArgs p) {
  unsigned char* smem = sm90::dynamic_smem_1024();
  uint16_t* tile = reinterpret_cast<uint16_t*>(smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kBoxBytes);
  const int rank = sm90::cluster_rank(), t = thread_idx();
  if (t == 0) {
    sm90::mbar_init(bar, 1);
    sm90::fence_mbar_init_cluster();
  }
  sm90::cluster_sync();
  for (int r = 0; r < p.rounds; ++r) {
    if (t == 0) {
      sm90::mbar_arrive_expect_tx(bar, kBoxBytes);
      if (rank == r % 2) sm90::tma_load_box_multicast(tile, p.src, 0, 0, kT * r, bar, 0b11);
    }
    sm90::mbar_wait(bar, r & 1);
    uint16_t* o = p.out + (static_cast<int64_t>(r) * 2 + rank) * kT * kT;
    for (int i = t; i < kT * kT; i += 128) o[i] = tile[sm90::sw128_offset(i / kT, i % kT) / 2];
    sm90::cluster_sync();  // both blocks have read the tile before the next round lands on it
  }
}

}  // namespace cluster_check
}  // namespace dkv
