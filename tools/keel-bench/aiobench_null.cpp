// keel-bench aiobench null: the framework's own cost per request, on the null engine.

#include "aiobench.hpp"

#include <aio.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "keel/aio/controller.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::tools::aiobench {

json measure_null(const std::string& dir, double seconds) {
  progress("null engine: framework overhead per request");
  aio::options o;
  o.engine = aio::engine_kind::null;
  o.workers = 1;
  auto ctl = must(aio::controller::start(o), "start the controller");
  aio::open_options how;
  how.write = true;
  how.create = true;
  aio::file f = must(ctl->open(dir + "/null.dat", how), "open");
  std::vector<std::byte> buf(4096);
  // One at a time: submit, wait.
  std::uint64_t n = 0;
  auto t0 = clock_type::now();
  double elapsed = 0;
  for (;;) {
    must(f.write(0, buf).wait(), "null write");
    if ((++n & 1023) == 0 && (elapsed = seconds_since(t0)) >= seconds) break;
  }
  const double single_ns = elapsed * 1e9 / static_cast<double>(n);
  // Batches of 64: one submission, then the waits.
  constexpr std::size_t batch = 64;
  std::vector<aio::request> reqs(batch);
  std::vector<aio::receipt> outs(batch);
  n = 0;
  t0 = clock_type::now();
  for (;;) {
    for (std::size_t k = 0; k < batch; ++k) {
      reqs[k].what = aio::request::kind::write;
      reqs[k].offset = k * buf.size();  // disjoint: nothing holds a request back
      reqs[k].buffer = buf;
    }
    f.submit(reqs, outs);
    for (auto& r : outs)
      must(r.wait(), "null write");
    n += batch;
    if ((n & 4095) == 0 && (elapsed = seconds_since(t0)) >= seconds) break;
  }
  const double batched_ns = elapsed * 1e9 / static_cast<double>(n);
  ::unlink((dir + "/null.dat").c_str());
  fmt::print("\nnull engine: {:.0f} ns per request one at a time, {:.0f} ns in batches of {}\n",
             single_ns, batched_ns, batch);
  return {{"single_ns", single_ns}, {"batched_ns", batched_ns}, {"batch", batch}};
}

}  // namespace keel::tools::aiobench
