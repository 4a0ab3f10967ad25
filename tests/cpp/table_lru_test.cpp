// The device-table cache's rules (csrc/cuda/table_lru.h) without a GPU; run by
// tests/test_capture_recipe.py. Prints "ok" and exits 0 when every check holds; otherwise prints
// each failed check's line and exits 1.
#include "cuda/table_lru.h"

#include <cstdio>
#include <string>

namespace {

int failures = 0;

#define CHECK(cond)                                              \
  do {                                                           \
    if (!(cond)) {                                               \
      std::printf("FAILED line %d: %s\n", __LINE__, #cond);      \
      ++failures;                                                \
    }                                                            \
  } while (0)

using mpkern::cuda::HitAction;
using mpkern::cuda::MissAction;
using mpkern::cuda::on_hit;
using mpkern::cuda::on_miss;
using mpkern::cuda::TableLru;

struct Collide {  // every key in one bucket: lookups must compare the bytes, not the hash
  size_t operator()(std::string_view) const { return 7; }
};

std::string bytes_of(int i) { return "table-" + std::to_string(i) + std::string(1, '\0') + "tail"; }

template <typename Lru>
bool has(Lru& lru, int device, int i) {
  return lru.find(device, bytes_of(i), false) != nullptr;
}

template <typename Hash>
void lookup_and_eviction() {
  TableLru<int, Hash> lru(3);
  CHECK(lru.find(0, bytes_of(1), false) == nullptr);
  lru.insert(0, bytes_of(1), 101, false);
  lru.insert(0, bytes_of(2), 102, false);
  lru.insert(1, bytes_of(1), 201, false);  // the same bytes on another device: another entry
  auto* e = lru.find(0, bytes_of(1), false);
  CHECK(e != nullptr && e->payload == 101);
  e = lru.find(1, bytes_of(1), false);
  CHECK(e != nullptr && e->payload == 201);
  CHECK(lru.find(0, "table-1", false) == nullptr);  // a prefix of a key (the bytes hold a NUL) is no hit
  CHECK(lru.size() == 3);
  // recency now: (1, t1), (0, t1), (0, t2); one more entry drops the least recently used, (0, t2)
  lru.find(0, bytes_of(1), false);
  lru.insert(0, bytes_of(3), 103, false);
  CHECK(lru.size() == 3);
  CHECK(!has(lru, 0, 2));
  CHECK(has(lru, 0, 1) && has(lru, 1, 1) && has(lru, 0, 3));
}

template <typename Hash>
void pinning() {
  TableLru<int, Hash> lru(2);
  lru.insert(0, bytes_of(1), 1, /*captured=*/true);  // built during a capture
  lru.insert(0, bytes_of(2), 2, false);
  lru.find(0, bytes_of(2), /*capturing=*/true);        // hit during a capture: pinned from now on
  CHECK(lru.pinned() == 2);
  for (int i = 10; i < 20; ++i) lru.insert(0, bytes_of(i), i, false);
  // the two pinned entries survive any number of newer ones and do not count against the limit
  CHECK(lru.size() == 4 && lru.pinned() == 2);
  CHECK(has(lru, 0, 1) && has(lru, 0, 2) && has(lru, 0, 18) && has(lru, 0, 19) && !has(lru, 0, 17));
  // an eager hit does not unpin
  lru.find(0, bytes_of(1), false);
  CHECK(lru.pinned() == 2);
  lru.clear_unpinned();
  CHECK(lru.size() == 2 && has(lru, 0, 1) && has(lru, 0, 2) && !has(lru, 0, 19));
  // a cleared key is a miss, then a new entry
  CHECK(lru.find(0, bytes_of(19), false) == nullptr);
  lru.insert(0, bytes_of(19), 19, false);
  CHECK(lru.size() == 3 && has(lru, 0, 19));
}

void actions() {
  CHECK(on_miss(false) == MissAction::kBuildOnStream);
  CHECK(on_miss(true) == MissAction::kBuildBesideCapture);
  // eager: the building stream is ordered already; another stream waits until the copy is seen
  // complete, then only records the buffer
  CHECK(on_hit(false, true, false) == HitAction::kNone);
  CHECK(on_hit(false, true, true) == HitAction::kNone);
  CHECK(on_hit(false, false, false) == HitAction::kQueryThenWait);
  CHECK(on_hit(false, false, true) == HitAction::kRecordStream);
  // capturing: nothing is waited on or recorded on the capturing stream
  for (bool same : {false, true}) {
    for (bool landed : {false, true}) CHECK(on_hit(true, same, landed) == HitAction::kNone);
  }
}

}  // namespace

int main() {
  lookup_and_eviction<std::hash<std::string_view>>();
  lookup_and_eviction<Collide>();
  pinning<std::hash<std::string_view>>();
  pinning<Collide>();
  actions();
  if (failures) return 1;
  std::printf("ok\n");
  return 0;
}
