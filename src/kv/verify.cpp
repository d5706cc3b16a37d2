// verify: every block of every segment, every value a record names and every index entry,
// checked; every damage found is listed (file, offset, what), old versions included, and a
// commit a power cut tore is told apart from damage (doc/kv-format.md, "Recovery").

#include <algorithm>
#include <cctype>
#include <set>
#include <string>
#include <utility>

#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

// A key for a message: as it is when it is printable, else in hex.
std::string describe(std::span<const std::byte> key) {
  std::string out;
  bool printable = true;
  for (const std::byte b : key)
    printable &= std::isprint(static_cast<unsigned char>(b)) != 0;
  if (printable) {
    out.assign(reinterpret_cast<const char*>(key.data()), key.size());
    return '"' + out + '"';
  }
  static constexpr char digits[] = "0123456789abcdef";
  out = "0x";
  for (const std::byte b : key) {
    out += digits[static_cast<unsigned>(b) >> 4];
    out += digits[static_cast<unsigned>(b) & 15];
  }
  return out;
}

// The damage list, each place once.
class findings {
 public:
  explicit findings(verify_report& out) noexcept : out_(out) {}
  void note(const keel::detail::shared_path& file, std::uint64_t offset, std::string what) {
    std::string name(file.view());
    if (!seen_.emplace(name, offset).second) return;
    out_.damaged.push_back({std::move(name), offset, std::move(what)});
  }

 private:
  verify_report& out_;
  std::set<std::pair<std::string, std::uint64_t>> seen_;
};

}  // namespace

