#include "kv_dump.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <string>

namespace keel::tools {
namespace {

constexpr char hex_digits[] = "0123456789abcdef";

void encode(std::string_view bytes, bool printable, std::string& out) {
  out.assign(1, ' ');
  for (const char c : bytes) {
    const auto u = static_cast<unsigned char>(c);
    if (printable && u == '\\') {
      out += "\\\\";
    } else if (printable && u >= 0x20 && u < 0x7f) {
      out += c;
    } else {
      if (printable) out += '\\';
      out += hex_digits[u >> 4];
      out += hex_digits[u & 15];
    }
  }
  out += '\n';
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A data line (its leading space gone) back to bytes; false when it is not one.
bool decode(std::string_view line, bool printable, std::string& out) {
  out.clear();
  for (std::size_t i = 0; i < line.size();) {
    if (printable && line[i] != '\\') {
      out += line[i++];
      continue;
    }
    if (printable) {
      ++i;  // the backslash
      if (i < line.size() && line[i] == '\\') {
        out += '\\';
        ++i;
        continue;
      }
    }
    if (i + 2 > line.size()) return false;
    const int hi = hex_value(line[i]);
    const int lo = hex_value(line[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return true;
}

// One line without its newline; false at the end of the input (or on a read error: errno).
bool read_line(std::FILE* in, std::string& line, bool& ended_with_newline) {
  line.clear();
  ended_with_newline = false;
  for (int c = std::getc(in); c != EOF; c = std::getc(in)) {
    if (c == '\n') {
      ended_with_newline = true;
      return true;
    }
    line += static_cast<char>(c);
  }
  return !line.empty();
}

}  // namespace

result<std::uint64_t> dump_store(kv::store& s, std::FILE* out, bool printable) noexcept {
  try {
    auto t = s.begin();
    if (!t) return std::unexpected(t.error());
    auto st = s.stats();
    const std::uint64_t live = st ? st->live_bytes : 0;
    // mdb_load sizes its map from mapsize: room for the data twice over, in whole MiB.
    const std::uint64_t mapsize = ((live * 2 >> 20) + 16) << 20;
    std::string text = fmt::format("VERSION=3\nformat={}\ntype=btree\nmapsize={}\nHEADER=END\n",
                                   printable ? "print" : "bytevalue", mapsize);
    const auto emit = [&](const std::string& s_) {
      return std::fwrite(s_.data(), 1, s_.size(), out) == s_.size();
    };
    const auto write_failed = [&]() -> result<std::uint64_t> {
      return errc_error(errno != 0 ? static_cast<std::errc>(errno) : std::errc::io_error);
    };
    errno = 0;
    if (!emit(text)) return write_failed();
    std::uint64_t keys = 0;
    std::string cursor;
    for (;;) {
      auto page = t->scan(cursor, 256);
      if (!page) return std::unexpected(page.error());
      for (const kv::item& it : page->items) {
        encode(it.key, printable, text);
        if (!emit(text)) return write_failed();
        encode(it.value, printable, text);
        if (!emit(text)) return write_failed();
        ++keys;
      }
      if (page->done) break;
      cursor = page->cursor;
    }
    if (!emit("DATA=END\n") || std::fflush(out) != 0) return write_failed();
    return keys;
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
}

result<std::uint64_t> read_dump(
    std::FILE* in, const std::function<result<void>(std::string_view, std::string_view)>& put,
    std::string& why, std::uint64_t& failed_line) noexcept {
  try {
    std::uint64_t line_no = 0;
    std::uint64_t keys = 0;
    std::string line;
    std::string key;
    std::string value;
    bool newline = false;
    const auto bad = [&](const std::string& what) -> result<std::uint64_t> {
      why = fmt::format("line {}: {}", line_no, what);
      return errc_error(std::errc::invalid_argument);
    };
    bool any_section = false;
    for (;;) {
      // The header.
      errno = 0;
      if (!read_line(in, line, newline)) {
        if (std::ferror(in)) return errc_error(static_cast<std::errc>(errno ? errno : EIO));
        if (!any_section) {
          why = "the input is empty: no dump here";
          return errc_error(std::errc::invalid_argument);
        }
        return keys;
      }
      ++line_no;
      if (line != "VERSION=3")
        return bad("expected VERSION=3 (a dump of mdb_dump or keel kv dump)");
      any_section = true;
      bool printable = false;
      bool format_seen = false;
      for (;;) {
        if (!read_line(in, line, newline)) return bad("the header ends before HEADER=END");
        ++line_no;
        if (line == "HEADER=END") break;
        const auto eq = line.find('=');
        if (eq == std::string::npos) return bad("not a header line: " + line);
        const std::string name = line.substr(0, eq);
        const std::string v = line.substr(eq + 1);
        if (name == "format") {
          if (v != "bytevalue" && v != "print") return bad("unknown format=" + v);
          printable = v == "print";
          format_seen = true;
        } else if (name == "database" || name == "subdatabase") {
          return bad("a named database (" + v +
                     "): keel has one keyspace; dump the main database alone");
        } else if ((name == "duplicates" || name == "dupsort") && v != "0") {
          return bad("a database with duplicate keys: keel keeps one value per key");
        }
        // type, mapsize, maxreaders, db_pagesize and the like: LMDB's, nothing to keel.
      }
      if (!format_seen) return bad("the header names no format=");
      // The data.
      for (;;) {
        if (!read_line(in, line, newline)) return bad("the data ends before DATA=END");
        ++line_no;
        if (line == "DATA=END") break;
        if (line.empty() || line[0] != ' ' ||
            !decode(std::string_view(line).substr(1), printable, key)) {
          return bad("not a data line");
        }
        if (!read_line(in, line, newline)) return bad("a key with no value line");
        ++line_no;
        if (line.empty() || line[0] != ' ' ||
            !decode(std::string_view(line).substr(1), printable, value)) {
          return bad(line == "DATA=END" ? "a key with no value line" : "not a data line");
        }
        if (key.empty() || key.size() > kv::max_key_size) {
          --line_no;
          return bad(fmt::format("a key of {} bytes: keys are 1 to {} bytes", key.size(),
                                 kv::max_key_size));
        }
        if (value.size() > kv::max_value_size) {
          return bad(fmt::format("a value of {} bytes: values are at most {} bytes (1 GiB)",
                                 value.size(), kv::max_value_size));
        }
        if (auto r = put(key, value); !r) {
          failed_line = line_no - 1;
          return std::unexpected(r.error());
        }
        ++keys;
      }
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
}

}  // namespace keel::tools
