#pragma once
// Lock discipline the compiler checks: Clang's thread-safety analysis. State that a mutex
// guards says so (KEEL_GUARDED_BY), functions that need it held say so (KEEL_REQUIRES), and
// clang -Wthread-safety proves every access holds it (tests/thread_safety/check.sh runs that
// check over the sources that use these, as part of `make test`). Under GCC the macros are
// empty and base::mutex is a std::mutex.

#include <mutex>

#if defined(__clang__)
#define KEEL_TSA(x) __attribute__((x))
#else
#define KEEL_TSA(x)
#endif

#define KEEL_CAPABILITY(x) KEEL_TSA(capability(x))
#define KEEL_SCOPED_CAPABILITY KEEL_TSA(scoped_lockable)
#define KEEL_GUARDED_BY(x) KEEL_TSA(guarded_by(x))
#define KEEL_PT_GUARDED_BY(x) KEEL_TSA(pt_guarded_by(x))
#define KEEL_REQUIRES(...) KEEL_TSA(requires_capability(__VA_ARGS__))
#define KEEL_ACQUIRE(...) KEEL_TSA(acquire_capability(__VA_ARGS__))
#define KEEL_RELEASE(...) KEEL_TSA(release_capability(__VA_ARGS__))
#define KEEL_TRY_ACQUIRE(...) KEEL_TSA(try_acquire_capability(__VA_ARGS__))
#define KEEL_EXCLUDES(...) KEEL_TSA(locks_excluded(__VA_ARGS__))
#define KEEL_NO_THREAD_SAFETY_ANALYSIS KEEL_TSA(no_thread_safety_analysis)

namespace keel::base {

//! A std::mutex the analysis knows about.
class KEEL_CAPABILITY("mutex") mutex {
 public:
  void lock() KEEL_ACQUIRE() { m_.lock(); }
  void unlock() KEEL_RELEASE() { m_.unlock(); }
  bool try_lock() KEEL_TRY_ACQUIRE(true) { return m_.try_lock(); }
  //! For std::condition_variable, which waits on a std::unique_lock<std::mutex>.
  std::mutex& native() noexcept { return m_; }

 private:
  std::mutex m_;
};

//! Holds a base::mutex for its scope (std::scoped_lock, as the analysis sees it).
class KEEL_SCOPED_CAPABILITY lock_guard {
 public:
  explicit lock_guard(mutex& m) KEEL_ACQUIRE(m) : m_(m) { m_.lock(); }
  ~lock_guard() KEEL_RELEASE() { m_.unlock(); }
  lock_guard(const lock_guard&) = delete;
  lock_guard& operator=(const lock_guard&) = delete;

 private:
  mutex& m_;
};

//! Holds a base::mutex from construction, and may let it go and take it again in between
//! (std::unique_lock, as the analysis sees it).
class KEEL_SCOPED_CAPABILITY unique_lock {
 public:
  explicit unique_lock(mutex& m) KEEL_ACQUIRE(m) : m_(m) { m_.lock(); }
  ~unique_lock() KEEL_RELEASE() {
    if (held_) m_.unlock();
  }
  void lock() KEEL_ACQUIRE() {
    m_.lock();
    held_ = true;
  }
  void unlock() KEEL_RELEASE() {
    m_.unlock();
    held_ = false;
  }
  unique_lock(const unique_lock&) = delete;
  unique_lock& operator=(const unique_lock&) = delete;

 private:
  mutex& m_;
  bool held_ = true;
};

}  // namespace keel::base
