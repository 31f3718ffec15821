// What tutti's framework glue shares (tutti.jax's XLA handlers, tutti.tensorflow's ops): the
// communicators that compiled programs name, by slot, and libtutti's last error as text.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace tutti_glue {

typedef size_t (*last_error_fn)(char *, size_t);

// The communicators that graphs and programs name, by slot: a number tutti's Python side gives a
// communicator once and never again. A program compiled for a communicator that was closed then
// fails, saying so, instead of reaching another communicator allocated at the same address; and
// closing waits for the calls in flight.
class Slots {
 public:
  void Set(uint64_t slot, void *comm) {
    std::lock_guard<std::mutex> guard(mu_);
    entries_[slot].comm = comm;
  }

  // The communicator of `slot`, counted in use until Leave; nullptr where it was closed.
  void *Enter(uint64_t slot) {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = entries_.find(slot);
    if (it == entries_.end() || it->second.comm == nullptr) return nullptr;
    it->second.calls += 1;
    return it->second.comm;
  }

  void Leave(uint64_t slot) {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = entries_.find(slot);
    if (it != entries_.end() && --it->second.calls == 0) cv_.notify_all();
  }

  // Forget `slot` (later calls fail) and wait up to `wait_ms` for the calls in flight; how many
  // are still in flight.
  int Close(uint64_t slot, int64_t wait_ms) {
    std::unique_lock<std::mutex> guard(mu_);
    auto it = entries_.find(slot);
    if (it == entries_.end()) return 0;
    it->second.comm = nullptr;
    cv_.wait_for(guard, std::chrono::milliseconds(wait_ms < 0 ? 0 : wait_ms), [&] {
      auto e = entries_.find(slot);
      return e == entries_.end() || e->second.calls == 0;
    });
    // Found again: a slot set meanwhile may have moved the entries.
    it = entries_.find(slot);
    if (it == entries_.end()) return 0;
    int left = it->second.calls;
    if (left == 0) entries_.erase(it);
    return left;
  }

 private:
  struct Entry {
    void *comm = nullptr;
    int calls = 0;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint64_t, Entry> entries_;
};

// Each glue library's own table (internal linkage: two glue libraries in one process do not
// share one through the dynamic linker).
static inline Slots &slots() {
  static Slots *s = new Slots();  // never destroyed: worker threads may outlive static teardown
  return *s;
}

// "tutti <what> failed: <libtutti's message for this thread's last failure>".
inline std::string Failure(last_error_fn last_error, const std::string &what, uint32_t code) {
  std::string message = "tutti " + what + " failed";
  size_t n = last_error(nullptr, 0);
  if (n > 0) {
    std::string text(n + 1, '\0');
    last_error(&text[0], text.size());
    text.resize(n);
    message += ": " + text;
  } else {
    message += " (code " + std::to_string(code) + ")";
  }
  return message;
}

// The message of a call on a communicator that was closed.
inline std::string Closed(const std::string &what) {
  return "tutti " + what + ": the communicator this was compiled for is closed";
}

}  // namespace tutti_glue
