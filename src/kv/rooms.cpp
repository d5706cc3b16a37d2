// The rooms kept on the volume (doc/kv-format.md, "Segments", "Space"): the spare, which holds
// any one segment's copies for compaction, and the deletes' room, which holds erases on a
// full volume; made, grown, taken (as a segment) and given back (a victim kept as a room or
// as the next segment). Holds the files seg/spare and seg/deletes and writes *spare* and
// *deletes room* (so does compaction, when it keeps a victim as one: issue 41 moves that
// here).

#include <algorithm>
#include <cstring>

#include "kv/store_impl.hpp"

namespace keel::kv {

result<void> store::impl::ensure_room(const room_file& room, std::uint64_t at_least,
                                      room_need must) noexcept {
  // What it must be: the spare holds the copies of any one log segment (it must be as large as
  // the largest), and whatever the caller will make; the deletes' room becomes a log segment
  // when an erase takes it (it is never larger than the spare). What it grows to: the size
  // segments are made at now.
  const bool spare = &room == &spare_room;
  const std::uint64_t need =
      spare ? std::max(least_segment_size(at_least), largest_log_segment()) : 0;
  // The deletes' room stays at the first segment size in a store whose segments grow: it
  // only holds erase records on a full volume, and puts stop with it unused.
  std::uint64_t size = spare ? std::max(need, next_segment_size()) : least_segment_size(0);
  const std::string named = path + "/seg/" + room.name;
  // Whether the files stay within the budget (options::max_bytes) with the room at `bytes`:
  // as they take the volume, the room as its word counts it (0 when it is not there). A
  // pass that took the spare counts it at 0 till it is made again, and one that kept a
  // smaller victim as the spare grew it to a log segment's size with no look at the budget:
  // the files passed it by 240 KB (test
  // `KvBudget.ValuesOfEverySizeComingAndGoingNeverTakeTheFilesPastTheBudget`).
  const auto within_budget = [&](std::uint64_t bytes) {
    const std::uint64_t counted = h64(room.word).load();
    return check_budget(bytes - std::min(bytes, counted), room_for::compaction).has_value();
  };
  // The word alone could be stale (a taker killed after the rename): the file says.
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto st = fs->stat_at(&dir.segments, room.name, false);
    if (st && log_segment_size(st->size)) {
      // One made when the log was smaller grows with it: when it must, or while the room is
      // there to spare (else it stays as it is: a smaller deletes' room is still a room), and
      // the budget has the room.
      std::uint64_t have = st->size;
      if (auto w = store_or_refuse([&] { h64(room.word).store(have); }); !w) return w;
      bool budget_short = false;
      if (have < size && (have < need || could_put(size - have))) {
        budget_short = !within_budget(size);
        if (!budget_short) {
          auto g = grow_room(room, size);
          if (!g) return std::unexpected(g.error());
          if (*g) {
            have = size;
            if (auto w = store_or_refuse([&] { h64(room.word).store(have); }); !w) return w;
          }
        }
      }
      if (have < need && must == room_need::every_segment) {
        return std::unexpected(error(budget_short
                                         ? make_error_code(errc::budget_reached)
                                         : std::make_error_code(std::errc::no_space_on_device))
                                   .about(named));
      }
      return {};
    }
    if (auto w = store_or_refuse([&] { h64(room.word).store(0); }); !w) return w;
    if (st) {
      // Not one of ours at this size: a new one replaces it.
      if (auto r = io::unlink_at(dir.segments, room.name); !r) {
        return std::unexpected(r.error().about(named));
      }
    } else if (st.error() != std::errc::no_such_file_or_directory) {
      return std::unexpected(st.error().about(named));
    }
    const auto make = [&]() -> result<void> {
      if (!within_budget(size)) return keel_error(errc::budget_reached);
      return make_whole_file(room.name, size, {});
    };
    auto r = make();
    if (!r && out_of_room(r.error()) && size > std::max(need, dir.params.first_segment_size)) {
      // No room for it at the size segments are made at now: at what it must be, then.
      size = std::max(need, dir.params.first_segment_size);
      r = make();
    }
    if (!r && out_of_room(r.error()) && must == room_need::there && size > least_segment_size(0)) {
      // Nor at that: at the least a segment is, which is still a spare.
      size = least_segment_size(0);
      r = make();
    }
    if (!r && r.error() == std::errc::file_exists) continue;  // another's, made meanwhile
    if (!r) return std::unexpected(error(r.error().code()).about(named));
    if (auto d = dir.segments.sync_all(); !d) return std::unexpected(d.error().about(named));
    return store_or_refuse([&] { h64(room.word).store(size); });
  }
  return errc_error(std::errc::file_exists);
}

