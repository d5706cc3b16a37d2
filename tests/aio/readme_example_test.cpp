// The README's example of overlapping compute with writes, compiled and run as it is shown
// there (between the markers), so the first code a newcomer reads keeps working.

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "keel/aio/controller.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

void render(std::uint64_t frame, std::vector<std::byte>& buf) {
  std::memset(buf.data(), static_cast<int>(frame & 0xff), buf.size());
}

TEST(ReadmeExample, OverlapsComputeWithWritesAndLeavesEveryFrameOnDisk) {
  keel::test::temp_dir dir;
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  const std::uint64_t frames = 100;
  {
    // --- README ---
    using namespace keel::aio;

    auto ctl = controller::start().value();  // io_uring where it works here, else posix
    file out = ctl->open("frames.bin", {.read = false, .write = true, .create = true}).value();
    std::vector<std::vector<std::byte>> bufs(4, std::vector<std::byte>(64 << 10));
    std::vector<receipt> writing(bufs.size());
    for (std::uint64_t i = 0; i < frames; ++i) {
      auto& buf = bufs[i % bufs.size()];
      if (writing[i % bufs.size()].valid()) writing[i % bufs.size()].wait().value();  // buffer free
      render(i, buf);  // computes while earlier writes run
      writing[i % bufs.size()] = out.write(i * buf.size(), buf);
      if (i % 30 == 29) out.fsync();  // covers this thread's earlier writes
    }
    out.fsync().wait().value();  // all of it on stable storage
    // --- end ---
  }
  std::filesystem::current_path(cwd);
  const std::string data = keel::test::slurp(dir.file("frames.bin"));
  ASSERT_EQ(data.size(), frames * (64 << 10));
  for (std::uint64_t i = 0; i < frames; ++i) {
    EXPECT_EQ(static_cast<unsigned char>(data[i * (64 << 10)]), i & 0xff) << "frame " << i;
    EXPECT_EQ(static_cast<unsigned char>(data[(i + 1) * (64 << 10) - 1]), i & 0xff);
  }
}

}  // namespace
