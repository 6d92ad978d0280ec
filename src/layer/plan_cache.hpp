// PlanCache: MoeLayer's per-token-count cache (plans, workspace sizes),
// bounded by a capacity fixed at construction. When full, inserting drops
// the least recently used entry, so a server that sees every token count
// from 1 to its maximum holds at most `capacity` entries. Values are handed
// out as shared pointers: one evicted while a forward still uses it lives
// until that forward lets go. Thread-safe (one mutex; a lookup locks once).
// Internal (not under include/).
//
// Tested in tests/layer/test_plan_cache.cpp (CPU): the bound, the eviction
// order, values surviving their eviction, and concurrent use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "fp4moe/error.hpp"

namespace fp4moe {

template <typename Value>
class PlanCache {
 public:
  explicit PlanCache(size_t capacity) : capacity_(capacity) {
    FP4MOE_CHECK(capacity >= 1, "PlanCache: capacity = 0; expected >= 1");
  }

  // The value cached for `key`, now the most recently used; null if absent.
  std::shared_ptr<const Value> find(int64_t key) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return it->second->second;
  }

  // Caches `value` under `key` unless a value is there already (another
  // thread may have computed the same one meanwhile); returns the cached
  // value and whether this call added it. Evicts the least recently used
  // entry when full.
  std::pair<std::shared_ptr<const Value>, bool> insert(int64_t key, Value value) const {
    auto fresh = std::make_shared<const Value>(std::move(value));
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = index_.find(key);
    if (it != index_.end()) {
      order_.splice(order_.begin(), order_, it->second);
      return {it->second->second, false};
    }
    if (index_.size() == capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    order_.emplace_front(key, std::move(fresh));
    index_.emplace(key, order_.begin());
    return {order_.front().second, true};
  }

  size_t size() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return index_.size();
  }
  size_t capacity() const { return capacity_; }

 private:
  using Entry = std::pair<int64_t, std::shared_ptr<const Value>>;
  const size_t capacity_;
  mutable std::mutex mutex_;
  mutable std::list<Entry> order_;  // most recently used first
  mutable std::unordered_map<int64_t, typename std::list<Entry>::iterator> index_;
};

}  // namespace fp4moe
