// Tests of AllocateBits (exl3-format.md §6.7).
#include "sharding/quant/bit_allocation.h"

#include <gtest/gtest.h>

namespace exl3serve::sharding::quant {
namespace {

// Four layers, each with attention (q/k/v one group, o another; priority 2)
// and MLP (gate+up one group, down another; priority 1).
std::vector<AllocationItem> SmallModel() {
  std::vector<AllocationItem> items;
  for (int layer = 0; layer < 4; ++layer) {
    const std::string p = "layers." + std::to_string(layer);
    for (const char* n : {"q", "k", "v"}) items.push_back({p + "." + n, layer, 4, p + ".qkv", 2, 1000});
    items.push_back({p + ".o", layer, 4, p + ".o", 2, 1000});
    items.push_back({p + ".gate", layer, 4, p + ".gu", 1, 3000});
    items.push_back({p + ".up", layer, 4, p + ".gu", 1, 3000});
    items.push_back({p + ".down", layer, 4, p + ".down", 1, 3000});
  }
  return items;
}

TEST(BitAllocationTest, IntegerBitrateGivesUniformBits) {
  auto a = AllocateBits(SmallModel(), 4.0);
  ASSERT_TRUE(a.ok());
  for (int b : a->bits) EXPECT_EQ(b, 4);
  EXPECT_DOUBLE_EQ(a->achieved_bpw, 4.0);
}

TEST(BitAllocationTest, RaisesHighPriorityEndLayersFirst) {
  const auto items = SmallModel();
  // Σnumel = 4·13000 = 52000; bpw 4.1 -> budget int(4.1·52000) = 213199 (the
  // double product is 213199.99..., truncated as exllamav3's int() does) =
  // base 208000 + 5199:
  // qkv of layer 0 (3000) then qkv of layer 3 (3000) would need 6000, so only
  // layer 0's qkv (3000), then layer 0's o (1000), then layer 3's o (1000).
  auto a = AllocateBits(items, 4.1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->budget_bits, 213199);
  for (size_t i = 0; i < items.size(); ++i) {
    const bool raised = items[i].qgroup == "layers.0.qkv" || items[i].qgroup == "layers.0.o" ||
                        items[i].qgroup == "layers.3.o";
    EXPECT_EQ(a->bits[i], raised ? 5 : 4) << items[i].name;
  }
  EXPECT_NEAR(a->achieved_bpw, (208000.0 + 5000.0) / 52000.0, 1e-12);
  EXPECT_LE(a->achieved_bpw, 4.1);
}

TEST(BitAllocationTest, CapsAtEightBits) {
  auto a = AllocateBits({{"only", 0, 1, "g", 1, 100}}, 8.0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bits[0], 8);
  a = AllocateBits({{"a", 0, 2, "g0", 2, 100}, {"b", 1, 2, "g1", 1, 100}}, 7.5);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bits[0], 8);
  EXPECT_EQ(a->bits[1], 7);
}

TEST(BitAllocationTest, RejectsBadInputs) {
  EXPECT_EQ(AllocateBits(SmallModel(), 9.0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateBits({{"x", 0, 1, "g", 1, 0}}, 4.0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateBits({{"x", 0, 2, "g", 1, 10}, {"y", 1, 2, "g", 1, 10}}, 4.0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::sharding::quant
