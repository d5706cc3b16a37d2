// inspect, for sysv: the counts of its semaphore set. A slot's writer semaphore is 1 while
// one process holds it exclusively, and only that process changes it meanwhile (so the
// kernel's "last process to change it" names the holder); its readers semaphore counts the
// processes that hold it shared, which the kernel does not name (their undo records are
// not shown anywhere).

#include <sys/ipc.h>
#include <sys/sem.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "inspect_parts.hpp"
#include "io/process.hpp"
#include "sysv_key.hpp"

namespace keel::lock::inspecting {

int semaphore_set_of(detail::file_id id) noexcept {
  const int semid = ::semget(sysv_set::key_of(id), 0, 0);
  return semid < 0 ? -1 : semid;
}

void read_semaphores(const context& ctx, int semid, lock_state& out) noexcept {
  const auto cannot = [&](int err) {
    out.not_shown.push_back(std::string("sysv's holders: its semaphore set cannot be read: ") +
                            std::strerror(err));
  };
  semid_ds ds{};
  if (::semctl(semid, 0, IPC_STAT, &ds) != 0) return cannot(errno);
  const std::uint64_t slots = ds.sem_nsems / 2;
  std::vector<unsigned short> values(ds.sem_nsems);
  if (::semctl(semid, 0, GETALL, values.data()) != 0) return cannot(errno);
  for (std::uint64_t i = 0; i < slots; ++i) {
    const unsigned short writer = values[sysv_set::writer_sem(i)];
    const unsigned short readers = values[sysv_set::readers_sem(i)];
    if (writer == 0 && readers == 0) continue;
    lock_holder h;
    h.algorithm = "sysv";
    h.host = ctx.host;
    h.entity_known = false;
    h.slot = static_cast<std::int64_t>(i);
    h.slots = slots;
    if (writer != 0) {
      const int pid = ::semctl(semid, sysv_set::writer_sem(i), GETPID);
      h.pid = pid > 0 ? static_cast<std::uint32_t>(pid) : 0;
      h.process_started =
          pid > 0 ? ctx.started_at(io::start_time_of(static_cast<pid_t>(pid), ctx.fs)) : 0;
      h.exclusive = true;
      out.holders.push_back(h);
    }
    if (readers != 0) {
      h.pid = 0;
      h.process_started = 0;
      h.exclusive = false;
      h.count = readers;
      out.holders.push_back(h);
    }
  }
}

}  // namespace keel::lock::inspecting
