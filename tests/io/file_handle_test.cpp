#include "keel/io/file_handle.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "support/process.hpp"

namespace keel::io {

using keel::test::temp_dir;
using open_flags::read_write;

namespace {

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> v(s.size());
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());
  return v;
}

std::string read_all(const std::string& path) {
  auto f = file_handle::open(path.c_str(), open_flags::read);
  if (!f) return "<" + f.error().message() + ">";
  auto size = f->size();
  std::string s(static_cast<std::size_t>(*size), '\0');
  auto n = f->read_at(0, std::as_writable_bytes(std::span(s)));
  s.resize(n ? *n : 0);
  return s;
}

constexpr open_flags create_rw = open_flags::read_write | open_flags::create;

}  // namespace

TEST(FileHandle, OpenErrorsAreTheKernels) {
  temp_dir dir;
  auto missing = file_handle::open(dir.file("nope").c_str(), open_flags::read);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(missing.error().value(), ENOENT);

  ASSERT_TRUE(file_handle::open(dir.file("a").c_str(), create_rw));
  auto again = file_handle::open(dir.file("a").c_str(), create_rw | open_flags::exclusive);
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error(), std::errc::file_exists);
}

TEST(FileHandle, BadFlagsAreRejectedBeforeTheKernel) {
  temp_dir dir;
  auto no_access = file_handle::open(dir.file("a").c_str(), open_flags::create);
  ASSERT_FALSE(no_access);
  EXPECT_EQ(no_access.error(), std::errc::invalid_argument);
  auto excl =
      file_handle::open(dir.file("a").c_str(), open_flags::read_write | open_flags::exclusive);
  ASSERT_FALSE(excl);
  EXPECT_EQ(excl.error(), std::errc::invalid_argument);
  EXPECT_FALSE(std::filesystem::exists(dir.file("a")));
  EXPECT_EQ(file_handle::open(nullptr, open_flags::read).error(), std::errc::invalid_argument);
}

TEST(FileHandle, EveryDescriptorIsCloseOnExec) {
  temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  EXPECT_NE(::fcntl(f->fd(), F_GETFD) & FD_CLOEXEC, 0);
  auto d = file_handle::open_directory(dir.path().c_str());
  ASSERT_TRUE(d);
  EXPECT_NE(::fcntl(d->fd(), F_GETFD) & FD_CLOEXEC, 0);
  auto t = file_handle::temp_file(dir.path().c_str());
  if (t) {
    EXPECT_NE(::fcntl(t->fd(), F_GETFD) & FD_CLOEXEC, 0);
  }
}

TEST(FileHandle, WriteThenReadBack) {
  temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  const auto data = bytes_of("hello, keel");
  ASSERT_TRUE(f->write_at(100, data));
  EXPECT_EQ(f->size().value(), 111);
  std::vector<std::byte> back(data.size());
  auto n = f->read_at(100, back);
  ASSERT_TRUE(n);
  EXPECT_EQ(*n, data.size());
  EXPECT_EQ(back, data);
  // The hole before it reads as zeros.
  std::vector<std::byte> hole(100, std::byte{1});
  EXPECT_EQ(f->read_at(0, hole).value(), 100u);
  EXPECT_EQ(hole, std::vector<std::byte>(100));
}

TEST(FileHandle, ReadReportsEndOfFileTruthfully) {
  temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  ASSERT_TRUE(f->write_at(0, bytes_of("0123456789")));
  std::vector<std::byte> buf(64);
  EXPECT_EQ(f->read_at(4, buf).value(), 6u);  // short only because the file ends
  EXPECT_EQ(f->read_at(10, buf).value(), 0u);
  EXPECT_EQ(f->read_at(1'000'000, buf).value(), 0u);
  EXPECT_EQ(f->read_at(0, std::span<std::byte>()).value(), 0u);
}

