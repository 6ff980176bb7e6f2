// worker/comm/cuda_p2p_kernels.cu — the device side of the cuda_p2p backend:
// push-style (remote-write) reductions and copies between the GPUs of one
// box over NVLink / PCIe peer-to-peer, with bounded, abortable waits.
//
// 1. What and when
//    * Reduce launch (P2pReduceArgs), three uses:
//      one-shot all-reduce — each rank pushes its whole chunk into every
//        peer's buffer, one barrier, each rank sums all slots: 1 round,
//        (N-1)·S bytes out per rank. Chosen for small messages.
//      two-shot all-reduce — each rank pushes piece d (1/N of the chunk) to
//        rank d, barrier, rank d sums piece d and pushes the sum to every
//        peer, barrier, everyone copies the sums out: 2 rounds, 2·(N-1)/N·S
//        bytes out per rank. Chosen above cuda_p2p.one_shot_max_bytes when
//        N > 2 (vLLM's and TensorRT-LLM's rule: N == 2 gains nothing).
//      reduce-scatter — the first half of two-shot with the caller's blocks.
//    * Copy launch (P2pCopyArgs): each rank pushes segment d to rank d,
//      barrier, each rank copies what it received out (all-gather(v),
//      broadcast, all-to-all(v)).
//    * Barrier launch: one block, one barrier, no data.
//    The host (cuda_p2p_communicator.cc) splits larger operations into
//    several launches; every rank derives the same split from the operation's
//    sizes, which are equal on all ranks by the Communicator contract.
//    Groups of 1..8 ranks on one host whose GPUs have peer access to each
//    other (or share a GPU); anything else makes the host side refuse at
//    creation with Unimplemented ("use nccl").
//
// 2. Layout and ownership (per rank, allocated, exported, mapped and freed by
//    cuda_p2p_communicator.cc)
//    * data buffer (cudaMalloc): [half h 0..1][source rank s][block b] of
//      sub_bytes each. Sub-slot (h, s, b) of rank d's buffer is written only
//      by rank s's block b and read only by rank d's block b.
//    * signal (cudaMalloc, zeroed before its IPC handle is handed out):
//      P2pSignal {flags[block][rank], epoch[block], abort}.
//    * status (cudaHostAlloc mapped, per rank, not shared): P2pStatus, one
//      record per block, written only when that block fails.
//
// 3. Epochs. Each block b of each rank numbers its barriers 1, 2, 3, ... in
//    signal.epoch[b] (device memory, read at launch start, written at launch
//    end; never in a host local, so CUDA-graph replays keep counting).
//    Announcing barrier k to rank t = storing k into t's flags[b][me];
//    passing it = seeing flags[b][t] >= k (wrap-safe: (int32)(v - k) >= 0)
//    for every peer t. A peer's flag is always within k-1..k+1 when we wait
//    for k (it cannot announce k+2 before we announce k+1), so 32-bit
//    wraparound after 4e9 barriers is harmless. No reset pass exists. A data
//    phase that ends in barrier k uses half (k & 1).
//
// 4. Invariants
//    I1 All ranks launch the same kernels in the same order with the same
//       grid (kP2pBlocks) and the same per-block ranges, so block b's
//       barrier numbers agree across ranks.
//    I2 Block b only ever touches sub-slots of block b (any half, any
//       source); therefore every hazard below is between same-numbered blocks.
//    I3 Write-after-read: a rank writes half h for barrier k+2 only after
//       passing barrier k+1, which needs every peer's announcement of k+1,
//       which each peer makes only after it finished reading half h for
//       barrier k (program order in the block, or kernel order on the
//       stream). Two halves therefore suffice and no "end" barrier is needed.
//    I4 Read-after-write: a rank reads sub-slot (h, s, b) only after passing
//       the barrier that rank s's block b announced after writing it.
//    I5 Sums run over ranks in order 0, 1, ..., N-1 in fp32, starting from
//       rank 0's value (not from 0.0f), rounded once (bf16: RNE) — the same
//       on every rank and in one-shot and two-shot, so results are
//       bit-identical across ranks, algorithms and chunkings.
//    I6 The abort word is only ever set, never cleared; a set abort word
//       fails every later launch at its start.
//
// 5. Memory ordering (every atomic access names its row)
//    O1 __syncthreads() before announcing: all of the block's pushes (weak
//       remote stores) are ordered before thread t's fence (CTA barrier).
//    O2 __threadfence_system(); st.release.sys flags: the pushes and, by
//       cumulativity, the block's earlier reads (I3) happen-before any
//       observer of the flag, at system scope (the peer is another GPU).
//    O3 ld.acquire.sys on our own flags[b][t] observing k synchronises with
//       O2 of rank t; the following __syncthreads() extends it to the whole
//       block, whose data loads use ld.global.cg (L2, not a possibly stale
//       L1 line from two barriers ago).
//    O4 abort word: st.relaxed.sys (set) / ld.relaxed.sys (poll). It carries
//       no data; it only stops waits.
//    O5 status records: volatile stores to mapped host memory followed by
//       __threadfence_system(); the host reads them after the launch's event
//       completed (kernel completion orders them).
//    (The O2 fence is redundant with .release; kept, as vLLM does, because it
//    costs nothing next to a system-scope store.)
//
// 6. Failure. Every wait polls: every 64 polls it checks a sibling thread's
//    failure (shared memory), the elapsed %globaltimer time against
//    timeout_ns (wall-clock nanoseconds, immune to SM clock changes and
//    context time-slicing, unlike clock64), then our abort word. On timeout
//    the block records the ranks it did not hear from and sets the abort
//    word of every rank (the same O4 store LaunchP2pAbort makes), so the
//    peers' waits end within one poll period instead of their own timeout;
//    on an abort word it records the aborter. The host turns the records
//    into DeadlineExceeded / Aborted and marks the communicator broken.
//
// 7. Test plan (tests/comm/gpu_comm_test.cc; needs a GPU, skipped otherwise):
//    ranks on distinct GPUs, or two ranks time-sliced on one GPU; odd sizes
//    on both sides of the one-shot threshold and of the launch capacity;
//    bit equality with a CPU rank-order fp32 sum and across ranks; a rank
//    that never arrives -> DeadlineExceeded on the others, then Aborted.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "worker/comm/cuda_p2p_kernels.h"

