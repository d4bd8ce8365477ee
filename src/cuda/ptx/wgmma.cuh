// wgmma operand descriptors and the generated mma wrappers.
#pragma once

#include <cstdint>

#include "cuda/ptx/ptx.cuh"
#include "cuda/ptx/wgmma_gen.cuh"

namespace mok::ptx {

// Descriptor of a K-major tile in shared memory written by TMA with 128-byte swizzle:
// rows of 128 B (64 bf16 / 128 fp8), 8-row swizzle atoms of 1024 B.  The tile must be
// 1024-byte aligned.  Advancing along K by 32 B (16 bf16) adds 2 to the descriptor.
__device__ __forceinline__ uint64_t desc_kmajor_sw128(const void* smem) {
  const uint64_t addr = smem_u32(smem);
  uint64_t desc = (addr & 0x3FFFFull) >> 4;  // [0, 14): start address >> 4
  desc |= uint64_t{1} << 16;                 // [16, 30): leading byte offset (unused when swizzled)
  desc |= uint64_t{1024 >> 4} << 32;         // [32, 46): stride byte offset = one 8-row atom
  desc |= uint64_t{1} << 62;                 // [62, 64): 128-byte swizzle
  return desc;
}

// Descriptor of an MN-major tile (the operand's M or N dimension contiguous) written by TMA
// with 128-byte swizzle in boxes of 64 MN elements x 64 K rows: each K row is one 128-byte
// line of 64 bf16, 8 K rows make a 1024-byte swizzle atom.  Strides of the canonical layout:
//   SBO = 1024 B  from one 8-row K group to the next (inside a box);
//   LBO = mn_chunk_bytes  from one 64-element MN chunk (box) to the next.
// Advancing along K by 16 rows adds 16 * 128 B = 2048 B (128 in descriptor units).
__device__ __forceinline__ uint64_t desc_mnmajor_sw128(const void* smem, uint32_t mn_chunk_bytes) {
  const uint64_t addr = smem_u32(smem);
  uint64_t desc = (addr & 0x3FFFFull) >> 4;                // [0, 14): start address >> 4
  desc |= uint64_t{(mn_chunk_bytes >> 4) & 0x3FFFu} << 16;  // [16, 30): leading byte offset
  desc |= uint64_t{1024 >> 4} << 32;                       // [32, 46): stride byte offset
  desc |= uint64_t{1} << 62;                               // [62, 64): 128-byte swizzle
  return desc;
}

// The m64nNk16 bf16 MMA of a tile N (128 or 256), by operand orientation.
template <int N>
__device__ __forceinline__ void mma_bf16(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 128 || N == 192 || N == 256, "generated wrappers: N = 128, 192 or 256");
  if constexpr (N == 256) mma_m64n256k16_bf16(d, a, b, accumulate);
  else if constexpr (N == 192) mma_m64n192k16_bf16(d, a, b, accumulate);
  else mma_m64n128k16_bf16(d, a, b, accumulate);
}
template <int N>
__device__ __forceinline__ void mma_bf16_tb(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 128 || N == 192 || N == 256, "generated wrappers: N = 128, 192 or 256");
  if constexpr (N == 256) mma_m64n256k16_bf16_tb(d, a, b, accumulate);
  else if constexpr (N == 192) mma_m64n192k16_bf16_tb(d, a, b, accumulate);
  else mma_m64n128k16_bf16_tb(d, a, b, accumulate);
}
template <int N>
__device__ __forceinline__ void mma_bf16_tatb(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 128 || N == 192 || N == 256, "generated wrappers: N = 128, 192 or 256");
  if constexpr (N == 256) mma_m64n256k16_bf16_tatb(d, a, b, accumulate);
  else if constexpr (N == 192) mma_m64n192k16_bf16_tatb(d, a, b, accumulate);
  else mma_m64n128k16_bf16_tatb(d, a, b, accumulate);
}

// The m64nNk32 e4m3 x e4m3 MMA of a tile N (128 or 256), both operands K-major.
template <int N>
__device__ __forceinline__ void mma_e4m3(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 128 || N == 256, "generated wrappers: N = 128 or 256");
  if constexpr (N == 256) mma_m64n256k32_e4m3(d, a, b, accumulate);
  else mma_m64n128k32_e4m3(d, a, b, accumulate);
}

}  // namespace mok::ptx