TEST(FileHandle, NegativeAndOverflowingOffsetsAreInvalid) {
  temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  std::vector<std::byte> buf(16);
  EXPECT_EQ(f->read_at(-1, buf).error(), std::errc::invalid_argument);
  EXPECT_EQ(f->write_at(-1, buf).error(), std::errc::invalid_argument);
  const off_t near_max = std::numeric_limits<off_t>::max() - 8;
  EXPECT_EQ(f->read_at(near_max, buf).error(), std::errc::invalid_argument);
  EXPECT_EQ(f->write_at(near_max, buf).error(), std::errc::invalid_argument);
  EXPECT_EQ(f->truncate(-1).error(), std::errc::invalid_argument);
  EXPECT_EQ(f->allocate(-1, 10).error(), std::errc::invalid_argument);
  EXPECT_EQ(f->allocate(0, 0).error(), std::errc::invalid_argument);
  EXPECT_EQ(f->allocate(near_max, 100).error(), std::errc::invalid_argument);
  EXPECT_EQ(f->size().value(), 0);  // nothing was written by any of them
}

TEST(FileHandle, BadDescriptorsAreReported) {
  file_handle closed;
  std::vector<std::byte> buf(16);
  EXPECT_EQ(closed.read_at(0, buf).error(), std::errc::bad_file_descriptor);
  EXPECT_EQ(closed.write_at(0, buf).error(), std::errc::bad_file_descriptor);
  EXPECT_EQ(closed.sync_data().error(), std::errc::bad_file_descriptor);
  EXPECT_EQ(closed.sync_all().error(), std::errc::bad_file_descriptor);
  EXPECT_EQ(closed.size().error(), std::errc::bad_file_descriptor);
  EXPECT_EQ(closed.truncate(0).error(), std::errc::bad_file_descriptor);
  EXPECT_TRUE(closed.close());  // closing nothing is not an error

  temp_dir dir;
  auto ro = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(ro);
  auto reader = file_handle::open(dir.file("a").c_str(), open_flags::read);
  ASSERT_TRUE(reader);
  EXPECT_EQ(reader->write_at(0, buf).error(), std::errc::bad_file_descriptor);
  auto writer = file_handle::open(dir.file("a").c_str(), open_flags::write);
  ASSERT_TRUE(writer);
  EXPECT_EQ(writer->read_at(0, buf).error(), std::errc::bad_file_descriptor);
}

TEST(FileHandle, MoveTransfersOwnership) {
  temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  const int fd = f->fd();
  file_handle moved = std::move(*f);
  EXPECT_FALSE(f->is_open());
  EXPECT_EQ(moved.fd(), fd);
  file_handle other;
  other = std::move(moved);
  EXPECT_EQ(other.fd(), fd);
  ASSERT_TRUE(other.close());
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);  // really closed
}

TEST(FileHandle, VectoredTransfersAcrossManyBuffers) {
  temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  // 200 buffers of varied sizes (some empty) exceed the 64-entry window of one call.
  std::vector<std::vector<std::byte>> out(200);
  std::vector<iovec> out_iov;
  std::size_t total = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i].resize(i % 7 == 0 ? 0 : 1 + (i * 37) % 300);
    for (std::size_t j = 0; j < out[i].size(); ++j)
      out[i][j] = std::byte((i * 131 + j) & 0xff);
    out_iov.push_back({out[i].data(), out[i].size()});
    total += out[i].size();
  }
  ASSERT_TRUE(f->write_at(7, out_iov));
  EXPECT_EQ(f->size().value(), static_cast<off_t>(7 + total));

  std::vector<std::vector<std::byte>> in(out.size());
  std::vector<iovec> in_iov;
  for (std::size_t i = 0; i < in.size(); ++i) {
    in[i].resize(out[i].size());
    in_iov.push_back({in[i].data(), in[i].size()});
  }
  EXPECT_EQ(f->read_at(7, in_iov).value(), total);
  EXPECT_EQ(in, out);

  // Reading past the end stops truthfully part-way through the buffers.
  std::vector<std::byte> a(10), b(10);
  std::vector<iovec> two = {{a.data(), a.size()}, {b.data(), b.size()}};
  EXPECT_EQ(f->read_at(static_cast<off_t>(7 + total - 15), two).value(), 15u);
  EXPECT_EQ(f->read_at(-1, two).error(), std::errc::invalid_argument);
}

