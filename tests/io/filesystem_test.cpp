// The seam: handles opened through a filesystem come back to it for every operation, the
// loops above it survive short transfers and interruptions, errors name the file and
// offset, and the fallbacks (no O_TMPFILE, no fallocate) work.

#include "keel/io/filesystem.hpp"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "keel/io/byte_lock.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/io/mapped_file.hpp"
#include "support/process.hpp"

namespace keel::io {
namespace {

using keel::test::temp_dir;

// Counts every operation it forwards; tweaks some on request.
class counting_fs : public filesystem_wrapper {
 public:
  counting_fs() : filesystem_wrapper(os()) {}

  std::array<std::atomic<int>, fs_op_count> seen{};
  int count(fs_op op) const { return seen[static_cast<std::size_t>(op)].load(); }
  void saw(fs_op op) { seen[static_cast<std::size_t>(op)].fetch_add(1); }

  std::size_t max_transfer = 0;  // non-zero: reads and writes move at most this much
  int interrupt_every = 0;       // non-zero: every n-th read/write fails with EINTR first
  int write_error = 0;           // non-zero: writes fail with it
  bool no_tmpfile = false;       // O_TMPFILE refused as on a filesystem without it
  bool no_fallocate = false;     // fallocate refused as on a filesystem without it
  int lock_error = 0;            // non-zero: locks fail with it

  result<file_handle> open(const file_handle* dir, const char* path, open_flags flags,
                           mode_t mode) noexcept override {
    saw(fs_op::open);
    if (no_tmpfile && has(flags, open_flags::temporary)) {
      return errc_error(std::errc::operation_not_supported);
    }
    return filesystem_wrapper::open(dir, path, flags, mode);
  }
  result<std::size_t> read(const file_handle& f, off_t offset,
                           std::span<const iovec> buffers) noexcept override {
    saw(fs_op::read);
    if (interrupted()) return errc_error(std::errc::interrupted);
    return filesystem_wrapper::read(f, offset, clip(buffers));
  }
  result<std::size_t> write(const file_handle& f, off_t offset,
                            std::span<const iovec> buffers) noexcept override {
    saw(fs_op::write);
    if (write_error != 0) return errno_error(write_error);
    if (interrupted()) return errc_error(std::errc::interrupted);
    return filesystem_wrapper::write(f, offset, clip(buffers));
  }
  result<void> sync(const file_handle& f, sync_kind kind) noexcept override {
    saw(fs_op::sync);
    return filesystem_wrapper::sync(f, kind);
  }
  result<void> allocate(const file_handle& f, off_t offset, off_t length,
                        bool keep_size) noexcept override {
    saw(fs_op::allocate);
    if (no_fallocate) return errc_error(std::errc::operation_not_supported);
    return filesystem_wrapper::allocate(f, offset, length, keep_size);
  }
  result<void> close(const file_handle& f) noexcept override {
    saw(fs_op::close);
    return filesystem_wrapper::close(f);
  }
  result<void*> map(const file_handle& f, std::size_t length, off_t offset,
                    map_access access) noexcept override {
    saw(fs_op::map);
    return filesystem_wrapper::map(f, length, offset, access);
  }
  result<void> sync_map(void* address, std::size_t length, bool wait) noexcept override {
    saw(fs_op::sync_map);
    return filesystem_wrapper::sync_map(address, length, wait);
  }
  result<void> unmap(void* address, std::size_t length) noexcept override {
    saw(fs_op::unmap);
    return filesystem_wrapper::unmap(address, length);
  }
  result<void> lock(const file_handle& f, off_t offset, off_t length, lock_request request,
                    bool wait) noexcept override {
    saw(fs_op::lock);
    if (lock_error != 0) return errno_error(lock_error);
    return filesystem_wrapper::lock(f, offset, length, request, wait);
  }

