#include "worker/model/kv_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kernels/cpu/dense16_gemm.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::worker {
namespace {

constexpr int64_t kScaleBytes = 4;

void StoreFp16(const float* x, int n, uint8_t* out) {
  for (int i = 0; i < n; ++i) {
    const uint16_t h = kernels::FloatToHalfBits(x[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

float AbsMax(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// Symmetric quantization to [-qmax, qmax]; returns the scale (0 for all-zero).
float QuantizeSymmetric(const float* x, int n, int qmax, int8_t* q) {
  const float scale = AbsMax(x, n) / static_cast<float>(qmax);
  for (int i = 0; i < n; ++i) {
    const float r = scale > 0.0f ? std::nearbyint(x[i] / scale) : 0.0f;
    q[i] = static_cast<int8_t>(std::clamp(r, -static_cast<float>(qmax), static_cast<float>(qmax)));
  }
  return scale;
}

}  // namespace


namespace {

// Physical memory of this machine: no KV pool can be larger.
int64_t MachineMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return INT64_MAX;
  return static_cast<int64_t>(pages) * page;
}

}  // namespace

absl::StatusOr<PagedKvCache> PagedKvCache::Create(const KvCacheShape& shape,
                                                  const KvCacheOptions& options) {
  // Zero kv heads is a rank of a tensor-parallel group without attention
  // heads: it still tracks sequences and lengths.
  if (shape.num_layers <= 0 || shape.num_kv_heads < 0 || shape.head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv cache: layers and head_dim must be > 0 and kv heads >= 0, got ", shape.num_layers, ", ",
        shape.num_kv_heads, ", ", shape.head_dim));
  }
  if (options.page_size_tokens <= 0 || options.num_pages <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_cache.page_size_tokens and kv_cache.num_pages must be > 0, got ",
                     options.page_size_tokens, " and ", options.num_pages));
  }
  if (shape.value_dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: value_dim must be >= 0, got ", shape.value_dim));
  }
  if (options.dtype == KvCacheDtype::kInt4 && (shape.head_dim % 2 != 0 || shape.v_dim() % 2 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv cache: 4-bit entries need an even head_dim and value width, got ", shape.head_dim,
        " and ", shape.v_dim()));
  }
  PagedKvCache cache;
  cache.shape_ = shape;
  cache.options_ = options;
  // One position's key and value entries of every head.
  const int64_t entry = cache.EntryStride(shape.head_dim) + cache.EntryStride(shape.v_dim());
  // The pool's size in overflow-checked arithmetic: num_pages and
  // page_size_tokens come from the cluster config via the Setup message.
  int64_t per_page = 0, pool_bytes = 0;
  if (__builtin_mul_overflow(int64_t{shape.num_layers} * shape.num_kv_heads, entry, &per_page) ||
      __builtin_mul_overflow(per_page, int64_t{options.page_size_tokens}, &per_page) ||
      __builtin_mul_overflow(per_page, options.num_pages, &pool_bytes) ||
      pool_bytes > MachineMemoryBytes()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: ", options.num_pages, " pages of ", options.page_size_tokens,
        " tokens need more than this machine's memory (", MachineMemoryBytes() >> 20,
        " MiB); lower kv.num_pages or kv.page_size_tokens"));
  }
  cache.bytes_per_page_ = per_page;
  try {
    cache.pool_.assign(static_cast<size_t>(pool_bytes), 0);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("kv cache: cannot allocate the pool of ",
                                                     pool_bytes >> 20, " MiB (", options.num_pages,
                                                     " pages); lower kv.num_pages"));
  }
  cache.free_pages_.reserve(options.num_pages);
  for (int64_t p = options.num_pages - 1; p >= 0; --p) cache.free_pages_.push_back(p);
  cache.owner_.assign(static_cast<size_t>(options.num_pages), -1);
  int64_t offset = 0;
  for (int64_t floats : shape.state_floats) {
    cache.state_offsets_.push_back(offset);
    offset += floats;
  }
  cache.refs_.assign(static_cast<size_t>(options.num_pages), 0);
  return cache;
}