// A pread never moves more than about 2 GiB at once; the rest must come from retries.
TEST(FileHandle, ShortReadsAreRetried) {
#if defined(__SANITIZE_THREAD__)
  // Its pread interceptor marks the whole 2 GiB buffer written, shadow page by shadow page:
  // minutes on a busy machine. The release and AddressSanitizer runs read it.
  GTEST_SKIP() << "ThreadSanitizer takes minutes over a 2 GiB read";
#endif
  // On a tmpfs where there is one: its holes read as fast as memory (16 s of system time on
  // an ext4 disk here; what is tested is the syscall's cap, the same everywhere).
  temp_dir dir(::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : nullptr);
  auto f = file_handle::open(dir.file("big").c_str(), create_rw);
  ASSERT_TRUE(f);
  const std::size_t size = (std::size_t{2} << 30) + 3 * 4096 + 17;
  ASSERT_TRUE(f->truncate(static_cast<off_t>(size)));  // sparse: takes no space
  const std::byte tail[] = {std::byte{'e'}, std::byte{'n'}, std::byte{'d'}};
  ASSERT_TRUE(f->write_at(static_cast<off_t>(size - 3), tail));
  void* mem = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  (void)::madvise(mem, size, MADV_HUGEPAGE);  // a fault per 2 MiB, not per page (a hint)
  auto* buf = static_cast<std::byte*>(mem);
  auto n = f->read_at(0, std::span(buf, size));
  ASSERT_TRUE(n);
  EXPECT_EQ(*n, size);
  EXPECT_EQ(std::memcmp(buf + size - 3, tail, 3), 0);
  ::munmap(mem, size);
}

// A file-size limit makes the kernel accept only part of a write, then refuse the rest: the
// prefix lands and the refusal comes back as an error, not as success.
TEST(FileHandle, ShortWriteThenErrorIsReported) {
  temp_dir dir;
  const std::string path = dir.file("limited");
  const pid_t child = keel::test::fork_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{.rlim_cur = 10'000, .rlim_max = 10'000};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 10;
    auto f = file_handle::open(path.c_str(), create_rw);
    if (!f) return 11;
    std::vector<std::byte> data(16'384, std::byte{'x'});
    auto r = f->write_at(0, data);
    if (r) return 12;
    if (r.error() != std::errc::file_too_large) return 13;
    return 0;
  });
  EXPECT_EQ(keel::test::wait_exit(child), 0);
  EXPECT_EQ(std::filesystem::file_size(path), 10'000u);
}

TEST(FileHandle, TruncateAllocateAndSync) {
  temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  ASSERT_TRUE(f->truncate(5000));
  EXPECT_EQ(f->size().value(), 5000);
  ASSERT_TRUE(f->allocate(0, 1 << 20));
  EXPECT_EQ(f->size().value(), 1 << 20);
  struct stat st {};
  ASSERT_EQ(::fstat(f->fd(), &st), 0);
  EXPECT_GE(st.st_blocks * 512, 1 << 20);  // really reserved, not sparse
  EXPECT_TRUE(f->sync_data());
  EXPECT_TRUE(f->sync_all());
  ASSERT_TRUE(f->truncate(10));
  EXPECT_EQ(f->size().value(), 10);
  EXPECT_TRUE(sync_directory(dir.path().c_str()));
  EXPECT_EQ(sync_directory(dir.file("none").c_str()).error(), std::errc::no_such_file_or_directory);
}

TEST(FileHandle, AnonymousTempFileGetsANameWhenLinked) {
  temp_dir dir;
  auto t = file_handle::temp_file(dir.path().c_str());
  if (!t && t.error() == std::errc::operation_not_supported) {
    GTEST_SKIP() << "this filesystem has no O_TMPFILE: " << t.error().message();
  }
  ASSERT_TRUE(t) << t.error().message();
  ASSERT_TRUE(t->write_at(0, bytes_of("anonymous")));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  auto d = file_handle::open_directory(dir.path().c_str());
  ASSERT_TRUE(d);
  ASSERT_TRUE(t->link_at(*d, "named"));
  EXPECT_EQ(read_all(dir.file("named")), "anonymous");
  auto again = t->link_at(*d, "named");
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error(), std::errc::file_exists);
  // Without a directory handle the name is a path.
  ASSERT_TRUE(t->link_at(file_handle{}, dir.file("by-path").c_str()));
  EXPECT_EQ(read_all(dir.file("by-path")), "anonymous");
  EXPECT_EQ(file_handle::temp_file(dir.path().c_str(), open_flags::read).error(),
            std::errc::invalid_argument);
  EXPECT_FALSE(file_handle::temp_file(dir.file("missing").c_str()));
}

