#pragma once
// The GlusterFS volume of scripts/glusterfs-fixture.sh: one volume mounted twice on this host,
// two clients of a real distributed filesystem. ctest brings it up before these tests (the
// fixture `glusterfs`) and passes its state directory in KEEL_TEST_GLUSTERFS.

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

namespace keel::test {

struct glusterfs_clients {
  std::string a, b;     //!< the two mount points: a path under one names the same file as under b
  std::string why_not;  //!< non-empty: there is no volume, and this says why
};

inline glusterfs_clients glusterfs() {
  glusterfs_clients c;
  const char* state = std::getenv("KEEL_TEST_GLUSTERFS");
  if (state == nullptr || *state == '\0') {
    c.why_not =
        "no GlusterFS volume: run through ctest (fixture glusterfs), or run "
        "scripts/glusterfs-fixture.sh up DIR and set KEEL_TEST_GLUSTERFS=DIR";
    return c;
  }
  const std::string dir = state;
  if (std::ifstream skip(dir + "/skip"); skip) {
    std::getline(skip, c.why_not);
    c.why_not = "no GlusterFS volume: " + c.why_not;
    return c;
  }
  std::ifstream mounts(dir + "/mounts");
  if (!std::getline(mounts, c.a) || !std::getline(mounts, c.b)) {
    c.why_not = "no GlusterFS volume: " + dir + "/mounts is missing (did the fixture run?)";
  }
  return c;
}

//! A directory of the test's own on the volume, removed afterwards: `on(a)` and `on(b)` are
//! the same directory as each client sees it.
class shared_dir {
 public:
  explicit shared_dir(const glusterfs_clients& c) : c_(c) {
    std::string tmpl = c.a + "/keel-test.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    name_ = tmpl.substr(c.a.size() + 1);
  }
  shared_dir(const shared_dir&) = delete;
  shared_dir& operator=(const shared_dir&) = delete;
  ~shared_dir() {
    const std::string rm = "rm -rf '" + c_.a + "/" + name_ + "'";
    (void)std::system(rm.c_str());
  }
  //! The path of `file` in this directory through client 0 (a) or 1 (b).
  [[nodiscard]] std::string on(int client, const std::string& file = "") const {
    std::string p = (client == 0 ? c_.a : c_.b) + "/" + name_;
    return file.empty() ? p : p + "/" + file;
  }

 private:
  glusterfs_clients c_;
  std::string name_;
};

}  // namespace keel::test