int64_t PagedKvCache::EntryBytes(int dim) const {
  switch (options_.dtype) {
    case KvCacheDtype::kFp32: return 4 * int64_t{dim};
    case KvCacheDtype::kFp16: return 2 * int64_t{dim};
    case KvCacheDtype::kInt8: return dim;
    case KvCacheDtype::kInt4: return dim / 2;
  }
  return 0;
}

int64_t PagedKvCache::EntryStride(int dim) const {
  const bool scaled = options_.dtype == KvCacheDtype::kInt8 || options_.dtype == KvCacheDtype::kInt4;
  return EntryBytes(dim) + (scaled ? kScaleBytes : 0);
}

uint8_t* PagedKvCache::EntryPtr(int64_t page, int layer, int which, int64_t slot, int head) {
  const int64_t k_entry = EntryStride(shape_.head_dim);
  const int64_t v_entry = EntryStride(shape_.v_dim());
  const int64_t block = options_.page_size_tokens * shape_.num_kv_heads;  // entries of one k|v
  const int64_t index = slot * shape_.num_kv_heads + head;
  int64_t offset = int64_t{layer} * block * (k_entry + v_entry);
  offset += which == 0 ? index * k_entry : block * k_entry + index * v_entry;
  return pool_.data() + page * bytes_per_page_ + offset;
}

const uint8_t* PagedKvCache::EntryPtr(int64_t page, int layer, int which, int64_t slot,
                                      int head) const {
  return const_cast<PagedKvCache*>(this)->EntryPtr(page, layer, which, slot, head);
}

const PagedKvCache::Sequence& PagedKvCache::Get(int64_t seq_id) const {
  auto it = sequences_.find(seq_id);
  EXL3_CHECK(it != sequences_.end()) << "unknown sequence " << seq_id;
  return it->second;
}

absl::Status PagedKvCache::AddSequence(int64_t seq_id, int64_t cached_length,
                                       const StateSnapshotRef& resume_from) {
  const int64_t positions = options_.num_pages * options_.page_size_tokens;
  if (cached_length < 0 || cached_length > positions) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: sequence ", seq_id, ": cached length ",
                                                   cached_length, " is outside [0, ", positions,
                                                   "] (the pool's positions)"));
  }
  if (cached_length > 0 && !options_.caller_assigns_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: sequence ", seq_id,
                     ": a cached prefix needs pages assigned by the caller (caller_assigns_pages)"));
  }
  const Snapshot* from = nullptr;
  if (cached_length > 0 && has_state()) {
    if (resume_from.slot < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv cache: sequence ", seq_id, ": this model keeps a recurrent state per sequence; a "
          "cached prefix of ", cached_length, " positions needs a state snapshot to resume from"));
    }
    const size_t slot = static_cast<size_t>(resume_from.slot);
    if (slot >= snapshots_.size() || snapshots_[slot].state.empty() ||
        snapshots_[slot].length != cached_length || snapshots_[slot].hash_hi != resume_from.hash_hi ||
        snapshots_[slot].hash_lo != resume_from.hash_lo) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv cache: sequence ", seq_id, ": state snapshot slot ", resume_from.slot,
          " does not hold the state after this prefix of ", cached_length,
          " positions (empty, or another block's)"));
    }
    from = &snapshots_[slot];
  }
  if (sequences_.contains(seq_id)) {
    return absl::AlreadyExistsError(absl::StrCat("kv cache: sequence ", seq_id, " already exists"));
  }
  std::vector<float> state;
  try {
    if (from != nullptr) {
      state = from->state;
    } else {
      state.assign(static_cast<size_t>(shape_.state_floats_per_sequence()), 0.0f);
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: sequence ", seq_id, ": cannot allocate its recurrent state of ",
        state_bytes_per_sequence() >> 20, " MiB"));
  }
  Sequence& sequence = sequences_[seq_id];
  sequence.length = cached_length;
  sequence.state = std::move(state);
  return absl::OkStatus();
}

