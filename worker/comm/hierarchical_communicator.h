// worker/comm/hierarchical_communicator.h — the `hierarchical` Communicator:
// one group over several boxes, built from an intra-box communicator (all
// ranks of this box: shm, cuda_p2p) and an inter-box one (one leader per
// box: ucx, nccl), so bulk traffic stays inside boxes and only one rank per
// box talks across.
//
//   auto intra = CreateShmCommunicator(...);                 // every rank of this box
//   std::unique_ptr<Communicator> inter;                      // leaders (intra rank 0) only
//   if ((*intra)->rank() == 0) inter = *CreateUcxCommunicator(ucx_options, *leader_bootstrap);
//   EXL3_ASSIGN_OR_RETURN(auto comm, CreateHierarchicalCommunicator(std::move(*intra),
//   std::move(inter),
//                                                                   Deadline(absl::Seconds(30))));
//
// Layout: box b's leader is its intra rank 0 and has inter rank b. Global
// ranks are box-major: box 0's intra ranks 0..n0−1, then box 1's, ...
// Boxes may differ in size; creation discovers the sizes (leaders all-gather
// them, then broadcast inside their box).
//
// Operations (each step is a call on a sub-communicator, same deadline):
//   AllReduce   intra AllReduce (every rank gets its box sum), leaders
//               inter AllReduce, intra Broadcast from the leader.
//   Broadcast   root's box: intra Broadcast from the root; leaders: inter
//               Broadcast from the root's box; other boxes: intra Broadcast
//               from their leader.
//   AllGather(V) intra AllGather(V) into this box's slice, leaders inter
//               AllGatherV of box slices, intra Broadcast of the whole.
//   Barrier     intra Barrier, leaders inter Barrier, intra Barrier.
//   ReduceScatter  the AllReduce above over all world·count elements, then
//               this rank's block (moves N× the bytes of a flat one).
//   AllToAllV   an AllGather of every rank's send_bytes row, an AllGatherV
//               of every rank's whole send buffer, then each rank picks its
//               column: correct but moves everything to everyone — a
//               fallback until the expert-parallel path needs better.
//
// Determinism: every rank receives identical bits (leaders hold the same
// inter result, the others get it by broadcast). The summation order is
// "inside the box, then across boxes": element i is
//   S_b = ((x_{b,0} + x_{b,1}) + ...) + x_{b,n_b−1}      (intra, rank order)
//   sum = ((S_0 + S_1) + S_2) + ... + S_{B−1}            (inter, box order)
// in fp32 — the same operands as the flat rank-order sum, associated by box.
// It is therefore fixed for a given layout, but differs from a flat
// communicator's bits unless there is one box or every box has one rank.
// bf16 is converted to fp32 first and rounded once at the end (so the
// contract's "fp32 accumulation rounded once" holds; the steps carry fp32,
// twice the bytes).
//
// Failure: a failed step marks this communicator broken, then aborts both
// sub-communicators with the reason, which fails the box's ranks and (on a
// leader) the other leaders, who abort their boxes in turn. Later calls
// return Aborted("communicator broken: <first reason>").
//
// Thread safety: as Communicator (one calling thread; Abort() and health()
// from any thread). Ownership: owns both sub-communicators.
#ifndef EXL3SERVE_WORKER_COMM_HIERARCHICAL_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_HIERARCHICAL_COMMUNICATOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {

// Collective over every rank of every box. `intra` spans this box; `inter`
// is non-null exactly on intra rank 0 and spans one leader per box (its
// rank = the box index). Errors: InvalidArgument (inter present on a
// non-leader or missing on a leader), or the sub-communicators' errors
// while discovering the box sizes (by `deadline`).
absl::StatusOr<std::unique_ptr<Communicator>> CreateHierarchicalCommunicator(
    std::unique_ptr<Communicator> intra, std::unique_ptr<Communicator> inter, absl::Time deadline);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_HIERARCHICAL_COMMUNICATOR_H_
