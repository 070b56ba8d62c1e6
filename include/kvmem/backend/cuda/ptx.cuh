// SPDX-License-Identifier: Apache-2.0
#pragma once
// The low-level pieces the kernels of both mechanisms build on. One copy, so a fix to an operand
// constraint or a clobber reaches every kernel.
//
// NVIDIA-only instructions (KVMEM_GPU_VENDOR_PATHS, vendor.cuh): sm_80+ mma.sync m16n8k16 with bf16
// operands, ldmatrix, cp.async; sm_90 griddepcontrol and thread-block clusters; sm_90a wgmma. Only the
// tensor-core kernels (*_tc.cuh) and the cluster decode call the matrix, ldmatrix and cluster pieces,
// and those exist only on the vendor path. The asynchronous copies and the launch-overlap hooks have a
// portable form that every kernel may call: a plain copy that lands before the call returns (so the
// waits have nothing left to wait for) and no-op hooks (the portable path launches without overlap).
// The memory-order loads, fences and approximate math exist on both vendors.
//
// Shared-memory reads and writes issued by these wrappers carry a "memory" clobber: the compiler must
// not move ordinary shared-memory accesses across an asynchronous copy, its wait, or an ldmatrix.
// mma.sync reads and writes registers only, so it is left non-volatile for the scheduler.

#include "kvmem/backend/cuda/vendor.cuh"

#if KVMEM_GPU_VENDOR_PATHS
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

#include <cstddef>
#include <cstdint>

#include "kvmem/core/numeric.hpp"

namespace kvmem::cuda::ptx {

#if KVMEM_GPU_VENDOR_PATHS
// 32-bit shared-window address of a generic pointer into shared memory.
__device__ inline unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers; bytes = 0 writes zeros (rows past the
// valid range), so a tile's padding never holds stale data.
__device__ inline void cp_async16(unsigned smem_addr, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(bytes) : "memory");
}
__device__ inline void cp_async16(void* smem, const void* gmem, int bytes) {
  cp_async16(shared_address(smem), gmem, bytes);
}
// kBytes (4, 8 or 16) global -> shared through L1 (cp.async.ca: the only form for pieces under 16 bytes);
// both addresses aligned to kBytes.
template <int kBytes>
__device__ inline void cp_async_ca(void* smem, const void* gmem) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(shared_address(smem)), "l"(gmem), "n"(kBytes)
               : "memory");
}
__device__ inline void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// One step of a double-buffered cp.async loop over `tiles` tiles (tile k + 1 goes to the buffer tile k - 1
// used): issues tile k + 1 when there is one, then waits until tile k has landed, leaving k + 1 in
// flight. The caller's barrier then makes tile k visible to the block.
template <class Issue>
__device__ inline void issue_next_and_wait(std::int64_t k, std::int64_t tiles, Issue&& issue) {
  if (k + 1 < tiles) {
    issue(k + 1);
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
}

// ldmatrix: 8x8 b16 matrices from shared memory. Lane l gives the address of row l % 8 of matrix l / 8;
// lane l receives row l / 4, columns 2 (l % 4) + {0, 1} of each matrix (.trans: row 2 (l % 4) + {0, 1},
// column l / 4), the A/B fragment layouts of mma m16n8k16.
__device__ inline void ldmatrix_x2(std::uint32_t& r0, std::uint32_t& r1, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr) : "memory");
}
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ inline void ldmatrix_x4_trans(std::uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ inline void ldmatrix_x2(std::uint32_t& r0, std::uint32_t& r1, const void* p) {
  ldmatrix_x2(r0, r1, shared_address(p));
}
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* p) {
  ldmatrix_x4(r, shared_address(p));
}
__device__ inline void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* p) {
  ldmatrix_x4_trans(r, shared_address(p));
}