TEST(FileHandle, OpenAtAndUnlink) {
  temp_dir dir;
  auto d = file_handle::open_directory(dir.path().c_str());
  ASSERT_TRUE(d);
  auto f = file_handle::open_at(*d, "child", create_rw);
  ASSERT_TRUE(f);
  EXPECT_TRUE(std::filesystem::exists(dir.file("child")));
  EXPECT_TRUE(unlink_at(*d, "child"));
  EXPECT_FALSE(std::filesystem::exists(dir.file("child")));
  EXPECT_EQ(unlink_at(*d, "child").error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(unlink(dir.file("child").c_str()).error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(file_handle::open_at(file_handle{}, "x", create_rw).error(),
            std::errc::bad_file_descriptor);
  EXPECT_EQ(file_handle::open_directory(dir.file("none").c_str()).error(),
            std::errc::no_such_file_or_directory);
}

TEST(AtomicReplace, CreatesAndReplaces) {
  temp_dir dir;
  const std::string path = dir.file("target");
  ASSERT_TRUE(atomic_replace(path.c_str(), bytes_of("first")));
  EXPECT_EQ(read_all(path), "first");
  ASSERT_TRUE(atomic_replace(path.c_str(), bytes_of("second, longer")));
  EXPECT_EQ(read_all(path), "second, longer");
  ASSERT_TRUE(atomic_replace(path.c_str(), bytes_of("")));
  EXPECT_EQ(read_all(path), "");
  // Nothing else is left in the directory.
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path()))
    ++entries;
  EXPECT_EQ(entries, 1u);
}

TEST(AtomicReplace, BadInputIsRejected) {
  temp_dir dir;
  EXPECT_EQ(atomic_replace(nullptr, {}).error(), std::errc::invalid_argument);
  EXPECT_EQ(atomic_replace("", {}).error(), std::errc::invalid_argument);
  EXPECT_EQ(atomic_replace((dir.path().string() + "/").c_str(), {}).error(),
            std::errc::is_a_directory);
  EXPECT_EQ(atomic_replace(dir.file("none/target").c_str(), {}).error(),
            std::errc::no_such_file_or_directory);
}

namespace {

struct kill_at {
  replace_step step;
};

void kill_hook(replace_step s, void* context) noexcept {
  if (s == static_cast<kill_at*>(context)->step) ::kill(::getpid(), SIGKILL);
}

}  // namespace

// The writer is killed before each step in turn: the target always holds the old or the new
// content, never a mix, never nothing.
TEST(AtomicReplace, WriterKilledBetweenEveryPairOfSteps) {
  const std::string old_content(100'000, 'o');
  const std::string new_content(150'000, 'n');
  for (const auto step :
       {replace_step::create_temp, replace_step::write, replace_step::sync_temp,
        replace_step::link_temp, replace_step::rename, replace_step::sync_directory}) {
    SCOPED_TRACE(static_cast<int>(step));
    temp_dir dir;
    const std::string path = dir.file("target");
    ASSERT_TRUE(atomic_replace(path.c_str(), bytes_of(old_content)));
    const pid_t child = keel::test::fork_child([&] {
      kill_at context{step};
      replace_options options;
      options.hook = kill_hook;
      options.hook_context = &context;
      (void)atomic_replace(path.c_str(), bytes_of(new_content), options);
      return 0;  // the step was never reached (no O_TMPFILE: there is no link step)
    });
    const int code = keel::test::wait_exit(child);
    const std::string now = read_all(path);
    EXPECT_TRUE(now == old_content || now == new_content) << "torn: " << now.size() << " bytes";
    if (code == 128 + SIGKILL) {
      // Killed before the rename: still the old content; after it: the new.
      EXPECT_EQ(now == new_content, step == replace_step::sync_directory);
    }
  }
}

}  // namespace keel::io