absl::Status PagedKvCache::RemoveSequence(int64_t seq_id) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("kv cache: no sequence ", seq_id));
  }
  for (int64_t page : it->second.pages) {
    if (--refs_[page] == 0) {
      free_pages_.push_back(page);
      owner_[page] = -1;
    }
  }
  sequences_.erase(it);
  return absl::OkStatus();
}

int64_t PagedKvCache::Length(int64_t seq_id) const {
  auto it = sequences_.find(seq_id);
  return it == sequences_.end() ? 0 : it->second.length;
}

absl::Status PagedKvCache::Reserve(int64_t seq_id, int64_t capacity) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("kv cache: no sequence ", seq_id));
  }
  std::vector<int64_t>& pages = it->second.pages;
  const int64_t page = options_.page_size_tokens;
  const int64_t needed = (capacity + page - 1) / page - static_cast<int64_t>(pages.size());
  if (options_.caller_assigns_pages) {
    // The positions written next, [length, capacity), must be this
    // sequence's alone: a shared prefix page is read-only.
    const int64_t first = it->second.length / page;
    const int64_t last = std::min<int64_t>((capacity + page - 1) / page,
                                           static_cast<int64_t>(pages.size()));
    for (int64_t i = first; i < last; ++i) {
      if (refs_[pages[i]] > 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "kv cache: sequence ", seq_id, " would write positions [", it->second.length, ", ",
            capacity, ") into page ", pages[i], ", which ", refs_[pages[i]] - 1,
            " other sequence(s) share as a cached prefix"));
      }
    }
  }
  if (needed <= 0) return absl::OkStatus();
  if (options_.caller_assigns_pages) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kv cache: sequence ", seq_id, " holds ", pages.size(), " assigned pages (",
        static_cast<int64_t>(pages.size()) * page, " positions) but needs ", capacity,
        " positions; its pages are assigned by the coordinator and none was sent for them"));
  }
  if (needed > free_pages()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: sequence ", seq_id, " needs ", needed, " more pages for ", capacity,
        " positions but ", free_pages(), " of ", options_.num_pages,
        " are free (raise kv_cache.num_pages)"));
  }
  for (int64_t i = 0; i < needed; ++i) {
    pages.push_back(free_pages_.back());
    owner_[free_pages_.back()] = seq_id;
    refs_[free_pages_.back()] = 1;
    free_pages_.pop_back();
  }
  return absl::OkStatus();
}