// d += a b for one m16n8k16 tile: bf16 operands, fp32 accumulators (PTX fragment layouts).
__device__ inline void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#else   // portable: the copies land at once, so commits and waits have nothing to do
// 16 bytes global -> shared; only the first `bytes` are read, the rest of the 16 are zeros.
__device__ inline void cp_async16(void* smem, const void* gmem, int bytes) {
  if (bytes == 16) {
    *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
    return;
  }
  auto* d = static_cast<unsigned char*>(smem);
  const auto* g = static_cast<const unsigned char*>(gmem);
  for (int i = 0; i < 16; ++i) d[i] = i < bytes ? g[i] : 0;
}
template <int kBytes>
__device__ inline void cp_async_ca(void* smem, const void* gmem) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp_async_ca copies 4, 8 or 16 bytes");
  if constexpr (kBytes == 4) *static_cast<std::uint32_t*>(smem) = *static_cast<const std::uint32_t*>(gmem);
  if constexpr (kBytes == 8) *static_cast<std::uint64_t*>(smem) = *static_cast<const std::uint64_t*>(gmem);
  if constexpr (kBytes == 16) *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
}
__device__ inline void cp_async_commit() {}
template <int kPending>
__device__ inline void cp_async_wait() {}
template <class Issue>
__device__ inline void issue_next_and_wait(std::int64_t k, std::int64_t tiles, Issue&& issue) {
  if (k + 1 < tiles) issue(k + 1);
}
#endif  // KVMEM_GPU_VENDOR_PATHS

