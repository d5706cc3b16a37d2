// store::salvage (doc/kv-format.md, "Salvage"): what survives of a damaged store, read
// straight from its segments and copied into a new store, with a list of what could not be
// read. Nothing of the index, the manifest or the checkpoint is needed, and nothing of the
// store salvaged is written.

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "keel/io/mapped_file.hpp"
#include "keel/kv/batch_writer.hpp"
#include "kv/store_dir.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

// A segment of the store salvaged, mapped read-only.
struct mapped_segment {
  std::uint64_t number = 0;
  std::string path;
  io::mapped_file map;
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept {
    return {map.data(), map.size()};
  }
};

// A version of a key found in a block that checks out as far as the record goes.
struct version {
  std::uint64_t seq = 0;
  std::size_t segment = 0;  // index into the mapped segments
  std::uint64_t offset = 0;
};

std::string describe(std::string_view key) {
  bool printable = true;
  for (const char c : key)
    printable &= c >= 0x20 && c < 0x7f;
  if (printable) return '"' + std::string(key) + '"';
  static constexpr char digits[] = "0123456789abcdef";
  std::string out = "0x";
  for (const char c : key) {
    out += digits[static_cast<unsigned char>(c) >> 4];
    out += digits[static_cast<unsigned char>(c) & 15];
  }
  return out;
}

class salvager {
 public:
  salvager(io::filesystem& fs, const store_dir& from, std::string from_path, salvage_report& out)
      : fs_(fs),
        from_(from),
        salt_(from.params.salt),
        out_(out),
        from_path_(std::move(from_path)) {}

  // Maps every segment and collects every version of every key it can read.
  result<void> gather() {
    const std::string& path = from_path_;
    auto entries = fs_.list_directory(from_.segments);
    if (!entries) return std::unexpected(entries.error().about(path + "/seg"));
    std::vector<std::uint64_t> numbers;
    for (const auto& e : *entries) {
      if (auto n = segment_number_of(e.name)) numbers.push_back(*n);
    }
    std::sort(numbers.begin(), numbers.end());
    for (const std::uint64_t n : numbers) {
      const std::string named = path + "/seg/" + segment_name(n);
      auto f = io::file_handle::open_at(from_.segments, segment_name(n).c_str(),
                                        io::open_flags::read | io::open_flags::no_follow);
      if (!f) {
        note(named, 0, "cannot be opened: " + f.error().message());
        continue;
      }
      auto m = io::mapped_file::map(*f, io::map_access::read_only);
      if (!m || m->size() < disk::segment_header_size) {
        note(named, 0,
             m ? "shorter than a segment header" : "cannot be mapped: " + m.error().message());
        continue;
      }
      if (auto head = disk::parse_segment_header(m->bytes(), from_.params.id, n, salt_); !head) {
        note(named, head.error().has_offset() ? head.error().offset() : 0,
             "a segment header that does not check out: its blocks are read anyway");
      } else if (m->size() < head->size) {
        // Cut short (truncated by hand, or by a copy that stopped): whatever was written past
        // its end is lost, and only the header knows there was room for it.
        note(named, m->size(),
             "cut short: " + std::to_string(m->size()) + " of its " + std::to_string(head->size) +
                 " bytes; whatever its blocks held past its end is "
                 "gone (the blocks before are read)");
      }
      segments_.push_back({n, named, std::move(*m)});
      walk(segments_.size() - 1);
    }
    return {};
  }

  // Writes the newest readable version of every key into `to`.
  result<void> copy_into(store& to) {
    batch_writer batch(to);
    for (auto& [key, versions] : versions_) {
      std::sort(versions.begin(), versions.end(),
                [](const version& a, const version& b) { return a.seq > b.seq; });
      bool copied = false;
      for (std::size_t i = 0; i < versions.size() && !copied; ++i) {
        const version& v = versions[i];
        const mapped_segment& seg = segments_[v.segment];
        auto rec = disk::parse_record(seg.bytes().subspan(v.offset), salt_, true);
        if (!rec) continue;  // cannot be: it was read so
        if (rec->head.op == static_cast<std::uint8_t>(disk::op::erase)) {
          ++out_.erased;
          copied = true;
          break;
        }
        auto value = value_of(*rec);
        if (!value) {
          note(value.error().path(), value.error().has_offset() ? value.error().offset() : 0,
               "the value of " + describe(key) + " (seq " + std::to_string(v.seq) +
                   ") does not check out");
          continue;
        }
        if (auto r = batch.put(
                key, std::string_view(reinterpret_cast<const char*>(value->data()), value->size()));
            !r) {
          return std::unexpected(r.error());
        }
        ++out_.keys;
        copied = true;
        if (i != 0)
          older(key, "its newest version (seq " + std::to_string(versions[0].seq) +
                         ") could not be read; seq " + std::to_string(v.seq) + " was copied");
      }
      if (!copied) older(key, "no version of it could be read");
      auto newer = unread_seq_.find(key);
      if (newer != unread_seq_.end() && (versions.empty() || newer->second > versions[0].seq)) {
        older(key,
              "a newer version (seq " + std::to_string(newer->second) + ") does not check out");
      }
    }
    // Keys seen only in records that did not check out.
    for (const auto& [key, seq] : unread_seq_) {
      if (!versions_.contains(key)) older(key, "no version of it could be read");
    }
    return batch.finish(durability::sync);
  }

