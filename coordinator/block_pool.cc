#include "coordinator/block_pool.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "openssl/evp.h"

namespace exl3serve::coordinator {
namespace {

BlockHash Sha256Truncated(std::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EXL3_CHECK(EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) == 1);
  BlockHash h;
  std::memcpy(&h.hi, digest, 8);
  std::memcpy(&h.lo, digest + 8, 8);
  return h;
}

}  // namespace

BlockHash RootBlockHash(std::string_view salt) {
  return Sha256Truncated(absl::StrCat("exl3serve prefix cache v1|", std::string(salt)));
}

BlockHash ChainBlockHash(const BlockHash& parent, std::span<const int32_t> tokens) {
  // parent (16 bytes) | token count (8) | token ids (little-endian int32).
  std::string bytes(24 + tokens.size_bytes(), '\0');
  const uint64_t count = tokens.size();
  std::memcpy(bytes.data(), &parent.hi, 8);
  std::memcpy(bytes.data() + 8, &parent.lo, 8);
  std::memcpy(bytes.data() + 16, &count, 8);
  if (!tokens.empty()) std::memcpy(bytes.data() + 24, tokens.data(), tokens.size_bytes());
  return Sha256Truncated(bytes);
}

BlockPool::BlockPool(int64_t num_blocks) : num_blocks_(num_blocks) {
  EXL3_CHECK(num_blocks > 0 && num_blocks <= INT32_MAX);
  blocks_.resize(static_cast<size_t>(num_blocks));
  free_.reserve(static_cast<size_t>(num_blocks));
  // Block 0 is taken first.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

int32_t BlockPool::Allocate() {
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    EXL3_CHECK(!lru_.empty()) << "block pool: nothing to allocate";
    id = lru_.front();
    lru_.pop_front();
    Block& evicted = blocks_[id];
    evicted.in_lru = false;
    by_hash_.erase(evicted.hash);
    evicted.sealed = false;
    evicted_.emplace_back(id, evicted.hash);
    ++evictions_;
  }
  Block& b = blocks_[id];
  EXL3_CHECK(b.refs == 0);
  b.refs = 1;
  return id;
}

void BlockPool::Acquire(int32_t block) {
  Block& b = blocks_[block];
  if (b.refs == 0) {
    EXL3_CHECK(b.in_lru) << "block pool: acquiring free block " << block;
    lru_.erase(b.lru);
    b.in_lru = false;
  }
  ++b.refs;
}

void BlockPool::Release(int32_t block) {
  Block& b = blocks_[block];
  EXL3_CHECK(b.refs > 0) << "block pool: releasing unheld block " << block;
  if (--b.refs > 0) return;
  if (b.sealed) {
    b.lru = lru_.insert(lru_.end(), block);
    b.in_lru = true;
  } else {
    free_.push_back(block);
  }
}

void BlockPool::Seal(int32_t block, const BlockHash& hash) {
  Block& b = blocks_[block];
  EXL3_CHECK(b.refs > 0) << "block pool: sealing unheld block " << block;
  if (b.sealed) return;
  if (!by_hash_.try_emplace(hash, block).second) return;
  b.sealed = true;
  b.hash = hash;
}

std::vector<int32_t> BlockPool::Match(std::span<const BlockHash> hashes) const {
  std::vector<int32_t> out;
  for (const BlockHash& h : hashes) {
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    out.push_back(it->second);
  }
  return out;
}

void BlockPool::ForgetCached() {
  for (int32_t id : lru_) {
    blocks_[id].in_lru = false;
    free_.push_back(id);
  }
  lru_.clear();
  for (Block& b : blocks_) b.sealed = false;
  by_hash_.clear();
  evicted_.clear();
}

BlockSlotIndex::BlockSlotIndex(int64_t slots) {
  EXL3_CHECK(slots >= 0);
  slots_.resize(static_cast<size_t>(slots));
  Clear();
}

int64_t BlockSlotIndex::Find(const BlockHash& hash) const {
  auto it = by_hash_.find(hash);
  return it == by_hash_.end() ? -1 : it->second;
}

int64_t BlockSlotIndex::Place(const BlockHash& hash) {
  int64_t slot = -1;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    for (auto it = lru_.begin(); it != lru_.end(); ++it) {
      if (slots_[*it].pins == 0) {
        slot = *it;
        break;
      }
    }
    if (slot < 0) return -1;
    Slot& old = slots_[slot];
    lru_.erase(old.lru);
    by_hash_.erase(old.hash);
    old.used = false;
    ++evictions_;
  }
  Slot& s = slots_[slot];
  s.used = true;
  s.hash = hash;
  s.lru = lru_.insert(lru_.end(), slot);
  EXL3_CHECK(by_hash_.emplace(hash, slot).second);
  return slot;
}

void BlockSlotIndex::Touch(int64_t slot) {
  Slot& s = slots_[slot];
  if (!s.used) return;
  lru_.erase(s.lru);
  s.lru = lru_.insert(lru_.end(), slot);
}

void BlockSlotIndex::Forget(const BlockHash& hash) {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return;
  Slot& s = slots_[it->second];
  lru_.erase(s.lru);
  s.used = false;
  free_.push_back(it->second);
  by_hash_.erase(it);
}

void BlockSlotIndex::Clear() {
  lru_.clear();
  by_hash_.clear();
  free_.clear();
  for (int64_t i = slots() - 1; i >= 0; --i) {
    slots_[i].used = false;
    free_.push_back(i);
  }
}

std::string BlockPool::CheckInvariants() const {
  int64_t free = 0, cached = 0, held = 0;
  for (size_t id = 0; id < blocks_.size(); ++id) {
    const Block& b = blocks_[id];
    if (b.refs > 0) {
      ++held;
      if (b.in_lru) return absl::StrCat("held block ", id, " is in the LRU");
    } else if (b.sealed) {
      ++cached;
      if (!b.in_lru) return absl::StrCat("cached block ", id, " is not in the LRU");
    } else {
      ++free;
    }
    if (b.sealed) {
      auto it = by_hash_.find(b.hash);
      if (it == by_hash_.end() || it->second != static_cast<int32_t>(id)) {
        return absl::StrCat("sealed block ", id, " is not the one its hash maps to");
      }
    }
  }
  if (free != static_cast<int64_t>(free_.size())) {
    return absl::StrCat(free, " free blocks but ", free_.size(), " in the free list");
  }
  if (cached != static_cast<int64_t>(lru_.size())) {
    return absl::StrCat(cached, " cached blocks but ", lru_.size(), " in the LRU");
  }
  if (free + cached + held != num_blocks_) {
    return absl::StrCat(free, " free + ", cached, " cached + ", held, " held != ", num_blocks_);
  }
  if (static_cast<int64_t>(by_hash_.size()) != cached + [&] {
        int64_t n = 0;
        for (const Block& b : blocks_) n += (b.refs > 0 && b.sealed) ? 1 : 0;
        return n;
      }()) {
    return "the hash map does not match the sealed blocks";
  }
  return "";
}

}  // namespace exl3serve::coordinator