absl::Status PagedKvCache::AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("kv cache: no sequence ", seq_id));
  }
  // Validate everything first: all or nothing.
  const Sequence& seq = it->second;
  const int64_t page_size = options_.page_size_tokens;
  for (size_t i = 0; i < page_ids.size(); ++i) {
    const int64_t page = page_ids[i];
    if (page < 0 || page >= options_.num_pages) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv cache: sequence ", seq_id, ": page ", page, " is outside [0, ",
                       options_.num_pages, ") (kv_cache.num_pages of this rank)"));
    }
    if (std::find(seq.pages.begin(), seq.pages.end(), page) != seq.pages.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv cache: sequence ", seq_id, ": page ", page, " is already used by sequence ", seq_id));
    }
    // Table index of this page: read-only (shareable) when it ends inside
    // the cached prefix the sequence started with.
    const int64_t index = static_cast<int64_t>(seq.pages.size() + i);
    const bool in_cached_prefix = (index + 1) * page_size <= seq.length;
    if (refs_[page] != 0 && !in_cached_prefix) {
      return absl::FailedPreconditionError(absl::StrCat("kv cache: sequence ", seq_id, ": page ",
                                                        page, " is already used by sequence ",
                                                        owner_[page]));
    }
    for (size_t j = 0; j < i; ++j) {
      if (page_ids[j] == page_ids[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "kv cache: sequence ", seq_id, ": page ", page, " is assigned twice in one call"));
      }
    }
  }
  std::vector<int64_t>& pages = it->second.pages;
  for (int32_t page : page_ids) {
    owner_[page] = seq_id;
    pages.push_back(page);
    if (refs_[page]++ == 0) {
      free_pages_.erase(std::find(free_pages_.begin(), free_pages_.end(), int64_t{page}));
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> PagedKvCache::PageTable(int64_t seq_id) const {
  auto it = sequences_.find(seq_id);
  return it == sequences_.end() ? std::vector<int64_t>() : it->second.pages;
}

void PagedKvCache::SetLength(int64_t seq_id, int64_t length) {
  auto it = sequences_.find(seq_id);
  EXL3_CHECK(it != sequences_.end()) << "unknown sequence " << seq_id;
  EXL3_CHECK(length >= 0 && length <= static_cast<int64_t>(it->second.pages.size()) *
                                           options_.page_size_tokens)
      << "length " << length << " beyond reserved pages";
  EXL3_CHECK(!has_state() || length >= it->second.length)
      << "sequence " << seq_id << ": a recurrent state cannot be rolled back from "
      << it->second.length << " to " << length;
  it->second.length = length;
}

absl::Status PagedKvCache::KeepStateHistory(int64_t seq_id, int64_t positions) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("kv cache: no sequence ", seq_id));
  Sequence& s = it->second;
  const size_t floats = static_cast<size_t>(positions * shape_.state_floats_per_sequence());
  try {
    if (s.history.size() < floats) s.history.resize(floats);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: sequence ", seq_id, ": cannot allocate the recurrent state of ", positions,
        " draft positions (", (floats * sizeof(float)) >> 20, " MiB)"));
  }
  s.history_start = s.length;
  s.history_positions = positions;
  return absl::OkStatus();
}

float* PagedKvCache::StateHistory(int64_t seq_id, int slot, int64_t position) {
  auto it = sequences_.find(seq_id);
  EXL3_CHECK(it != sequences_.end()) << "unknown sequence " << seq_id;
  Sequence& s = it->second;
  const int64_t index = position - s.history_start;
  if (index < 0 || index >= s.history_positions) return nullptr;
  return s.history.data() + index * shape_.state_floats_per_sequence() + state_offsets_[slot];
}

absl::Status PagedKvCache::RollbackWithState(int64_t seq_id, int64_t length) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("kv cache: no sequence ", seq_id));
  Sequence& s = it->second;
  const int64_t index = length - 1 - s.history_start;
  if (length > s.length || index < 0 || index >= s.history_positions) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kv cache: sequence ", seq_id, ": no kept state for length ", length, " (kept after ",
        s.history_positions, " positions from ", s.history_start, ", length ", s.length, ")"));
  }
  const int64_t floats = shape_.state_floats_per_sequence();
  std::copy_n(s.history.data() + index * floats, floats, s.state.data());
  s.length = length;
  s.history_positions = 0;
  return absl::OkStatus();
}

absl::Status PagedKvCache::SaveStateSnapshot(int64_t seq_id, const StateSnapshotRef& snapshot) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("kv cache: no sequence ", seq_id));
  if (!has_state()) {
    return absl::InvalidArgumentError("kv cache: this model keeps no state to snapshot");
  }
  if (snapshot.slot < 0 || snapshot.slot >= options_.num_pages) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: state snapshot slot ", snapshot.slot,
                                                   " is outside [0, ", options_.num_pages, ")"));
  }
  const Sequence& seq = it->second;
  if (seq.length % options_.page_size_tokens != 0 || seq.history_positions > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kv cache: sequence ", seq_id, ": a state snapshot needs a length at a block boundary (",
        seq.length, " positions, blocks of ", options_.page_size_tokens,
        ") and no speculative history"));
  }
  const size_t slot = static_cast<size_t>(snapshot.slot);
  try {
    if (snapshots_.size() <= slot) snapshots_.resize(slot + 1);
    std::vector<float> copy = seq.state;
    Snapshot& to = snapshots_[slot];
    if (to.state.empty()) ++snapshots_held_;
    to.state = std::move(copy);
    to.length = seq.length;
    to.hash_hi = snapshot.hash_hi;
    to.hash_lo = snapshot.hash_lo;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: cannot allocate state snapshot slot ", snapshot.slot, " (",
        state_bytes_per_sequence() >> 20, " MiB)"));
  }
  return absl::OkStatus();
}

