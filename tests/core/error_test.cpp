#include "keel/error.hpp"

#include <gtest/gtest.h>

#include <sstream>
#include <thread>
#include <vector>

#include "keel/result.hpp"

namespace {

using keel::error;

TEST(Error, ComparesLikeItsCode) {
  const error e = std::error_code(ETIMEDOUT, std::system_category());
  EXPECT_EQ(e, std::errc::timed_out);
  EXPECT_NE(e, std::errc::operation_would_block);
  EXPECT_EQ(e.value(), ETIMEDOUT);
  EXPECT_EQ(std::errc::timed_out, e);  // either side
  const std::error_code& ec = e;
  EXPECT_EQ(ec, std::errc::timed_out);
}

TEST(Error, KeelConditionsMatchTheKernelsWhereThereIsOne) {
  const error corrupt = keel::errc::corrupt;
  EXPECT_EQ(corrupt, keel::errc::corrupt);
  EXPECT_EQ(corrupt, std::errc::bad_message);
  EXPECT_NE(corrupt, keel::errc::not_keel_file);  // same condition, different code
  EXPECT_EQ(error(keel::errc::controller_stopped), std::errc::operation_canceled);
  EXPECT_EQ(error(keel::errc::misaligned_direct_io), std::errc::invalid_argument);
  EXPECT_EQ(error(keel::errc::unsupported_version), std::errc::protocol_not_supported);
}

TEST(Error, ABudgetIsNeverAFullDevice) {
  const error budget = keel::errc::budget_reached;
  EXPECT_NE(budget, std::errc::no_space_on_device);
  EXPECT_EQ(budget, keel::errc::budget_reached);
  const error full = std::error_code(ENOSPC, std::system_category());
  EXPECT_NE(full, keel::errc::budget_reached);
  EXPECT_NE(error(keel::errc::not_found), std::errc::no_such_file_or_directory);
  EXPECT_NE(error(keel::errc::conflict), std::errc::resource_unavailable_try_again);
}

TEST(Error, MessageNamesTheFileAndOffset) {
  const error plain = keel::errc::corrupt;
  EXPECT_EQ(plain.path(), "");
  EXPECT_FALSE(plain.has_offset());
  const error e = plain.about("/data/store/log.0001", 4096);
  EXPECT_EQ(e, keel::errc::corrupt);
  EXPECT_EQ(e.path(), "/data/store/log.0001");
  EXPECT_EQ(e.offset(), 4096u);
  EXPECT_EQ(e.message().find("/data/store/log.0001 at offset 4096: "), 0u) << e.message();
  EXPECT_NE(e.message().find("corrupt"), std::string::npos) << e.message();
  // A context already there is kept: the innermost layer knows best.
  EXPECT_EQ(e.about("/elsewhere", 1).path(), "/data/store/log.0001");
  // A parser knows the offset, its caller the file: about() keeps the offset.
  const error found = error(make_error_code(keel::errc::corrupt), std::string_view{}, 24);
  EXPECT_EQ(found.about("/lock").offset(), 24u);
  EXPECT_EQ(found.about("/lock").path(), "/lock");
  const error no_offset = error(std::error_code(EIO, std::system_category())).about("/f");
  EXPECT_EQ(no_offset.message().find("/f: "), 0u) << no_offset.message();
  std::ostringstream os;
  os << e;
  EXPECT_NE(os.str().find("keel:1"), std::string::npos) << os.str();
}

TEST(Error, CopiesShareThePathAcrossThreads) {
  const error e = error(keel::errc::corrupt).about("/some/file", 7);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([e] {
      for (int i = 0; i < 10000; ++i) {
        error copy = e;
        error moved = std::move(copy);
        ASSERT_EQ(moved.path(), "/some/file");
      }
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(e.path(), "/some/file");
}

TEST(Error, ResultCarriesIt) {
  const auto fails = []() -> keel::result<int> {
    return std::unexpected(error(keel::errc::not_found).about("k"));
  };
  auto r = fails();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), keel::errc::not_found);
  EXPECT_EQ(r.error().path(), "k");
  keel::result<void> v = keel::errc_error(std::errc::invalid_argument);
  EXPECT_EQ(v.error(), std::errc::invalid_argument);
  EXPECT_EQ(keel::keel_error(keel::errc::conflict).error(), keel::errc::conflict);
}

}  // namespace