result<bool> store::impl::grow_room(const room_file& room, std::uint64_t size) noexcept {
  // In place, by the blocks it lacks, allocated past its end: it takes only the room it
  // gains (made anew beside the old one, it took its whole size more, and a spare a pass
  // kept smaller could not grow by the room the pass's other victims gave back). Refused, it
  // is cut back to its size (ext4 extends a file part way before it runs out), and stays as
  // it was. A user killed part way leaves a room of a size no segment has, which the next
  // ensure_room replaces, or one whole at a smaller size.
  const std::string named = path + "/seg/" + room.name;
  auto f = io::file_handle::open_at(dir.segments, room.name,
                                    io::open_flags::read_write | io::open_flags::no_follow);
  if (!f) return std::unexpected(f.error().about(named));
  auto length = f->size();
  if (!length) return std::unexpected(length.error().about(named));
  const auto have = static_cast<std::uint64_t>(*length);
  if (have >= size) return true;
  auto r = allocate_in(*f, static_cast<off_t>(have), static_cast<off_t>(size - have));
  if (!r) {
    if (auto t = f->truncate(static_cast<off_t>(have)); !t) {
      return std::unexpected(t.error().about(named));
    }
    // No room to grow into: the room stays as it is.
    if (out_of_room(r.error())) return false;
    return std::unexpected(error(r.error().code()).about(named));
  }
  if (auto d = f->sync_data(); !d) return std::unexpected(d.error().about(named));
  return true;
}

result<std::uint64_t> store::impl::adopt_room(const room_file& room) noexcept {
  const std::string named = path + "/seg/" + room.name;
  // The word may lag the file (a maker killed after naming it): the file decides.
  auto f = io::file_handle::open_at(dir.segments, room.name,
                                    io::open_flags::read_write | io::open_flags::no_follow);
  if (!f) {
    if (f.error() == std::errc::no_such_file_or_directory) {
      // Taken by a user killed before it cleared the word.
      if (auto w = store_or_refuse([&] { h64(room.word).store(0); }); !w) {
        return std::unexpected(w.error());
      }
      return errc_error(std::errc::no_space_on_device);
    }
    return std::unexpected(f.error().about(named));
  }
  auto length = f->size();
  if (!length) return std::unexpected(length.error().about(named));
  const auto size = static_cast<std::uint64_t>(*length);
  if (!log_segment_size(size)) {
    // Not a room of ours (ensure_room replaces it).
    if (auto w = store_or_refuse([&] { h64(room.word).store(0); }); !w) {
      return std::unexpected(w.error());
    }
    return errc_error(std::errc::no_space_on_device);
  }
  auto picked = new_segment_number();
  if (!picked) return picked;
  const std::uint64_t number = *picked;
  const std::string name = segment_name(number);
  // Its header (into room allocated with the file: no new block), synced, then its name:
  // a named segment is always whole.
  const auto head = disk::encode_segment_header({dir.params.id, number, size}, salt);
  auto r = f->write_at(0, head);
  if (r) r = f->sync_data();
  if (r) {
    r = fs->rename(&dir.segments, room.name, &dir.segments, name.c_str(),
                   io::rename_mode::no_replace);
  }
  if (!r) return std::unexpected(error(r.error().code()).about(path + "/seg/" + name));
  // A segment now: its name durable, then listed, then in the table (a named segment
  // missing from it would hold its room and never be compacted), the word cleared before
  // the caller moves the tail into it (see reserve).
  const auto back_to_room = [&](const error& e) -> result<std::uint64_t> {
    // The room again if it can be (else an unlisted file the next lone opener removes).
    if (!fs->rename(&dir.segments, name.c_str(), &dir.segments, room.name,
                    io::rename_mode::no_replace)) {
      (void)store_or_refuse([&] { h64(room.word).store(0); });  // (else reconciled later)
    }
    return std::unexpected(e);
  };
  if (auto d = dir.segments.sync_all(); !d) return back_to_room(d.error().about(named));
  if (auto l = list_segment(number, size); !l) return back_to_room(l.error());
  // (Refused now, a segment listed and named, its room's word perhaps still set: what a
  // taker killed here leaves, which reconcile_rooms and the next opener settle.)
  if (auto e = enter_segment(number, size); !e) return std::unexpected(e.error());
  if (auto w = store_or_refuse([&] { h64(room.word).store(0); }); !w) {
    return std::unexpected(w.error());
  }
  return number;
}

