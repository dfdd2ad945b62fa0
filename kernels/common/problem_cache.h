#pragma once

// What the first-use autotuned paths share (cuBLASLt's plans,
// kernels/cublaslt/lt_matmul.cpp; cuDNN's fused graphs,
// ops/cuda/conv/cudnn_fusion.cpp): a problem named by integers, among them
// its pointers' alignments, and a bounded cache of one shared entry per
// problem.  Plain C++.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace torchfuse::kernels {

// The largest power of two <= 256 dividing the address (as PyTorch passes
// to CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES); 256 for null.
inline uint32_t pointerAlignment(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) {
    alignment /= 2;
  }
  return alignment;
}

// A hash of any sequence of integers (std::array, std::vector).
struct IntegerKeyHash {
  template <typename Key>
  size_t operator()(const Key& key) const noexcept {
    size_t h = 0;
    for (const int64_t v : key) {
      h = h * 1000003u ^ std::hash<int64_t>{}(v);
    }
    return h;
  }
};

// The entry of `key`, made on first use; one cache per (Key, Entry) type.
// Entries are shared, so one in use outlives the cache's reset.
// NB: a bound, not an LRU: models have few distinct problems; a full cache
// is dropped.
template <typename Key, typename Entry, size_t kMaxEntries = 1024>
std::shared_ptr<Entry> problemEntry(const Key& key) {
  static std::mutex mutex;
  static std::unordered_map<Key, std::shared_ptr<Entry>, IntegerKeyHash> entries;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = entries.find(key);
  if (it != entries.end()) {
    return it->second;
  }
  if (entries.size() >= kMaxEntries) {
    entries.clear();
  }
  return entries.emplace(key, std::make_shared<Entry>()).first->second;
}

} // namespace torchfuse::kernels