namespace exl3serve::worker::comm::internal {
namespace {

constexpr uint32_t kPollsPerCheck = 64;

__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreRelaxedSys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t LoadRelaxedSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ bool Reached(uint32_t seen, uint32_t wanted) {
  return static_cast<int32_t>(seen - wanted) >= 0;
}

// Per-block shared state of one launch.
struct BlockState {
  uint32_t fail;     // P2pStatusCode; first writer wins (atomicCAS)
  uint32_t missing;  // ranks not heard from
  uint32_t aborter;
  uint32_t epoch;  // epoch[b] at launch start (broadcast from thread 0)
};

__device__ __forceinline__ char* SubSlot(const P2pGroup& g, int owner, uint32_t barrier, int source,
                                         int block) {
  const size_t index =
      ((static_cast<size_t>(barrier & 1u) * g.world + source) * kP2pBlocks + block);
  return g.data[owner] + index * g.sub_bytes;
}

// Thread 0 reads the epoch; everyone learns whether the group is already
// aborted (I6). Ends with __syncthreads().
__device__ void BeginLaunch(const P2pGroup& g, BlockState* s) {
  if (threadIdx.x == 0) {
    P2pSignal* mine = g.signal[g.rank];
    s->fail = kP2pOk;
    s->missing = 0;
    s->epoch = mine->epoch[blockIdx.x];
    s->aborter = LoadRelaxedSys(&mine->abort);  // O4
    if (s->aborter != 0) s->fail = kP2pPeerAborted;
  }
  __syncthreads();
}

// Barrier `k` of this block with the same-numbered block of every peer.
// Returns false (for the whole block) when it failed.
__device__ bool BlockBarrier(const P2pGroup& g, uint32_t k, uint64_t start_ns, uint64_t timeout_ns,
                             BlockState* s) {
  __syncthreads();  // O1
  const int t = threadIdx.x;
  const int b = blockIdx.x;
  if (t < g.world && t != g.rank) {
    P2pSignal* mine = g.signal[g.rank];
    __threadfence_system();                              // O2
    StoreReleaseSys(&g.signal[t]->flags[b][g.rank], k);  // O2
    uint32_t polls = 0;
    while (!Reached(LoadAcquireSys(&mine->flags[b][t]), k)) {  // O3
      if (++polls % kPollsPerCheck != 0) continue;
      if (*reinterpret_cast<volatile uint32_t*>(&s->fail) != kP2pOk) break;
      if (GlobalTimerNs() - start_ns > timeout_ns) {
        atomicOr(&s->missing, 1u << t);
        atomicCAS(&s->fail, kP2pOk, kP2pTimedOut);
        break;
      }
      const uint32_t aborter = LoadRelaxedSys(&mine->abort);  // O4
      if (aborter != 0) {
        atomicExch(&s->aborter, aborter);
        atomicCAS(&s->fail, kP2pOk, kP2pPeerAborted);
        break;
      }
    }
  }
  __syncthreads();  // O3: extends thread t's acquire to the block
  return s->fail == kP2pOk;
}

// Thread 0 of a failed block: records the failure (O5) and, on its own
// timeout, aborts the group so the peers stop waiting.
__device__ void ReportFailure(const P2pGroup& g, uint32_t k, const BlockState* s) {
  if (threadIdx.x != 0) return;
  if (s->fail == kP2pTimedOut) {
    for (int r = 0; r < g.world; ++r) {
      uint32_t* word = &g.signal[r]->abort;
      if (LoadRelaxedSys(word) == 0)
        StoreRelaxedSys(word, static_cast<uint32_t>(g.rank) + 1);  // O4
    }
  }
  volatile P2pBlockStatus* record = &g.status->blocks[blockIdx.x];
  record->missing = s->missing;
  record->aborter = s->aborter;
  record->epoch = k;
  record->code = s->fail;
  __threadfence_system();  // O5
}

// Block-strided copy of n bytes, 16 / 4 / 1 bytes at a time by alignment.
// Loads use ld.global.cg (O3).
__device__ void CopyBytes(char* dst, const char* src, size_t n) {
  const uintptr_t both = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  size_t done = 0;
  if ((both & 15u) == 0) {
    const size_t words = n / 16;
    for (size_t i = threadIdx.x; i < words; i += blockDim.x) {
      reinterpret_cast<uint4*>(dst)[i] = __ldcg(reinterpret_cast<const uint4*>(src) + i);
    }
    done = words * 16;
  } else if ((both & 3u) == 0) {
    const size_t words = n / 4;
    for (size_t i = threadIdx.x; i < words; i += blockDim.x) {
      reinterpret_cast<uint32_t*>(dst)[i] = __ldcg(reinterpret_cast<const unsigned int*>(src) + i);
    }
    done = words * 4;
  }
  for (size_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    dst[i] = static_cast<char>(__ldcg(reinterpret_cast<const unsigned char*>(src) + i));
  }
}

// Elements [lo, lo + n) of a piece of `len` elements clipped to this block.
__device__ __forceinline__ size_t BlockCount(size_t len, size_t lo, size_t per_block) {
  if (len <= lo) return 0;
  return len - lo < per_block ? len - lo : per_block;
}

__device__ __forceinline__ float LoadElement(const void* p, size_t i, P2pDType dtype) {
  if (dtype == P2pDType::kF32) return __ldcg(static_cast<const float*>(p) + i);
  return __bfloat162float(__ushort_as_bfloat16(__ldcg(static_cast<const unsigned short*>(p) + i)));
}

// Rounds once (I5) and returns the stored bits.
__device__ __forceinline__ uint32_t StoreElement(void* p, size_t i, float v, P2pDType dtype) {
  if (dtype == P2pDType::kF32) {
    static_cast<float*>(p)[i] = v;
    return __float_as_uint(v);
  }
  const unsigned short bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  static_cast<unsigned short*>(p)[i] = bits;
  return bits;
}

__global__ void __launch_bounds__(kP2pThreads)
    P2pReduceKernel(P2pGroup g, P2pReduceArgs a, uint64_t timeout_ns) {
  __shared__ BlockState s;
  const uint64_t start_ns = GlobalTimerNs();
  const int b = blockIdx.x;
  BeginLaunch(g, &s);
  uint32_t k = s.epoch + 1;
  if (s.fail != kP2pOk) return ReportFailure(g, k, &s);

  const size_t esize = a.dtype == P2pDType::kF32 ? 4 : 2;
  const size_t lo = static_cast<size_t>(b) * a.block_elems;
  // Phase 1: push our contribution to piece d into rank d's sub-slot (k, me, b).
  for (int d = 0; d < g.world; ++d) {
    if (d == g.rank) continue;
    const size_t n = BlockCount(a.piece_len[d], lo, a.block_elems);
    CopyBytes(SubSlot(g, d, k, g.rank, b), static_cast<const char*>(a.src[d]) + lo * esize,
              n * esize);
  }
  if (!BlockBarrier(g, k, start_ns, timeout_ns, &s)) return ReportFailure(g, k, &s);

  // Phase 2: reduce our piece in rank order (I5); two-shot pushes each sum.
  const uint32_t k2 = k + 1;
  const size_t n_mine = BlockCount(a.piece_len[g.rank], lo, a.block_elems);
  const char* own = static_cast<const char*>(a.src[g.rank]) + lo * esize;
  char* out = static_cast<char*>(a.out) + lo * esize;
  for (size_t i = threadIdx.x; i < n_mine; i += blockDim.x) {
    float acc = 0.0f;
    for (int r = 0; r < g.world; ++r) {
      const void* slot = r == g.rank ? static_cast<const void*>(own)
                                     : static_cast<const void*>(SubSlot(g, g.rank, k, r, b));
      const float v = LoadElement(slot, i, a.dtype);
      acc = r == 0 ? v : acc + v;
    }
    const uint32_t bits = StoreElement(out, i, acc, a.dtype);
    if (a.two_shot) {
      for (int d = 0; d < g.world; ++d) {
        if (d == g.rank) continue;
        char* slot = SubSlot(g, d, k2, g.rank, b);
        if (a.dtype == P2pDType::kF32) {
          reinterpret_cast<uint32_t*>(slot)[i] = bits;
        } else {
          reinterpret_cast<unsigned short*>(slot)[i] = static_cast<unsigned short>(bits);
        }
      }
    }
  }
  if (a.two_shot) {
    k = k2;
    if (!BlockBarrier(g, k, start_ns, timeout_ns, &s)) return ReportFailure(g, k, &s);
    // Phase 3: copy every other rank's reduced piece out.
    for (int r = 0; r < g.world; ++r) {
      if (r == g.rank) continue;
      const size_t n = BlockCount(a.piece_len[r], lo, a.block_elems);
      CopyBytes(static_cast<char*>(a.gather_dst[r]) + lo * esize, SubSlot(g, g.rank, k, r, b),
                n * esize);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) g.signal[g.rank]->epoch[b] = k;
}

__global__ void __launch_bounds__(kP2pThreads)
    P2pCopyKernel(P2pGroup g, P2pCopyArgs a, uint64_t timeout_ns) {
  __shared__ BlockState s;
  const uint64_t start_ns = GlobalTimerNs();
  const int b = blockIdx.x;
  BeginLaunch(g, &s);
  const uint32_t k = s.epoch + 1;
  if (s.fail != kP2pOk) return ReportFailure(g, k, &s);

  const size_t lo = static_cast<size_t>(b) * a.block_bytes;
  for (int d = 0; d < g.world; ++d) {
    const size_t n = BlockCount(a.send_len[d], lo, a.block_bytes);
    if (n == 0) continue;  // src may be null then
    const char* src = static_cast<const char*>(a.src[d]) + lo;
    if (d != g.rank) {
      CopyBytes(SubSlot(g, d, k, g.rank, b), src, n);
    } else if (a.src[d] != a.dst[d]) {
      CopyBytes(static_cast<char*>(a.dst[d]) + lo, src, n);
    }
  }
  if (!BlockBarrier(g, k, start_ns, timeout_ns, &s)) return ReportFailure(g, k, &s);
  for (int r = 0; r < g.world; ++r) {
    if (r == g.rank) continue;
    const size_t n = BlockCount(a.recv_len[r], lo, a.block_bytes);
    if (n == 0) continue;  // dst may be null then
    CopyBytes(static_cast<char*>(a.dst[r]) + lo, SubSlot(g, g.rank, k, r, b), n);
  }
  __syncthreads();
  if (threadIdx.x == 0) g.signal[g.rank]->epoch[b] = k;
}

__global__ void __launch_bounds__(kP2pThreads) P2pBarrierKernel(P2pGroup g, uint64_t timeout_ns) {
  __shared__ BlockState s;
  const uint64_t start_ns = GlobalTimerNs();
  BeginLaunch(g, &s);
  const uint32_t k = s.epoch + 1;
  if (s.fail != kP2pOk) return ReportFailure(g, k, &s);
  if (!BlockBarrier(g, k, start_ns, timeout_ns, &s)) return ReportFailure(g, k, &s);
  if (threadIdx.x == 0) g.signal[g.rank]->epoch[blockIdx.x] = k;
}

__global__ void P2pAbortKernel(P2pGroup g) {
  const int r = threadIdx.x;
  if (r < g.world) {
    uint32_t* word = &g.signal[r]->abort;
    if (LoadRelaxedSys(word) == 0) StoreRelaxedSys(word, static_cast<uint32_t>(g.rank) + 1);  // O4
  }
}

}  // namespace

cudaError_t LaunchP2pReduce(const P2pGroup& group, const P2pReduceArgs& args, uint64_t timeout_ns,
                            cudaStream_t stream) {
  P2pReduceKernel<<<kP2pBlocks, kP2pThreads, 0, stream>>>(group, args, timeout_ns);
  return cudaGetLastError();
}

cudaError_t LaunchP2pCopy(const P2pGroup& group, const P2pCopyArgs& args, uint64_t timeout_ns,
                          cudaStream_t stream) {
  P2pCopyKernel<<<kP2pBlocks, kP2pThreads, 0, stream>>>(group, args, timeout_ns);
  return cudaGetLastError();
}

cudaError_t LaunchP2pBarrier(const P2pGroup& group, uint64_t timeout_ns, cudaStream_t stream) {
  // One block: a barrier carries no data, and block 0's epochs stay
  // consistent across ranks (I1) because every rank launches it alike.
  P2pBarrierKernel<<<1, kP2pThreads, 0, stream>>>(group, timeout_ns);
  return cudaGetLastError();
}

cudaError_t LaunchP2pAbort(const P2pGroup& group, cudaStream_t stream) {
  P2pAbortKernel<<<1, 32, 0, stream>>>(group);
  return cudaGetLastError();
}

}  // namespace exl3serve::worker::comm::internal