result<store::impl::room_kept> store::impl::give_back_segment(std::uint64_t number,
                                                              std::uint64_t size,
                                                              room_kept may_keep) noexcept {
  const std::string name = segment_name(number);
  const std::string named = path + "/seg/" + name;
  auto f = io::file_handle::open_at(dir.segments, name.c_str(),
                                    io::open_flags::read_write | io::open_flags::no_follow);
  if (!f) return std::unexpected(f.error().about(named));
  // Kept, this segment's room does not go back to the volume, where another program may take
  // it before a commit that only erases could make a spare or a segment again (every erase
  // would then fail). Its bytes are zeroed first, over the blocks it has (no new one, except
  // on a copy-on-write filesystem), and synced before it is named anew: a segment made of it
  // must hold no old block a rebuild could read.
  // First a leftover's name, durable (one killed, or a power cut, from here on leaves what
  // a lone opener removes, never a segment's name over zeros). A file there already is not
  // ours to replace: this segment then goes back to the volume.
  const std::string temp = std::string(segment_temp_prefix) + name;
  bool keeping = false;
  // A reader with an index of its own may map this segment: it is only unlinked (its map
  // keeps reading what it held), neither zeroed to be kept nor truncated.
  const bool mapped_unbeknown = private_readers_present();
  if (may_keep.as != room_kept::volume && log_segment_size(size) && !mapped_unbeknown) {
    auto r = fs->rename(&dir.segments, name.c_str(), &dir.segments, temp.c_str(),
                        io::rename_mode::no_replace);
    // (A directory with no room for the longer name, ext4 full, refuses with ENOSPC: then
    // too the segment goes back to the volume.)
    if (!r && r.error() != std::errc::file_exists && !out_of_room(r.error())) {
      return std::unexpected(r.error().about(named));
    }
    keeping = static_cast<bool>(r);
  }
  if (keeping) {
    if (auto d = dir.segments.sync_all(); !d) return std::unexpected(d.error().about(named));
    static const std::array<std::byte, 64 << 10> zeros{};
    std::array<iovec, 16> chunk{};
    for (auto& v : chunk)
      v = {const_cast<std::byte*>(zeros.data()), zeros.size()};
    const std::uint64_t step = zeros.size() * chunk.size();
    result<void> z;
    for (std::uint64_t at = 0; z && at < size; at += step) {
      const std::size_t n = static_cast<std::size_t>(std::min(step, size - at) / zeros.size());
      z = f->write_at(static_cast<off_t>(at), std::span<const iovec>(chunk.data(), n));
    }
    room_kept kept = may_keep;
    std::string new_name = kept.as == room_kept::deletes ? deletes_room.name : spare_room.name;
    if (z && kept.as == room_kept::next) {
      // The next segment, made and abandoned: the next writer that needs one takes it.
      auto picked = new_segment_number();
      if (!picked) return std::unexpected(picked.error());
      kept.number = *picked;
      new_name = segment_name(kept.number);
      z = f->write_at(0, disk::encode_segment_header({dir.params.id, kept.number, size}, salt));
    }
    if (z) z = f->sync_data();
    if (z) {
      z = fs->rename(&dir.segments, temp.c_str(), &dir.segments, new_name.c_str(),
                     io::rename_mode::no_replace);
      if (z) return kept;
    }
    // Room to write the zeros refused (copy-on-write, full), or a file there already: the
    // segment goes back to the volume after all.
    const std::error_code e = z.error().code();
    if (e != std::errc::no_space_on_device &&
        e != std::error_code(EDQUOT, std::system_category()) && e != std::errc::file_exists) {
      return std::unexpected(z.error().about(named));
    }
    if (auto r = io::unlink_at(dir.segments, temp.c_str()); !r) {
      return std::unexpected(r.error().about(path + "/seg/" + temp));
    }
  } else if (auto r = io::unlink_at(dir.segments, name.c_str()); !r) {
    return std::unexpected(r.error().about(named));
  }
  // Unnamed, its blocks would still be held by every process that maps it, and one that
  // sits idle unmaps it only at its next call into the store: emptied, they are free at
  // once. Nobody reads it any more (compaction waited for every snapshot that could).
  if (mapped_unbeknown) return room_kept{};
  if (auto t = f->truncate(0); !t) return std::unexpected(t.error().about(named));
  return room_kept{};
}