// The dynamic shared memory a launch gives a kernel with a wgmma path and an mma.sync path whose layouts
// differ: the larger of the two, because the host cannot know which path the device runs (the sm_90a
// machine code, or the compute_90 PTX JIT-compiled for another GPU).
__host__ __device__ constexpr std::size_t shared_bytes_of_either_path(std::size_t wgmma_path,
                                                                      std::size_t mma_sync_path) {
  return wgmma_path > mma_sync_path ? wgmma_path : mma_sync_path;
}
// The 128-byte swizzle layout the wgmma descriptors read, as the kernels store it (plain arithmetic, so it
// is defined for every build): a K-major matrix of `rows` rows is kept as column blocks of [rows][64
// bf16], block after block, and 16-byte vector j of row r of a block sits at j ^ (r % 8).
// Byte offset of vector `vec` (8 bf16) of row `row`:
__device__ inline unsigned sw128_offset(int rows, int row, int vec) {
  return static_cast<unsigned>((vec / 8) * rows * 128 + row * 128 + ((vec % 8) ^ (row % 8)) * 16);
}
// Byte offset at which k16 slice kk (columns 16 kk .. 16 kk + 15) starts: 32 bytes into the rows of
// column block kk / 4, the start address a descriptor of that slice takes.
__device__ inline unsigned sw128_k16_offset(int rows, int kk) {
  return static_cast<unsigned>((kk / 4) * rows * 128 + (kk % 4) * 32);
}
#if KVMEM_GPU_VENDOR_PATHS
// Warpgroup MMA (sm_90a only: wgmma is an arch-specific feature, so these exist where the compiler
// defines __CUDA_ARCH_FEAT_SM90_ALL; callers guard on the same macro). The four warps of a warpgroup
// issue one m64nNk16 product together; it runs asynchronously on the tensor cores, reading its B
// operand (and A, for the _ss forms) from shared memory through a matrix descriptor, and its
// accumulators are the registers' D fragments: warp w of the warpgroup holds rows 16 w + lane / 4 and
// + 8, columns 8 i + 2 (lane % 4) + {0, 1} in d[i][0..1] and d[i][2..3] (the mma.sync m16n8 layout
// repeated over the N / 8 column tiles). A from registers has the m16n8k16 A fragment layout.
// The first 1024-byte boundary at or after p in shared memory: swizzled tiles start on one (the
// pattern follows address bits), so their dynamic shared memory has 1024 spare bytes.
__device__ inline unsigned char* align_shared_1024(unsigned char* p) {
  return p + (1024u - shared_address(p) % 1024u) % 1024u;
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor of an operand in the 128-byte swizzle layout: 8-row atoms of 128-byte rows (64 bf16), the
// 16-byte chunk j of row r stored at chunk j ^ (r % 8), every atom 1024-byte aligned (the hardware
// swizzles on address bits, so a start address advanced by 32 bytes inside a row selects the next k16
// slice). K-major (no transpose): sbo = the step between 8-row groups, lbo unused. MN-major
// (transposed): lbo = the step between 64-element column blocks, sbo = the step between 8-row groups.
__device__ inline std::uint64_t wgmma_desc_sw128(unsigned smem_addr, unsigned lbo, unsigned sbo) {
  return std::uint64_t((smem_addr & 0x3FFFFu) >> 4) | (std::uint64_t(lbo >> 4) << 16) |
         (std::uint64_t(sbo >> 4) << 32) | (std::uint64_t(1) << 62);
}
// Orders this thread's register writes (accumulators, A fragments) before the wgmma that reads them.
__device__ inline void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ inline void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed wgmma groups are still running.
template <int kPending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads or writes of registers an asynchronous wgmma owns across the
// issue or the wait (CUTLASS's warpgroup_fence_operand): call it on the accumulators and A fragments
// after the wait, and on the accumulators before the issue.
template <int kN>
__device__ inline void wgmma_fence_operands(float (&d)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}
template <int kN>
__device__ inline void wgmma_fence_operands(std::uint32_t (&a)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
// Generic-proxy writes to shared memory (cp.async, st.shared) -> visible to the async proxy that
// wgmma reads its shared-memory operands through; then a barrier publishes them to the warpgroups.
__device__ inline void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// d (+)= a b, A and B from shared memory, both K-major; accumulate = 0 overwrites d.
__device__ inline void wgmma_m64n64k16_ss(float (&d)[8][4], std::uint64_t a_desc, std::uint64_t b_desc,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%"
      "30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
// d += a b, A from registers, B from shared memory MN-major (transposed: rows of B are the k index);
// the scale-d predicate is set (always accumulate).
__device__ inline void wgmma_m64n64k16_rs_mn(float (&d)[8][4], const std::uint32_t (&a)[4], std::uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%"
      "30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
}
__device__ inline void wgmma_m64n128k16_rs_mn(float (&d)[16][4], const std::uint32_t (&a)[4], std::uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%"
      "30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%"
      "58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]),
        "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),
        "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
}
// d (+)= a b, A from registers, B from shared memory K-major (rows of B are the n index, as in the _ss
// form: no transpose); accumulate = 0 overwrites d.
__device__ inline void wgmma_m64n64k16_rs(float (&d)[8][4], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%"
      "30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
#endif  // KVMEM_GPU_VENDOR_PATHS

// Two floats -> one register of two bf16 (lo at the lower address), round to nearest even.
__device__ inline std::uint32_t pack_bf16(float lo, float hi) {
#if KVMEM_GPU_VENDOR_PATHS
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
#else
  return std::uint32_t(bf16::from_float(lo)) | (std::uint32_t(bf16::from_float(hi)) << 16);
#endif
}

#if KVMEM_GPU_HIP
// Load with acquire semantics at GPU scope: writes released by another block before it published
// the value are visible after this returns.
__device__ inline int load_acquire(const int* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ inline std::int64_t load_acquire(const std::int64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
// A relaxed 64-bit load / store at GPU (agent) scope: single-copy atomic, no ordering with other accesses.
__device__ inline std::uint64_t load_relaxed_gpu(const std::uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ inline void store_relaxed_gpu(std::uint64_t* p, std::uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// Acquire-release fence at GPU (agent) scope.
__device__ inline void fence_acq_rel_gpu() {
  __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, "agent");
}

#else
// Load with acquire semantics at GPU scope: writes released by another block before it published
// the value are visible after this returns.
__device__ inline int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline std::int64_t load_acquire(const std::int64_t* p) {
  std::int64_t v;
  asm volatile("ld.acquire.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// A relaxed 64-bit load / store at GPU scope, through L2: single-copy atomic (an aligned b64), so a reader
// sees all of a value another block stored or none of it. No ordering with other accesses (no memory
// clobber either: the compiler may move unrelated loads and stores across them).
__device__ inline std::uint64_t load_relaxed_gpu(const std::uint64_t* p) {
  std::uint64_t v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(p));
  return v;
}
__device__ inline void store_relaxed_gpu(std::uint64_t* p, std::uint64_t v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;\n" ::"l"(p), "l"(v));
}
// Acquire-release fence at GPU scope: orders this thread's earlier writes before its later ones (a
// ticket) and its later reads after earlier acquires. __threadfence is sequentially consistent, which a
// ticket does not need, and costs more.
__device__ inline void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

#endif  // KVMEM_GPU_HIP

// Programmatic dependent launch (sm_90; the launch sets cudaLaunchAttributeProgrammaticStreamSerialization):
// a kernel may be scheduled while the kernel before it on the stream is still running. It waits for that
// kernel to complete (and its writes to be visible) before touching memory, so the order of effects is
// the plain stream order. No-ops where the instruction does not exist and on the portable path, whose
// launches do not overlap.
__device__ inline void wait_for_previous_grid() {
#if KVMEM_GPU_VENDOR_PATHS && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the next kernel on the stream be scheduled (it still waits for this one to complete).
__device__ inline void allow_next_grid() {
#if KVMEM_GPU_VENDOR_PATHS && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

#if KVMEM_GPU_VENDOR_PATHS
// Thread-block clusters (sm_90; the launch sets cudaLaunchAttributeClusterDimension). cluster_sync is a
// barrier over every thread of every block of the cluster, with release / acquire semantics: shared
// memory written before it is visible to the cluster's other blocks after it, and a block that has
// passed it may still be read by the others until their next cluster_sync. Every thread of the cluster
// must reach it (no early return before it).
__device__ inline void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The shared::cluster address of variable `p` (in this block's shared memory) in the cluster's block `rank`.
__device__ inline unsigned cluster_address(const void* p, unsigned rank) {
  unsigned out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(shared_address(p)), "r"(rank));
#endif
  return out;
}
// A float from another block's shared memory (an address from cluster_address).
__device__ inline float load_cluster(unsigned addr) {
  float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#endif
  return v;
}
#endif  // KVMEM_GPU_VENDOR_PATHS

#if KVMEM_GPU_HIP
// Approximate math for callers that have bounded their error: the hardware's transcendental
// instructions on CDNA (v_rcp_f32, v_log_f32, v_exp_f32), through the device library's native forms.
__device__ inline float rcp_approx_ftz(float d) {
  return __builtin_amdgcn_rcpf(d);
}
__device__ inline float lg2_approx(float x) {
  return __log2f(x);
}
__device__ inline float lg2_approx_ftz(float x) {
  return __log2f(x);
}
__device__ inline float ex2_approx_ftz(float x) {
  return exp2f(x);
}

#else
// Approximate math instructions (MUFU), for callers that have bounded their error. rcp: about 1 ulp for
// normal d; lg2: absolute error about 2^-22.6; ex2 with ftz: results below 2^-126 flush to 0.
__device__ inline float rcp_approx_ftz(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
}
__device__ inline float lg2_approx(float x) {
  float r;
  asm("lg2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// lg2 with subnormal inputs flushed to 0 (log2 -> -inf): the plain form scales them up first, four more
// instructions.
__device__ inline float lg2_approx_ftz(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ inline float ex2_approx_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

#endif  // KVMEM_GPU_HIP

// fp8 e4m3 conversions of the kernels, the values of core/numeric.hpp's e4m3 (round to nearest even,
// saturating at 448). The vendor path takes cuda_fp8.h's conversions, which sm_89 and later run in
// hardware (cvt with e4m3x2 operands; e4m3 values are exact in fp16); the portable path the software
// rounding of kvmem::e4m3.
__device__ inline e4m3 to_e4m3(float x) {
#if KVMEM_GPU_VENDOR_PATHS
  return e4m3::from_bits(static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)));
#else
  return e4m3(x);
#endif
}
// Four e4m3 codes of a 32-bit word, the lowest byte first, as floats.
__device__ inline void e4m3x4_to_float(std::uint32_t w, float* out) {
#if KVMEM_GPU_VENDOR_PATHS
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  out[0] = a.x;
  out[1] = a.y;
  out[2] = b.x;
  out[3] = b.y;
#else
  for (int k = 0; k < 4; ++k) out[k] = e4m3::to_float(static_cast<std::uint8_t>(w >> (8 * k)));
#endif
}
__device__ inline float e4m3_to_float(e4m3 x) {
#if KVMEM_GPU_VENDOR_PATHS
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(x.bits), __NV_E4M3)));
#else
  return e4m3::to_float(x.bits);
#endif
}

}  // namespace kvmem::cuda::ptx