void PagedKvCache::DropStateHistory(int64_t seq_id) {
  auto it = sequences_.find(seq_id);
  if (it != sequences_.end()) it->second.history_positions = 0;
}

float* PagedKvCache::State(int64_t seq_id, int slot) {
  auto it = sequences_.find(seq_id);
  EXL3_CHECK(it != sequences_.end()) << "unknown sequence " << seq_id;
  EXL3_CHECK(slot >= 0 && slot < static_cast<int>(state_offsets_.size()))
      << "state slot " << slot << " of " << state_offsets_.size();
  return it->second.state.data() + state_offsets_[slot];
}

void PagedKvCache::Write(int64_t seq_id, int layer, int64_t start, int64_t count, const float* k,
                         const float* v) {
  const Sequence& seq = Get(seq_id);
  const int64_t page_size = options_.page_size_tokens;
  EXL3_CHECK(layer >= 0 && layer < shape_.num_layers && start >= 0 &&
             start + count <= static_cast<int64_t>(seq.pages.size()) * page_size)
      << "write of [" << start << ", " << start + count << ") beyond reserved pages";
  std::vector<int8_t> q(std::max(shape_.head_dim, shape_.v_dim()));
  for (int64_t t = 0; t < count; ++t) {
    const int64_t pos = start + t;
    const int64_t page = seq.pages[pos / page_size];
    const int64_t slot = pos % page_size;
    for (int which = 0; which < 2; ++which) {
      const int hd = which == 0 ? shape_.head_dim : shape_.v_dim();
      const float* src = (which == 0 ? k : v) + t * shape_.num_kv_heads * hd;
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        uint8_t* entry = EntryPtr(page, layer, which, slot, h);
        const float* x = src + int64_t{h} * hd;
        switch (options_.dtype) {
          case KvCacheDtype::kFp32:
            std::memcpy(entry, x, sizeof(float) * hd);
            break;
          case KvCacheDtype::kFp16:
            StoreFp16(x, hd, entry);
            break;
          case KvCacheDtype::kInt8: {
            const float scale = QuantizeSymmetric(x, hd, 127, q.data());
            std::memcpy(entry, &scale, kScaleBytes);
            std::memcpy(entry + kScaleBytes, q.data(), hd);
            break;
          }
          case KvCacheDtype::kInt4: {
            const float scale = QuantizeSymmetric(x, hd, 7, q.data());
            std::memcpy(entry, &scale, kScaleBytes);
            for (int i = 0; i < hd; i += 2) {
              entry[kScaleBytes + i / 2] = static_cast<uint8_t>((q[i] + 8) | ((q[i + 1] + 8) << 4));
            }
            break;
          }
        }
      }
    }
  }
}