 private:
  void note(std::string_view file, std::uint64_t offset, std::string what) {
    out_.unreadable.push_back({std::string(file), offset, std::move(what)});
  }
  void older(const std::string& key, std::string what) {
    out_.older.push_back({key, std::move(what)});
  }

  // The blocks of segment `i`, as a rebuild reads them, but for every readable record.
  void walk(std::size_t i) {
    const mapped_segment& seg = segments_[i];
    const auto bytes = seg.bytes();
    std::uint64_t off = disk::segment_header_size;
    while (off + sizeof(disk::block_header) <= bytes.size()) {
      auto head = disk::parse_block_header(bytes.subspan(off), salt_);
      if (!head) {
        if (auto spanned = disk::spanned_block(bytes.subspan(off), salt_)) {
          off += *spanned;  // voided or abandoned: never happened
        } else {
          off += 8;
        }
        continue;
      }
      const auto kind = static_cast<disk::block_kind>(head->kind);
      if (kind == disk::block_kind::commit || kind == disk::block_kind::relocation) {
        const bool whole = static_cast<bool>(disk::check_block(bytes.subspan(off), salt_));
        if (!whole && disk::has_unwritten_sector(bytes, off, head->length)) {
          // A power cut tore it: it never happened (a torn copy's original is elsewhere).
          if (kind == disk::block_kind::commit) ++out_.torn;
        } else {
          if (kind == disk::block_kind::commit) ++out_.commits;
          records(i, off, *head);
        }
      }
      off += head->length;
    }
  }

  void records(std::size_t i, std::uint64_t off, const disk::block_header& head) {
    const mapped_segment& seg = segments_[i];
    const auto bytes = seg.bytes();
    std::uint64_t r = off + sizeof(disk::block_header);
    for (std::uint32_t k = 0; k < head.records; ++k) {
      const auto rest = bytes.subspan(r, off + head.length - r);
      auto rec = disk::parse_record(rest, salt_, true);
      if (rec) {
        const std::string key(reinterpret_cast<const char*>(rec->key.data()), rec->key.size());
        versions_[key].push_back({rec->head.seq, i, r});
        r += rec->size;
        continue;
      }
      auto shape = disk::parse_record_head(rest);
      if (!shape) {
        note(seg.path, r, "a record that cannot be read (nor can the rest of its block)");
        return;
      }
      const std::string key(reinterpret_cast<const char*>(shape->key.data()), shape->key.size());
      note(seg.path, r,
           "the record of " + describe(key) + " (seq " + std::to_string(shape->head.seq) +
               ", as far as its damaged bytes say) does not check out");
      auto& seen = unread_seq_[key];
      seen = std::max(seen, shape->head.seq);
      r += shape->size;
    }
  }

  result<std::span<const std::byte>> value_of(const disk::record_view& rec) {
    if (!disk::is_blob(rec)) return rec.value;
    const std::uint64_t n = disk::segment_of(rec.blob.location);
    const std::uint64_t off = disk::offset_of(rec.blob.location);
    for (const mapped_segment& seg : segments_) {
      if (seg.number != n) continue;
      const auto bad = [&] { return std::unexpected(error(errc::corrupt).about(seg.path, off)); };
      if (off < disk::segment_header_size || off >= seg.bytes().size()) return bad();
      const auto at = seg.bytes().subspan(off);
      auto head = disk::parse_block_header(at, salt_);
      if (!head || head->kind != static_cast<std::uint16_t>(disk::block_kind::blob) ||
          head->payload_checksum != rec.blob.checksum) {
        return bad();
      }
      const auto value = disk::blob_value(at, *head);
      if (value.size() != rec.head.value_length ||
          disk::checksum(value, salt_) != head->payload_checksum) {
        return bad();
      }
      return value;
    }
    return std::unexpected(error(errc::corrupt).about(from_path_ + "/seg/" + segment_name(n), off));
  }

  io::filesystem& fs_;
  const store_dir& from_;
  std::uint64_t salt_;
  salvage_report& out_;
  std::string from_path_;
  std::vector<mapped_segment> segments_;
  std::map<std::string, std::vector<version>> versions_;
  std::map<std::string, std::uint64_t> unread_seq_;  // keys of records that did not check out
};

}  // namespace

result<salvage_report> store::salvage(const std::string& from, const std::string& to,
                                      const options& o) noexcept {
  try {
    io::filesystem& fs = o.fs != nullptr ? *o.fs : io::os();
    store_dir_options d;
    d.create_if_missing = false;
    d.fs = o.fs;
    auto source = open_store_dir(from, d);
    if (!source) return std::unexpected(source.error());
    salvage_report out;
    salvager s(fs, *source, from, out);
    if (auto r = s.gather(); !r) return std::unexpected(r.error());
    options made = o;
    made.create_if_missing = true;
    made.error_if_exists = true;
    made.read_only = false;
    auto dest = store::open(to, made);
    if (!dest) return std::unexpected(dest.error());
    if (auto r = s.copy_into(**dest); !r) return std::unexpected(r.error());
    return out;
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
}

}  // namespace keel::kv
