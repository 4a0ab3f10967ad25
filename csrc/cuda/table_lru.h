// The rules of the device-table cache (table_cache.cpp), without CUDA: which entry a lookup finds,
// which entries stay pinned for CUDA graphs, which are evicted, and what a hit or a miss must do
// about streams and captures. Plain C++17 (no torch, no CUDA headers), so that the rules are tested
// on any machine: tests/test_capture_recipe.py compiles tests/cpp/table_lru_test.cpp against it.
//
// Entries are keyed by (device, exact bytes of the table). An entry a CUDA graph capture used
// ("captured") is pinned: never evicted and never cleared, because a replay reads its device
// buffer for as long as the graph lives and the cache cannot know when that ends. At most
// `max_unpinned` other entries are kept, the least recently used dropped first.
#pragma once

#include <cstddef>
#include <functional>
#include <iterator>
#include <list>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace mpkern {
namespace cuda {

// What a lookup that misses must do.
enum class MissAction {
  kBuildOnStream,      // eager: copy the bytes on the current stream, asynchronously
  kBuildBesideCapture  // the current stream is capturing: build the table outside the graph now
};

inline MissAction on_miss(bool capturing) {
  return capturing ? MissAction::kBuildBesideCapture : MissAction::kBuildOnStream;
}

// What a hit must do so that the current stream reads the table after its copy has landed.
enum class HitAction {
  kNone,           // same stream as the copy (stream order), or capturing: a capturing stream can
                   // neither wait on an event recorded outside the capture nor record the buffer
                   // (not needed: a captured table is pinned); torch.cuda.graph synchronises the
                   // device before it captures, so a table built before the capture has landed
  kQueryThenWait,  // another stream: done if the copy's event has completed, else the stream
                   // waits on it (no host sync); then the buffer is recorded on the stream
  kRecordStream    // another stream, the copy seen complete before: only record the buffer
};

inline HitAction on_hit(bool capturing, bool same_stream, bool landed) {
  if (capturing || same_stream) return HitAction::kNone;
  return landed ? HitAction::kRecordStream : HitAction::kQueryThenWait;
}

template <typename Payload, typename Hash = std::hash<std::string_view>>
class TableLru {
 public:
  struct Entry {
    int device;
    std::string bytes;
    Payload payload;
    bool captured;  // used by a CUDA graph capture: pinned for the life of the process
  };

  explicit TableLru(size_t max_unpinned) : max_unpinned_(max_unpinned) {}

  // The entry of (device, bytes), now the most recently used and, when `capturing`, pinned; or
  // nullptr.
  Entry* find(int device, std::string_view bytes, bool capturing) {
    auto range = index_.equal_range(key_hash(device, bytes));
    for (auto j = range.first; j != range.second; ++j) {
      auto it = j->second;
      if (it->device != device || it->bytes != bytes) continue;
      lru_.splice(lru_.begin(), lru_, it);
      it->captured = it->captured || capturing;
      return &*it;
    }
    return nullptr;
  }

  // A new entry (after a miss), the most recently used; then the least recently used unpinned
  // entries beyond the limit are dropped (never the new one: it is the most recent).
  Entry& insert(int device, std::string_view bytes, Payload payload, bool captured) {
    lru_.push_front(Entry{device, std::string(bytes), std::move(payload), captured});
    index_.emplace(key_hash(device, bytes), lru_.begin());
    Entry& e = lru_.front();
    evict();
    return e;
  }

  // Drop every unpinned entry.
  void clear_unpinned() {
    for (auto it = lru_.begin(); it != lru_.end();) it = it->captured ? std::next(it) : erase(it);
  }

  size_t size() const { return lru_.size(); }
  size_t pinned() const {
    size_t n = 0;
    for (const Entry& e : lru_) n += e.captured;
    return n;
  }
  // Entries, most recently used first (tests).
  const std::list<Entry>& entries() const { return lru_; }

 private:
  using Iter = typename std::list<Entry>::iterator;

  size_t key_hash(int device, std::string_view bytes) const {
    return Hash()(bytes) ^ (static_cast<size_t>(device) * 0x9e3779b97f4a7c15ull);
  }

  Iter erase(Iter it) {
    auto range = index_.equal_range(key_hash(it->device, it->bytes));
    for (auto j = range.first; j != range.second; ++j) {
      if (j->second == it) {
        index_.erase(j);
        break;
      }
    }
    return lru_.erase(it);
  }

  void evict() {
    size_t unpinned = lru_.size() - pinned();
    for (auto it = lru_.end(); unpinned > max_unpinned_ && it != lru_.begin();) {
      --it;
      if (it->captured) continue;
      it = erase(it);
      --unpinned;
    }
  }

  size_t max_unpinned_;
  std::list<Entry> lru_;  // most recently used first
  std::unordered_multimap<size_t, Iter> index_;
};

}  // namespace cuda
}  // namespace mpkern
