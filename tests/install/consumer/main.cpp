// A program built against an installed keel: writes, reads back and locks a file.
#include <keel/io/byte_lock.hpp>
#include <keel/io/file_handle.hpp>
#include <keel/version.hpp>

#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string path = std::string(argv[1]) + "/consumer.dat";
  auto f = keel::io::file_handle::open(
      path.c_str(), keel::io::open_flags::read_write | keel::io::open_flags::create);
  if (!f) return 3;
  const char text[] = "installed keel " KEEL_VERSION_STRING;
  if (!f->write_at(0, std::as_bytes(std::span(text)))) return 4;
  char back[sizeof text] = {};
  auto n = f->read_at(0, std::as_writable_bytes(std::span(back)));
  if (!n || *n != sizeof text || std::memcmp(back, text, sizeof text) != 0) return 5;
  auto g = keel::io::try_lock_extent(*f, 0, 1, keel::io::lock_kind::exclusive);
  if (!g) return 6;
  std::printf("%s: ok\n", back);
  return 0;
}
