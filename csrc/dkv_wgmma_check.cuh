// Check kernels for csrc/dkv_wgmma.cuh: one warpgroup (128 threads), 64 x 64 bf16 tiles staged in
// 128B-swizzled shared memory. Written with dkv_device.cuh's abstractions so that the same source
// runs on an sm_90 GPU (tests/gpu/wgmma_check.cu, tests/gpu/test_wgmma_gpu.py) and on the CPU
// emulation (-DDKV_EMULATE: csrc/emulation/emulate.py --wgmma). Not part of the extension.
//
//   gemm_ss<kTransB>   D = A B^T (kTransB = 0: B given as N x K rows) or D = A B (1: B given as K x N rows)
//   gemm_rs            D = A B^T with A from registers
//   gemm_rs_wide       D (64 x 128) = A [B | C] with A from registers and [B | C] one MN-major operand of
//                      two 64-column parts (m64n128, wgmma_rs_mn_parts: the P V / dV / dK products)
//   attention_step     O = bf16(Q K^T) V: S from SS (K-major K), P re-packed in registers, O from RS
//                      with V as an MN-major operand -- the inner step of a wgmma attention kernel.
// Inputs are row-major 64 x 64 bf16 (raw uint16_t), outputs 64 x 64 (gemm_rs_wide: 64 x 128) fp32 row-major.
#pragma once

#include <cstdint>

#include "dkv_tile.cuh"
#include "dkv_wgmma.cuh"