result<void> store::impl::reconcile_rooms() noexcept {
  for (const room_file* room : {&spare_room, &deletes_room}) {
    auto st = fs->stat_at(&dir.segments, room->name, false);
    const std::uint64_t size = st && log_segment_size(st->size) ? st->size : 0;
    // Stored only when it changes: a store is a write fault on the header's page, which a
    // volume at its limit (btrfs, a qgroup) refuses once the page was written back, and
    // reserving asks here at every new segment.
    if (h64(room->word).load() != size) {
      if (auto w = store_or_refuse([&] { h64(room->word).store(size); }); !w) return w;
    }
  }
  return {};
}

std::uint64_t store::impl::abandoned_segment() const noexcept {
  const std::uint64_t last = h64(header::next_segment).load() - 1;
  const bool abandoned = last != 0 && last > disk::segment_of(h64(header::tail).load()) &&
                         segtab(last, 0).load() == last && log_segment_size(segtab(last, 1).load());
  return abandoned ? last : 0;
}

result<void> store::impl::adopt_named_leftover() noexcept {
  // The last number handed out, named in seg/ but neither listed nor entered: its maker (or
  // the taker of the spare) died between naming it and listing it, holding the segment lock
  // we hold now. Nothing was written into it (nothing is before it is listed), and it holds
  // a segment's room, which a full volume needs: listed and entered, it is the abandoned
  // segment the next writer takes.
  const std::uint64_t last = h64(header::next_segment).load() - 1;
  if (last == 0 || segtab(last, 0).load() != 0) return {};
  const std::string name = segment_name(last);
  auto st = fs->stat_at(&dir.segments, name.c_str(), false);
  if (!st || !log_segment_size(st->size)) return {};
  auto seg = segment_at(last);
  if (!seg) return {};  // not a segment of ours at all: left alone
  // Nothing written: its first block's place still zero (else it is no maker's leftover).
  const auto first = (*seg)->bytes().subspan(disk::segment_header_size, sizeof(disk::block_header));
  if (!std::ranges::all_of(first, [](std::byte b) { return b == std::byte{0}; })) return {};
  if (auto l = list_segment(last, (*seg)->size); !l) return l;
  return enter_segment(last, (*seg)->size);
}

}  // namespace keel::kv