 private:
  bool interrupted() { return interrupt_every != 0 && ++calls_ % interrupt_every == 1; }
  std::span<const iovec> clip(std::span<const iovec> buffers) {
    if (max_transfer == 0 || buffers.empty()) return buffers;
    clipped_ = buffers[0];
    clipped_.iov_len = std::min(clipped_.iov_len, max_transfer);
    return std::span(&clipped_, 1);
  }
  int calls_ = 0;
  iovec clipped_{};
};

std::vector<std::byte> pattern(std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::byte>(i * 131 + 7);
  return v;
}

constexpr open_flags create_rw = open_flags::read_write | open_flags::create;

TEST(Filesystem, HandlesComeBackToTheirFilesystem) {
  temp_dir dir;
  counting_fs fs;
  {
    auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
    ASSERT_TRUE(f) << f.error();
    EXPECT_EQ(&f->fs(), &fs);
    EXPECT_EQ(f->path(), dir.file("a"));
    ASSERT_TRUE(f->write_at(0, pattern(100)));
    ASSERT_TRUE(f->sync_data());
    std::vector<std::byte> back(100);
    ASSERT_EQ(f->read_at(0, back).value(), 100u);
    auto d = file_handle::open_directory(fs, dir.path().c_str());
    ASSERT_TRUE(d);
    auto g = file_handle::open_at(*d, "b", create_rw);
    ASSERT_TRUE(g);
    EXPECT_EQ(&g->fs(), &fs);
    EXPECT_EQ(g->path(), dir.file("b"));
  }
  EXPECT_EQ(fs.count(fs_op::open), 3);
  EXPECT_EQ(fs.count(fs_op::write), 1);
  EXPECT_EQ(fs.count(fs_op::sync), 1);
  EXPECT_EQ(fs.count(fs_op::read), 1);
  EXPECT_EQ(fs.count(fs_op::close), 3);
  // The default is the real thing.
  auto plain = file_handle::open(dir.file("c").c_str(), create_rw);
  ASSERT_TRUE(plain);
  EXPECT_EQ(&plain->fs(), &os());
}

TEST(Filesystem, ShortTransfersAndInterruptionsAreContinued) {
  temp_dir dir;
  counting_fs fs;
  fs.max_transfer = 7;
  fs.interrupt_every = 3;
  auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  const auto data = pattern(1000);
  ASSERT_TRUE(f->write_at(5, data));
  EXPECT_GT(fs.count(fs_op::write), 1000 / 7);
  std::vector<std::byte> back(1000);
  ASSERT_EQ(f->read_at(5, back).value(), 1000u);
  EXPECT_EQ(back, data);
  // Vectored, across buffer boundaries.
  std::vector<std::byte> a(3);
  std::vector<std::byte> b(500);
  std::vector<std::byte> c(497);
  const std::array<iovec, 3> iov = {iovec{a.data(), a.size()}, iovec{b.data(), b.size()},
                                    iovec{c.data(), c.size()}};
  ASSERT_EQ(f->read_at(5, iov).value(), 1000u);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), data.begin()));
  EXPECT_TRUE(std::equal(c.begin(), c.end(), data.begin() + 503));
}

TEST(Filesystem, ErrorsNameTheFileAndOffset) {
  temp_dir dir;
  counting_fs fs;
  auto f = file_handle::open(fs, dir.file("data").c_str(), create_rw);
  ASSERT_TRUE(f);
  fs.write_error = EIO;
  auto w = f->write_at(8192, pattern(10));
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error(), std::errc::io_error);
  EXPECT_EQ(w.error().path(), dir.file("data"));
  EXPECT_EQ(w.error().offset(), 8192u);
  EXPECT_NE(w.error().message().find("data at offset 8192: "), std::string::npos)
      << w.error().message();
  auto missing = file_handle::open(fs, dir.file("nope").c_str(), open_flags::read);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error(), std::errc::no_such_file_or_directory);
}

TEST(Filesystem, TempFilesFallBackToNamedOnesWithoutTmpfile) {
  for (const bool no_tmpfile : {false, true}) {
    SCOPED_TRACE(no_tmpfile ? "named" : "anonymous where the filesystem allows");
    temp_dir dir;
    counting_fs fs;
    fs.no_tmpfile = no_tmpfile;
    auto d = file_handle::open_directory(fs, dir.path().c_str());
    ASSERT_TRUE(d);
    auto t = make_temp_file(*d, ".tmp.");
    ASSERT_TRUE(t) << t.error();
    if (no_tmpfile) {
      EXPECT_EQ(t->name.rfind(".tmp.", 0), 0u);
      EXPECT_TRUE(std::filesystem::exists(dir.file(t->name)));
    }
    ASSERT_TRUE(t->file.write_at(0, pattern(10)));
    ASSERT_TRUE(t->link_as(*d, "one"));
    ASSERT_TRUE(t->link_as(*d, "two"));
    EXPECT_EQ(t->link_as(*d, "two").error(), std::errc::file_exists);
    ASSERT_TRUE(t->remove_name(*d));
    std::size_t files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      (void)e;
      ++files;
    }
    EXPECT_EQ(files, 2u);  // one and two; no temporary name left
    EXPECT_EQ(std::filesystem::file_size(dir.file("one")), 10u);
    EXPECT_EQ(std::filesystem::hard_link_count(dir.file("one")), 2u);
  }
}

TEST(Filesystem, AtomicReplaceWorksWithoutTmpfile) {
  temp_dir dir;
  counting_fs fs;
  fs.no_tmpfile = true;
  replace_options o;
  o.fs = &fs;
  const auto content = pattern(4096);
  ASSERT_TRUE(atomic_replace(dir.file("cfg").c_str(), content, o));
  EXPECT_EQ(std::filesystem::file_size(dir.file("cfg")), 4096u);
  EXPECT_GE(fs.count(fs_op::sync), 2);  // the file and the directory
  std::size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1u);
}

TEST(Filesystem, AllocateFallsBackWithoutFallocateAndKeepsData) {
  temp_dir dir;
  counting_fs fs;
  fs.no_fallocate = true;
  auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  const auto data = pattern(5000);
  ASSERT_TRUE(f->write_at(0, data));
  ASSERT_TRUE(f->allocate(0, 64 * 1024));
  EXPECT_EQ(f->size().value(), 64 * 1024);
  std::vector<std::byte> back(5000);
  ASSERT_EQ(f->read_at(0, back).value(), 5000u);
  EXPECT_EQ(back, data);
  EXPECT_GE(f->status()->allocated, 64u * 1024);
}