namespace dkv {
namespace wgmma_check {

constexpr int kT = 64;                          // tile side
constexpr int kTileBytes = kT * kT * 2;         // one bf16 tile
constexpr int kSmemBytes = 3 * kTileBytes + 1024;  // three tiles, plus room to align to 1024 bytes

DKV_DEV uint16_t* aligned_smem() { return reinterpret_cast<uint16_t*>(sm90::dynamic_smem_1024()); }

DKV_DEV void load_tile_sw128(uint16_t* smem, const uint16_t* src) {
  for (int idx = thread_idx(); idx < kT * kT; idx += 128) {
    const int r = idx / kT, c = idx % kT;
    smem[sm90::sw128_offset(r, c) / 2] = src[idx];
  }
}

DKV_DEV void smem_to_async_proxy() {
  sm90::fence_smem_to_async_proxy();
  block_sync();
}

DKV_DEV void store_acc(float* out, const float (&d)[32]) {
  const int warp = thread_idx() / 32, lane = thread_idx() % 32;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * warp + lane / 4 + 8 * (i / 2), col = 8 * j + 2 * (lane % 4) + (i % 2);
      out[row * kT + col] = d[4 * j + i];
    }
}

DKV_DEV uint32_t pack_halves(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (uint32_t(hi) << 16); }

DKV_DEV void zero32(float (&d)[32]) {
  for (float& x : d) x = 0.f;
}

struct Args {
  const uint16_t* a;
  const uint16_t* b;
  const uint16_t* c;
  float* out;
};

// d = A B^T (kTransB = 0: B as N x K rows) or A B (1: B as K x N rows), both operands swizzled tiles.
template <int kTransB>
DKV_DEV void ss_product(float (&d)[32], uint16_t* sA, uint16_t* sB) {
  zero32(d);
  sm90::wgmma_fence();
  for (int s = 0; s < kT / 16; ++s) {
    const uint64_t da = sm90::smem_desc_sw128(reinterpret_cast<char*>(sA) + 32 * s);
    const uint64_t db = kTransB ? sm90::smem_desc_sw128_mn64(reinterpret_cast<char*>(sB) + 2048 * s)
                                : sm90::smem_desc_sw128(reinterpret_cast<char*>(sB) + 32 * s);
    sm90::wgmma_m64n64k16_ss<Bf16, kTransB>(d, da, db, s > 0);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
}

template <int kTransB>
DKV_GLOBAL void gemm_ss(const DKV_GRID_CONSTANT Args p) {
  uint16_t* sA = aligned_smem();
  uint16_t* sB = sA + kT * kT;
  load_tile_sw128(sA, p.a);
  load_tile_sw128(sB, p.b);
  smem_to_async_proxy();
  float d[32];
  ss_product<kTransB>(d, sA, sB);
  store_acc(p.out, d);
}

DKV_GLOBAL void gemm_rs(const DKV_GRID_CONSTANT Args p) {
  uint16_t* sB = aligned_smem();
  load_tile_sw128(sB, p.b);
  smem_to_async_proxy();
  const int warp = thread_idx() / 32, lane = thread_idx() % 32, g = lane / 4, t = lane % 4;
  const uint16_t* rows = p.a + (16 * warp + g) * kT;
  float d[32];
  zero32(d);
  for (int s = 0; s < kT / 16; ++s) {
    const int k0 = 16 * s + 2 * t;
    const uint32_t frag[4] = {pack_halves(rows[k0], rows[k0 + 1]), pack_halves(rows[8 * kT + k0], rows[8 * kT + k0 + 1]),
                              pack_halves(rows[k0 + 8], rows[k0 + 9]),
                              pack_halves(rows[8 * kT + k0 + 8], rows[8 * kT + k0 + 9])};
    sm90::wgmma_fence();  // the fragment registers were just written
    sm90::wgmma_m64n64k16_rs<Bf16, 0>(d, frag, sm90::smem_desc_sw128(reinterpret_cast<char*>(sB) + 32 * s), s > 0);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  store_acc(p.out, d);
}

// The mma.sync m16n8k16 A fragment of k16 step s from a row-major 64 x 64 tile (this warp's 16 rows).
DKV_DEV void a_fragment(uint32_t (&frag)[4], const uint16_t* a, int s) {
  const int warp = thread_idx() / 32, lane = thread_idx() % 32, g = lane / 4, t = lane % 4;
  const uint16_t* rows = a + (16 * warp + g) * kT;
  const int k0 = 16 * s + 2 * t;
  frag[0] = pack_halves(rows[k0], rows[k0 + 1]);
  frag[1] = pack_halves(rows[8 * kT + k0], rows[8 * kT + k0 + 1]);
  frag[2] = pack_halves(rows[k0 + 8], rows[k0 + 9]);
  frag[3] = pack_halves(rows[8 * kT + k0 + 8], rows[8 * kT + k0 + 9]);
}

DKV_GLOBAL void gemm_rs_wide(const DKV_GRID_CONSTANT Args p) {
  uint16_t* sB = aligned_smem();  // part 0 (columns 0 .. 63) = B, part 1 = C, kTileBytes apart
  load_tile_sw128(sB, p.b);
  load_tile_sw128(sB + kT * kT, p.c);
  smem_to_async_proxy();
  float d[2][32];
  zero32(d[0]);
  zero32(d[1]);
  for (int s = 0; s < kT / 16; ++s) {
    uint32_t frag[4];
    a_fragment(frag, p.a, s);
    sm90::wgmma_fence();  // the fragment registers were just written
    const uint64_t db = sm90::smem_desc_sw128_mn(reinterpret_cast<char*>(sB) + 2048 * s, kTileBytes);
    sm90::wgmma_rs_mn_parts<Bf16, 2>(d, frag, db, kTileBytes);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  float part_acc[32];
  for (int part = 0; part < 2; ++part) {  // columns 64 part ..: stored through a 64 x 64 view
    for (int i = 0; i < 32; ++i) part_acc[i] = d[part][i];
    const int warp = thread_idx() / 32, lane = thread_idx() % 32;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) {
        const int row = 16 * warp + lane / 4 + 8 * (i / 2), col = 8 * j + 2 * (lane % 4) + (i % 2);
        p.out[row * 2 * kT + 64 * part + col] = part_acc[4 * j + i];
      }
  }
}

DKV_GLOBAL void attention_step(const DKV_GRID_CONSTANT Args p) {
  uint16_t* sQ = aligned_smem();
  uint16_t* sK = sQ + kT * kT;
  uint16_t* sV = sK + kT * kT;
  load_tile_sw128(sQ, p.a);
  load_tile_sw128(sK, p.b);
  load_tile_sw128(sV, p.c);
  smem_to_async_proxy();
  float s_acc[32];
  ss_product<0>(s_acc, sQ, sK);
  // S (64 queries x 64 keys) -> P fragments: keys 16 s .. 16 s + 15 are accumulator blocks 2 s, 2 s + 1.
  float blocks[8][4];
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) blocks[j][i] = s_acc[4 * j + i];
  uint32_t pf[4][4];
  c_to_a<Bf16, 64>(pf, blocks);
  float o[32];
  zero32(o);
  sm90::wgmma_fence();
  for (int s = 0; s < kT / 16; ++s) {
    const uint64_t dv = sm90::smem_desc_sw128_mn64(reinterpret_cast<char*>(sV) + 2048 * s);
    sm90::wgmma_m64n64k16_rs<Bf16, 1>(o, pf[s], dv, s > 0);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  store_acc(p.out, o);
}

}  // namespace wgmma_check
}  // namespace dkv
