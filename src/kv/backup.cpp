// store::build, a new store that appears whole or not at all: written beside `to` under a name
// of its own and renamed to `to` only once whole and durable. store::backup builds one from a
// snapshot of this store read page by page (transaction::scan): the store as it was when the
// backup began, whatever commits meanwhile.

#include <unistd.h>

#include <functional>
#include <string>

#include "base/thread_rng.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/kv/batch_writer.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

// Removes what store::open made in `dir`'s entry `name` (a store directory: files, and the
// directories of segments, one level down). Only ever called on a directory this backup made.
void remove_made_store(io::filesystem& fs, const io::file_handle& dir,
                       const std::string& name) noexcept {
  auto top = io::file_handle::open_at(dir, name.c_str(),
                                      io::open_flags::directory | io::open_flags::no_follow);
  if (top) {
    auto entries = fs.list_directory(*top);
    for (const auto& e : entries ? *entries : std::vector<io::directory_entry>{}) {
      if (e.type == io::entry_type::directory) {
        if (auto sub = io::file_handle::open_at(
                *top, e.name.c_str(), io::open_flags::directory | io::open_flags::no_follow)) {
          if (auto inner = fs.list_directory(*sub)) {
            for (const auto& f : *inner)
              (void)fs.unlink(&*sub, f.name.c_str(), f.type == io::entry_type::directory);
          }
        }
      }
      (void)fs.unlink(&*top, e.name.c_str(), e.type == io::entry_type::directory);
    }
  }
  (void)fs.unlink(&dir, name.c_str(), true);
}

}  // namespace

result<void> store::build(const std::string& to_given, const options& o,
                          const std::function<result<void>(store&)>& fill) noexcept {
  try {
    io::filesystem& fs = o.fs != nullptr ? *o.fs : io::os();
    std::string to = to_given;  // "copy/" names "copy"
    while (to.size() > 1 && to.back() == '/')
      to.pop_back();
    const std::size_t slash = to.find_last_of('/');
    const std::string parent =
        slash == std::string::npos ? "." : (slash == 0 ? "/" : to.substr(0, slash));
    const std::string name = slash == std::string::npos ? to : to.substr(slash + 1);
    if (name.empty() || name == "." || name == "..") {
      return std::unexpected(error(std::make_error_code(std::errc::invalid_argument)).about(to));
    }
    auto dir = io::file_handle::open_directory(fs, parent.c_str());
    if (!dir) return std::unexpected(dir.error().about(parent));
    if (auto there = fs.stat_at(&*dir, name.c_str(), false); there) {
      return std::unexpected(error(std::make_error_code(std::errc::file_exists)).about(to));
    } else if (there.error() != std::errc::no_such_file_or_directory) {
      return std::unexpected(there.error().about(to));
    }
    // Made under a name of its own: the pid and a random word, so a leftover of one killed
    // half-way (in this pid namespace or another) never stops the next. Nothing is there
    // before, so whatever is there after a failure is this call's own to remove.
    const std::string temp = "." + name + ".keel-build-" + std::to_string(::getpid()) + "-" +
                             std::to_string(base::thread_rng()());
    if (auto there = fs.stat_at(&*dir, temp.c_str(), false); there) {
      return std::unexpected(error(std::make_error_code(std::errc::file_exists)).about(temp));
    } else if (there.error() != std::errc::no_such_file_or_directory) {
      return std::unexpected(there.error().about(parent + "/" + temp));
    }
    options made = o;
    made.create_if_missing = true;
    made.error_if_exists = true;
    made.read_only = false;
    {
      auto dest = store::open(parent + "/" + temp, made);
      if (!dest) {
        remove_made_store(fs, *dir, temp);
        return std::unexpected(dest.error());
      }
      auto filled = fill(**dest);
      // A checkpoint syncs every commit it covers (all of them: nobody else writes here) and
      // lets the store open without replaying its log.
      if (filled) filled = (*dest)->checkpoint();
      if (!filled) {
        dest->reset();
        remove_made_store(fs, *dir, temp);
        return std::unexpected(filled.error());
      }
    }
    if (auto r = fs.rename(&*dir, temp.c_str(), &*dir, name.c_str(), io::rename_mode::no_replace);
        !r) {
      remove_made_store(fs, *dir, temp);
      return std::unexpected(r.error().about(to));
    }
    if (auto r = fs.sync(*dir, io::sync_kind::all); !r) {
      // The store is whole under its name; that the name is durable is what failed.
      return std::unexpected(r.error().about(parent));
    }
    return {};
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
}

result<backup_report> store::backup(const std::string& to) noexcept {
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  options made;
  made.durable = durability::none;
  made.verify_checksums = impl_->opts.verify_checksums;
  made.lock_timeout = impl_->opts.lock_timeout;
  made.every_user_on_this_host = impl_->opts.every_user_on_this_host;
  made.fs = impl_->opts.fs;
  backup_report out;
  auto built = build(to, made, [&](store& dest) -> result<void> {
    auto t = begin();
    if (!t) return std::unexpected(t.error());
    out.seq = t->snapshot();
    batch_writer batch(dest);
    std::string cursor;
    for (;;) {
      auto page = t->scan(cursor, 256);
      if (!page) return std::unexpected(page.error());
      for (const item& it : page->items) {
        if (auto r = batch.put(it.key, it.value); !r) return r;
        ++out.keys;
        out.bytes += it.key.size() + it.value.size();
      }
      if (page->done) break;
      cursor = page->cursor;
    }
    return batch.finish(durability::none);
  });
  if (!built) return std::unexpected(built.error());
  return out;
}

}  // namespace keel::kv