result<std::uint64_t> store::verify(verify_report* report) noexcept {
  impl& s = *impl_;
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  // No compaction meanwhile (it would remove segments under the walk): the maintenance byte,
  // which also keeps checkpoints waiting.
  const io::countdown cd = io::deadline(s.opts.lock_timeout).start();
  if (auto b = s.take_checkpoint_byte(cd, byte_claim::wait); !b) return std::unexpected(b.error());
  const maintenance_hold held{&s};
  // The walk judges dead commits too, and reads their blobs: this process's maps of segments
  // other users' compactions removed (emptied, so a read through one is past the file's end:
  // SIGBUS) go first, and such a blob is then found gone. None is removed while we hold the
  // byte.
  s.unmap_removed_segments();
  verify_report local;
  verify_report& out = report != nullptr ? *report : local;
  try {
    out = {};
    findings found(out);
    // Every commit visible now has its block in a segment listed below (later ones may land
    // where the walk has passed).
    const std::uint64_t walked_after = s.h64(header::visible).load(std::memory_order_seq_cst);
    // Every segment the manifest lists is there. (The manifest first: a segment is made before
    // it is listed, so one a writer lists meanwhile is among those found after.)
    auto listed = s.read_manifest();
    // A reader with an index of its own walks the segments its index has (writers that came
    // after it may have unlinked some, which it still maps, and listed others): the store as
    // it reads it. Others walk the directory, with the maintenance byte keeping removals out.
    auto numbers = s.private_index ? result<std::vector<std::uint64_t>>(s.table_segment_numbers())
                                   : s.segment_numbers(false);
    if (!numbers) return std::unexpected(numbers.error());
    const std::uint64_t durable_below = listed ? listed->durable_below : 0;
    // (Not for a reader with an index of its own: the manifest and the directory are those of
    // now, which writers change while it reads them.)
    if (!listed && !s.private_index) {
      if (listed.error() != errc::corrupt) return std::unexpected(listed.error());
      found.note(keel::detail::shared_path(listed.error().path()),
                 listed.error().has_offset() ? listed.error().offset() : 0,
                 "the manifest (the list of the store's segments) does not check out");
    } else if (listed && !s.private_index) {
      for (const disk::manifest_entry& e : listed->entries) {
        if (std::ranges::binary_search(*numbers, e.number)) continue;
        found.note(keel::detail::shared_path(s.path + "/seg/" + segment_name(e.number)), 0,
                   "a segment the manifest lists is missing");
      }
    }

    // A record's blob, if it has one, must check out too.
    const auto check_value = [&](std::uint64_t at, const disk::record_view& rec) -> result<void> {
      if (!disk::is_blob(rec)) return {};
      auto v = s.value_of(found_record{at, rec, nullptr}, true);
      if (v || v.error() == std::errc::no_such_file_or_directory) return {};  // removed whole
      if (v.error() != errc::corrupt) return std::unexpected(v.error());
      auto blob_seg = s.segment_at(disk::segment_of(rec.blob.location));
      if (!blob_seg) return std::unexpected(blob_seg.error());
      found.note((*blob_seg)->path, disk::offset_of(rec.blob.location),
                 "the value of " + describe(rec.key) + " (seq " + std::to_string(rec.head.seq) +
                     ") does not check out");
      return {};
    };
    // Each record of a block whose header checks out, by its own checksum.
    const auto check_records = [&](const segment& seg, std::uint64_t off,
                                   const disk::block_header& head) -> result<void> {
      const auto bytes = seg.bytes();
      std::uint64_t r = off + sizeof(disk::block_header);
      bool any = false;
      for (std::uint32_t i = 0; i < head.records; ++i) {
        const auto rest = bytes.subspan(r, off + head.length - r);
        auto rec = disk::parse_record(rest, s.salt, true);
        if (rec) {
          if (auto v = check_value(disk::make_location(seg.number, r), *rec); !v) return v;
          r += rec->size;
          continue;
        }
        any = true;
        auto shape = disk::parse_record_head(rest);
        if (!shape) {
          found.note(seg.path, r, "a record that cannot be read (nor can the rest of its block)");
          return {};
        }
        found.note(seg.path, r,
                   "the record of " + describe(shape->key) + " (seq " +
                       std::to_string(shape->head.seq) + ") does not check out");
        r += shape->size;
      }
      if (!any && !disk::check_block(bytes.subspan(off), s.salt)) {
        found.note(seg.path, off, "a block whose checksums do not match its records");
      }
      return {};
    };

    // The commit and relocation blocks the walk found, in the order of their locations.
    std::vector<impl::location_range> blocks;
    for (const std::uint64_t n : *numbers) {
      auto seg = s.segment_at(n);
      if (!seg) return std::unexpected(seg.error());
      const segment& sg = **seg;
      std::uint64_t unexplained_to = 0;  // the end of the run last noted
      auto walked = s.for_each_block(
          sg, disk::segment_header_size,
          [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
            const auto kind = static_cast<disk::block_kind>(head.kind);
            if (kind == disk::block_kind::commit) {
              auto judged = s.judge_commit(disk::make_location(n, off), head);
              if (!judged) return std::unexpected(judged.error());
              if (judged->what == impl::commit_judgement::kind::torn &&
                  disk::make_location(n, off) >= durable_below) {
                ++out.torn;  // never happened: not damage
                return {};
              }
              ++out.commits;
              blocks.push_back(
                  {disk::make_location(n, off), disk::make_location(n, off + head.length)});
              return check_records(sg, off, head);
            }
            if (kind == disk::block_kind::relocation) {
              if (!disk::check_block(sg.bytes().subspan(off), s.salt) &&
                  disk::make_location(n, off) >= durable_below &&
                  disk::has_unwritten_sector(sg.bytes(), off, head.length)) {
                return {};  // a copy a power cut tore: its original stayed
              }
              blocks.push_back(
                  {disk::make_location(n, off), disk::make_location(n, off + head.length)});
              return check_records(sg, off, head);
            }
            return {};  // a blob is checked through the record that names it
          },
          durable_below,
          [&](std::uint64_t off, std::uint64_t length) -> result<void> {
            if (off != unexplained_to) {
              found.note(sg.path, off,
                         "bytes that are no block where every block was written whole (a "
                         "block header damaged?)");
            }
            unexplained_to = off + length;
            return {};
          },
          [](std::uint64_t, std::uint64_t) { return result<void>{}; });
      if (!walked) return std::unexpected(walked.error());
      if (!listed) continue;
      if (auto c = s.check_sealed(sg, *listed); !c) {
        found.note(sg.path, c.error().offset(),
                   "a block the last close counted is missing (every byte of it zeroed?)");
      }
    }

    // Every index entry names a record of its own hash.
    auto hold = snapshot_hold::take(s);
    if (!hold) return std::unexpected(hold.error());
    // Each entry as one state (entry_ref::read_whole: never a torn publish): it names a
    // record of its own hash, in a block that checks out.
    const auto check_entry = [&](std::uint64_t page,
                                 const index::entry_ref::state& whole) -> result<void> {
      const std::uint64_t seq = whole.seq;
      const std::uint64_t at = whole.location;
      if ((seq & index::pending) != 0 || at == 0) return {};  // settled when used
      auto rec = s.record_head_at(at);
      auto seg = s.segment_at(disk::segment_of(at));
      if (!seg) return std::unexpected(seg.error());
      if (!rec) {
        found.note((*seg)->path, disk::offset_of(at),
                   "no record where an index entry (page " + std::to_string(page) + ") says");
        return {};
      }
      // Inside a block the walk found: else the header of its block was damaged since its
      // commit was published, and a rebuild would take the block for space.
      const auto after = std::ranges::upper_bound(blocks, at, {}, &impl::location_range::from);
      if (seq <= walked_after && (after == blocks.begin() || std::prev(after)->to <= at)) {
        found.note((*seg)->path, disk::offset_of(at),
                   "a record an index entry names lies in no block that checks out (its block "
                   "header damaged?)");
      }
      const disk::key_hash h = s.hash_of(rec->rec.key);
      if (h.hi != whole.hi || h.lo != whole.lo) {
        found.note((*seg)->path, disk::offset_of(at),
                   "an index entry (page " + std::to_string(page) +
                       ") of another hash names the record of " + describe(rec->rec.key));
      }
      return {};
    };
    auto walked = s.table->for_each_page(0, [&](std::uint64_t page) -> result<bool> {
      result<void> checked;
      s.table->page(page).for_each_key(
          [&](std::size_t, const index::entry_ref&, const index::entry_ref::state& whole) {
            checked = check_entry(page, whole);
            return static_cast<bool>(checked);
          });
      if (!checked) return std::unexpected(checked.error());
      return true;
    });
    if (!walked) return std::unexpected(walked.error());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  if (!out.damaged.empty()) {
    const damage& first = out.damaged.front();
    return std::unexpected(error(errc::corrupt).about(first.file, first.offset));
  }
  return out.commits;
}

}  // namespace keel::kv
