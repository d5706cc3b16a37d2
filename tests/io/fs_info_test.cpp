#include "keel/io/fs_info.hpp"

#include <gtest/gtest.h>
#include <sys/vfs.h>

#include "io/fs_info_detail.hpp"
#include "support/process.hpp"

namespace keel::io {

TEST(FsInfo, RecognisesTmpfsAndProc) {
  auto shm = stat_fs("/dev/shm");
  if (!shm || shm->type != fs_type::tmpfs) GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  EXPECT_EQ(shm->type_name(), "tmpfs");
  EXPECT_TRUE(shm->is_local);
  EXPECT_GT(shm->block_size, 0u);
  EXPECT_GE(shm->total_bytes, shm->free_bytes);
  EXPECT_GE(shm->free_bytes, shm->available_bytes);

  auto proc = stat_fs("/proc");
  ASSERT_TRUE(proc);
  EXPECT_EQ(proc->type, fs_type::proc);
  EXPECT_EQ(to_string(fs_type::nfs), "nfs");
}

// Adversarial review of issue 15 (third): a filesystem keel does not know was called local,
// so lock_files judged "another boot with our machine id" dead on Lustre or GPFS, where that
// boot may be a cloned machine running now. Unknown is not local.
TEST(FsInfo, AFilesystemNotInTheTableIsNotCalledLocal) {
  struct statfs s {};
  s.f_type = 0x0bd00bd0;  // Lustre
  const fs_info lustre = detail::fs_info_of(s);
  EXPECT_EQ(lustre.type, fs_type::unknown);
  EXPECT_FALSE(lustre.is_local);
  s.f_type = 0xef53;  // ext4
  EXPECT_TRUE(detail::fs_info_of(s).is_local);
  s.f_type = 0x6969;  // nfs
  EXPECT_FALSE(detail::fs_info_of(s).is_local);
}

TEST(FsInfo, HandleAndPathAgree) {
  keel::test::temp_dir dir;
  auto f = file_handle::open(dir.file("a").c_str(), open_flags::read_write | open_flags::create);
  ASSERT_TRUE(f);
  auto by_path = stat_fs(dir.path().c_str());
  auto by_handle = stat_fs(*f);
  ASSERT_TRUE(by_path);
  ASSERT_TRUE(by_handle);
  EXPECT_EQ(by_path->magic, by_handle->magic);
  EXPECT_EQ(by_path->type, by_handle->type);
  EXPECT_EQ(by_path->total_bytes, by_handle->total_bytes);
}

TEST(FsInfo, PrivateTmpfsReportsItsSize) {
  keel::test::temp_dir dir;
  const std::string mnt = dir.path().string();
  const pid_t child = keel::test::fork_child([&] {
    if (!keel::test::mount_private_tmpfs(mnt, 1 << 20)) return keel::test::cannot_set_up;
    auto info = stat_fs(mnt.c_str());
    if (!info) return 1;
    if (info->type != fs_type::tmpfs || !info->is_local) return 2;
    if (info->total_bytes != (1u << 20)) return 3;
    return 0;
  });
  const int code = keel::test::wait_exit(child);
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(code, 0);
}

TEST(FsInfo, Errors) {
  EXPECT_EQ(stat_fs("/no/such/path").error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(stat_fs(static_cast<const char*>(nullptr)).error(), std::errc::invalid_argument);
  EXPECT_EQ(stat_fs(file_handle{}).error(), std::errc::bad_file_descriptor);
}

}  // namespace keel::io