void PagedKvCache::ReadRun(int64_t page, int layer, int64_t slot, int64_t count, float* k,
                           float* v) const {
  for (int which = 0; which < 2; ++which) {
    const int hd = which == 0 ? shape_.head_dim : shape_.v_dim();
    float* dst = which == 0 ? k : v;
    const int64_t entries = count * shape_.num_kv_heads;
    const uint8_t* run = EntryPtr(page, layer, which, slot, 0);
    if (options_.dtype == KvCacheDtype::kFp32) {
      std::memcpy(dst, run, sizeof(float) * static_cast<size_t>(entries * hd));
      continue;
    }
    if (options_.dtype == KvCacheDtype::kFp16) {
      kernels::cpu::Dense16ToFloat(reinterpret_cast<const uint16_t*>(run),
                                   kernels::cpu::Dense16Type::kF16, entries * hd, dst);
      continue;
    }
    const int64_t stride = EntryStride(hd);
    for (int64_t e = 0; e < entries; ++e) {
      const uint8_t* entry = run + e * stride;
      float* x = dst + e * hd;
      float scale;
      std::memcpy(&scale, entry, kScaleBytes);
      const uint8_t* data = entry + kScaleBytes;
      if (options_.dtype == KvCacheDtype::kInt8) {
        for (int i = 0; i < hd; ++i) x[i] = scale * static_cast<float>(static_cast<int8_t>(data[i]));
      } else {
        for (int i = 0; i < hd; i += 2) {
          x[i] = scale * static_cast<float>((data[i / 2] & 0xF) - 8);
          x[i + 1] = scale * static_cast<float>((data[i / 2] >> 4) - 8);
        }
      }
    }
  }
}

void PagedKvCache::RowPointers(int64_t seq_id, int layer, int64_t begin, int64_t end,
                               const void** k_rows, const void** v_rows) const {
  const Sequence& seq = Get(seq_id);
  const int64_t page_size = options_.page_size_tokens;
  EXL3_CHECK(entries_in_place() && layer >= 0 && layer < shape_.num_layers && begin >= 0 &&
             begin <= end && end <= static_cast<int64_t>(seq.pages.size()) * page_size)
      << "row pointers of [" << begin << ", " << end << ") beyond reserved pages or not in place";
  const int64_t k_row = EntryStride(shape_.head_dim) * shape_.num_kv_heads;
  const int64_t v_row = EntryStride(shape_.v_dim()) * shape_.num_kv_heads;
  for (int64_t pos = begin; pos < end;) {
    const int64_t page = seq.pages[static_cast<size_t>(pos / page_size)];
    const int64_t slot = pos % page_size;
    const int64_t run = std::min(end - pos, page_size - slot);
    const uint8_t* k = EntryPtr(page, layer, 0, slot, 0);
    const uint8_t* v = EntryPtr(page, layer, 1, slot, 0);
    for (int64_t i = 0; i < run; ++i) {
      k_rows[pos - begin + i] = k + i * k_row;
      v_rows[pos - begin + i] = v + i * v_row;
    }
    pos += run;
  }
}

void PagedKvCache::Read(int64_t seq_id, int layer, int64_t begin, int64_t end, float* k,
                        float* v) const {
  const Sequence& seq = Get(seq_id);
  const int64_t page_size = options_.page_size_tokens;
  EXL3_CHECK(layer >= 0 && layer < shape_.num_layers && begin >= 0 && begin <= end &&
             end <= static_cast<int64_t>(seq.pages.size()) * page_size)
      << "read of [" << begin << ", " << end << ") beyond reserved pages";
  if (begin == end) return;
  const int64_t first_page = begin / page_size;
  const int64_t pages = (end - 1) / page_size - first_page + 1;
  const int64_t k_row = int64_t{shape_.num_kv_heads} * shape_.head_dim;
  const int64_t v_row = int64_t{shape_.num_kv_heads} * shape_.v_dim();
  auto read_page = [&](int64_t i, int /*worker*/) {
    const int64_t p = first_page + i;
    const int64_t lo = std::max(begin, p * page_size);
    const int64_t hi = std::min(end, (p + 1) * page_size);
    ReadRun(seq.pages[p], layer, lo % page_size, hi - lo, k + (lo - begin) * k_row,
            v + (lo - begin) * v_row);
  };
  // Below ~64 K values a read is a few microseconds: waking the pool would
  // cost more than it saves.
  constexpr int64_t kParallelValues = int64_t{1} << 16;
  if (pages > 1 && (end - begin) * (k_row + v_row) >= kParallelValues) {
    kernels::cpu::SharedThreadPool().ParallelFor(pages, 0, read_page);
  } else {
    for (int64_t i = 0; i < pages; ++i) read_page(i, 0);
  }
}

}  // namespace exl3serve::worker
