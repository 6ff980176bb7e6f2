// sharding/quant/bit_allocation.h — bits per linear for a target bitrate
// (exl3-format.md §6.7, exllamav3's create_q_strategy).
//
//   std::vector<AllocationItem> items = ...;   // every budgeted linear
//   EXL3_ASSIGN_OR_RETURN(BitAllocation a, AllocateBits(items, 4.25));
//   int k_for_item_3 = a.bits[3];
//
// Rule: every linear starts at floor(bpw); the budget is int(bpw·Σnumel)
// bits; qgroups are ordered by priority (high first), then by the distance of
// their layer from the nearer end of the stack (ends first), then layer
// index; sweeps over that order raise a whole group by one bit (cap 8)
// whenever the result still fits the budget, until a sweep changes nothing.
// The head and MTP layers are outside the budget (not passed here).
// Thread safety: pure function.
#ifndef EXL3SERVE_SHARDING_QUANT_BIT_ALLOCATION_H_
#define EXL3SERVE_SHARDING_QUANT_BIT_ALLOCATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3serve::sharding::quant {

struct AllocationItem {
  std::string name;        // tensor prefix, for messages
  int layer_index = 0;     // 0..num_layers-1
  int num_layers = 1;
  std::string qgroup;      // linears with the same key move together
  int priority = 0;        // higher first (attention 2, MLP 1, + select_hq_bits)
  int64_t numel = 0;
};

struct BitAllocation {
  std::vector<int> bits;        // per item, same order as the input
  double achieved_bpw = 0.0;    // Σ bits·numel / Σ numel
  int64_t budget_bits = 0;      // int(bpw · Σ numel)
};

// InvalidArgument: bpw outside [1, 8], an item with numel <= 0, a layer index
// outside [0, num_layers), or items of one qgroup disagreeing on priority/layer.
absl::StatusOr<BitAllocation> AllocateBits(const std::vector<AllocationItem>& items, double bpw);

}  // namespace exl3serve::sharding::quant

#endif  // EXL3SERVE_SHARDING_QUANT_BIT_ALLOCATION_H_