TEST(Filesystem, MapsAndLocksGoThroughIt) {
  temp_dir dir;
  counting_fs fs;
  auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  {
    auto m = allocate_and_map(*f, 8192);
    ASSERT_TRUE(m) << m.error();
    EXPECT_EQ(&m->fs(), &fs);
    m->data()[5] = std::byte{42};
    ASSERT_TRUE(m->sync());
  }
  EXPECT_EQ(fs.count(fs_op::map), 1);
  EXPECT_EQ(fs.count(fs_op::sync_map), 1);
  EXPECT_EQ(fs.count(fs_op::unmap), 1);
  {
    auto g = lock_extent(*f, 10, 1, lock_kind::exclusive);
    ASSERT_TRUE(g);
  }
  EXPECT_EQ(fs.count(fs_op::lock), 2);  // lock and unlock
  // A lock that fails for a real reason says so, never "held".
  fs.lock_error = ENOLCK;
  auto g = lock_extent(*f, 10, 1, lock_kind::exclusive, std::chrono::milliseconds(50));
  ASSERT_FALSE(g);
  EXPECT_EQ(g.error(), std::errc::no_lock_available);
}

TEST(Filesystem, NamesListRenameAndStat) {
  temp_dir dir;
  filesystem& fs = os();
  auto d = file_handle::open_directory(fs, dir.path().c_str());
  ASSERT_TRUE(d);
  ASSERT_TRUE(fs.make_directory(&*d, "sub", 0755));
  ASSERT_TRUE(file_handle::open_at(*d, "f", create_rw));
  auto entries = fs.list_directory(*d);
  ASSERT_TRUE(entries);
  ASSERT_EQ(entries->size(), 2u);
  for (const auto& e : *entries) {
    EXPECT_EQ(e.type, e.name == "sub" ? entry_type::directory : entry_type::regular) << e.name;
  }
  ASSERT_TRUE(file_handle::open_at(*d, "g", create_rw));
  EXPECT_EQ(fs.rename(&*d, "f", &*d, "g", rename_mode::no_replace).error(), std::errc::file_exists);
  ASSERT_TRUE(fs.rename(&*d, "f", &*d, "g", rename_mode::replace));
  auto st = fs.stat_at(&*d, "g", false);
  ASSERT_TRUE(st);
  EXPECT_TRUE(st->is_regular());
  EXPECT_FALSE(fs.stat_at(&*d, "f", false));
  ASSERT_TRUE(fs.unlink(&*d, "sub", true));
  EXPECT_EQ(fs.stat_at(&*d, "sub", false).error(), std::errc::no_such_file_or_directory);
  // no_follow refuses a symlink at the last component.
  std::filesystem::create_symlink(dir.file("g"), dir.file("link"));
  auto via_link = file_handle::open_at(*d, "link", open_flags::read | open_flags::no_follow);
  ASSERT_FALSE(via_link);
  EXPECT_EQ(via_link.error(), std::errc::too_many_symbolic_link_levels);
}

// A write that must not block: the OS's writes what it can or says why not, with nothing
// written when its filesystem cannot take one; a wrapper says not_supported and writes
// nothing, so that its callers fall back to the writes it sees.
TEST(Filesystem, AWriteThatMustNotBlockWritesOrSaysWhyNot) {
  temp_dir dir;
  const std::string path = dir.file("nowait");
  auto h = file_handle::open(path.c_str(), open_flags::read_write | open_flags::create);
  ASSERT_TRUE(h) << h.error().message();
  char bytes[4096];
  std::memset(bytes, 7, sizeof bytes);
  const iovec v{bytes, sizeof bytes};
  counting_fs wrapper;
  auto via_wrapper = wrapper.write_nowait(*h, 0, std::span(&v, 1));
  ASSERT_FALSE(via_wrapper);
  EXPECT_EQ(via_wrapper.error(), std::errc::operation_not_supported);
  EXPECT_EQ(std::filesystem::file_size(path), 0u);
  auto n = os().write_nowait(*h, 0, std::span(&v, 1));
  if (n) {
    EXPECT_LE(*n, sizeof bytes);
    EXPECT_EQ(std::filesystem::file_size(path), *n);
  } else {
    EXPECT_TRUE(n.error() == std::errc::operation_not_supported ||
                n.error() == std::errc::operation_would_block)
        << n.error().message();
    EXPECT_EQ(std::filesystem::file_size(path), 0u);
  }
}

TEST(Filesystem, OperationNamesRoundTrip) {
  for (std::size_t i = 0; i < fs_op_count; ++i) {
    const auto op = static_cast<fs_op>(i);
    EXPECT_EQ(fs_op_from_string(to_string(op)).value(), op);
  }
  EXPECT_FALSE(fs_op_from_string("frobnicate"));
  EXPECT_TRUE(fs_ops::mutating().has(fs_op::sync));
  EXPECT_FALSE(fs_ops::mutating().has(fs_op::read));
  EXPECT_TRUE(fs_ops::all().has(fs_op::lock));
}

}  // namespace
}  // namespace keel::io
