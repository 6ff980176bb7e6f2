#include "sharding/quant/bit_allocation.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

namespace exl3serve::sharding::quant {

absl::StatusOr<BitAllocation> AllocateBits(const std::vector<AllocationItem>& items, double bpw) {
  if (!(bpw >= 1.0 && bpw <= 8.0)) {
    return absl::InvalidArgumentError("allocation: bits per weight must be in [1, 8], got " +
                                      std::to_string(bpw));
  }
  struct Group {
    std::vector<size_t> members;
    int64_t numel = 0;
    int priority = 0;
    int layer = 0;
    int num_layers = 1;
  };
  std::map<std::string, size_t> group_of;
  std::vector<Group> groups;
  int64_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const AllocationItem& it = items[i];
    if (it.numel <= 0 || it.num_layers <= 0 || it.layer_index < 0 || it.layer_index >= it.num_layers) {
      return absl::InvalidArgumentError("allocation: item " + it.name + " has numel " +
                                        std::to_string(it.numel) + ", layer " +
                                        std::to_string(it.layer_index) + " of " +
                                        std::to_string(it.num_layers));
    }
    auto [pos, inserted] = group_of.emplace(it.qgroup, groups.size());
    if (inserted) {
      groups.push_back({{}, 0, it.priority, it.layer_index, it.num_layers});
    } else if (groups[pos->second].priority != it.priority || groups[pos->second].layer != it.layer_index) {
      return absl::InvalidArgumentError("allocation: qgroup " + it.qgroup + " mixes priorities or layers (item " +
                                        it.name + ")");
    }
    groups[pos->second].members.push_back(i);
    groups[pos->second].numel += it.numel;
    total += it.numel;
  }
  BitAllocation out;
  const int base = static_cast<int>(std::floor(bpw));
  out.bits.assign(items.size(), base);
  out.budget_bits = static_cast<int64_t>(bpw * static_cast<double>(total));
  std::vector<size_t> order(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) order[g] = g;
  auto key = [&](size_t g) {
    const Group& gr = groups[g];
    const int distance = std::min(gr.layer, gr.num_layers - 1 - gr.layer);
    return std::make_tuple(-gr.priority, distance, gr.layer);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  std::vector<int> group_bits(groups.size(), base);
  int64_t used = static_cast<int64_t>(base) * total;
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t g : order) {
      if (group_bits[g] >= 8) continue;
      if (used + groups[g].numel <= out.budget_bits) {
        ++group_bits[g];
        used += groups[g].numel;
        changed = true;
      }
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i : groups[g].members) out.bits[i] = group_bits[g];
  }
  out.achieved_bpw = total > 0 ? static_cast<double>(used) / static_cast<double>(total) : 0.0;
  return out;
}

}  // namespace exl3serve::sharding::quant
