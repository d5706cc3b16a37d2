// The durability model's restore (durability_model.hpp): after power loss, `root` rebuilt as
// the shadow says it survived, then modelled afresh.

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <random>

#include "io/durability_model.hpp"

namespace keel::io {

using namespace shadow_files;

namespace {

constexpr std::size_t sector = 512;

// `current` laid over `durable` as a power cut might leave it: each sector that differs
// comes from one or the other, and the size is either one's.
bytes tear(const bytes& durable, const bytes& current, double keep, std::mt19937_64& rng,
           std::uint64_t& kept) {
  std::bernoulli_distribution coin(keep);
  const std::size_t size = std::bernoulli_distribution(0.5)(rng) ? current.size() : durable.size();
  bytes out(size);
  for (std::size_t at = 0; at < size; at += sector) {
    const std::size_t end = std::min(size, at + sector);
    const auto byte_of = [](const bytes& b, std::size_t i) {
      return i < b.size() ? b[i] : std::byte{0};
    };
    bool differs = false;
    for (std::size_t i = at; i < end && !differs; ++i)
      differs = byte_of(durable, i) != byte_of(current, i);
    const bytes& from = differs && coin(rng) ? current : durable;
    if (differs && &from == &current) ++kept;
    for (std::size_t i = at; i < end; ++i)
      out[i] = byte_of(from, i);
  }
  return out;
}

}  // namespace

result<fault_filesystem::restore_report> durability_model::restore(
    const std::string& root_in, const std::string& shadow_in,
    const fault_filesystem::crash_options& options) {
  const std::string root = absolute(root_in);
  const std::string shadow = absolute(shadow_in);
  auto known = read_path(shadow + "/root");
  if (!known || text_of(*known) != root) return errc_error(std::errc::invalid_argument);
  durability_model m;
  {
    const base::lock_guard lock(m.mutex_);
    m.root_ = root;
    m.shadow_ = shadow;
  }
  fault_filesystem::restore_report report;
  std::mt19937_64 rng(options.seed);
  {
    const model_lock lock(m);
    m.load_ids();
    const std::uint64_t root_id =
        std::strtoull(text_of(read_path_or_empty(shadow + "/root_id")).c_str(), nullptr, 10);

    // Where each model file is now (its current content, for torn sectors).
    std::map<std::uint64_t, std::string> current;
    std::error_code ec;
    for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
      auto st = os().stat_at(nullptr, it->path().c_str(), false);
      if (!st || !st->is_regular()) continue;
      const std::uint64_t id = m.id_locked(key_of(*st));
      if (id != 0) current.emplace(id, it->path().string());
    }

    // The durable tree, content computed before anything is removed.
    struct node {
      std::string path;  // relative to root
      dir_entry_record entry;
    };
    std::vector<node> nodes;
    const std::function<void(std::uint64_t, const std::string&)> collect =
        [&](std::uint64_t dir_id, const std::string& rel) KEEL_REQUIRES(m.mutex_) {
          for (auto& e : parse_entries(text_of(read_path_or_empty(m.dir_path(dir_id))))) {
            const std::string p = rel + "/" + e.name;
            nodes.push_back({p, e});
            if (e.directory) collect(e.id, p);
          }
        };
    collect(root_id, "");
    std::map<std::uint64_t, bytes> content;
    for (const node& n : nodes) {
      if (n.entry.directory || content.contains(n.entry.id)) continue;
      bytes durable = read_path_or_empty(m.data_path(n.entry.id));
      auto now = current.find(n.entry.id);
      if (now != current.end()) {
        bytes cur = read_path_or_empty(now->second);
        if (cur != durable) {
          ++report.reverted;
          if (options.torn) {
            durable = tear(durable, cur, options.keep_probability, rng, report.torn_sectors);
          }
        }
      }
      content.emplace(n.entry.id, std::move(durable));
    }

    // Out with the present, in with what survived.
    for (const auto& e : std::filesystem::directory_iterator(root, ec))
      std::filesystem::remove_all(e.path(), ec);
    if (ec) return errno_error(ec.value());
    ++report.directories;
    std::map<std::uint64_t, std::string> made;
    for (const node& n : nodes) {
      const std::string p = root + n.path;
      if (n.entry.directory) {
        if (auto md = os().make_directory(nullptr, p.c_str(), n.entry.mode); !md) {
          return std::unexpected(md.error());
        }
        ++report.directories;
        continue;
      }
      if (auto first = made.find(n.entry.id); first != made.end()) {
        if (auto l = os().link_at(nullptr, first->second.c_str(), nullptr, p.c_str()); !l) {
          return std::unexpected(l.error());
        }
        continue;
      }
      auto f =
          file_handle::open(os(), p.c_str(), open_flags::write | open_flags::create, n.entry.mode);
      if (!f) return std::unexpected(f.error());
      const bytes& b = content[n.entry.id];
      if (!b.empty()) {
        if (auto w = f->write_at(0, b); !w) return std::unexpected(w.error());
      }
      made.emplace(n.entry.id, p);
      ++report.files;
    }
  }
  // A new model of what is there now.
  std::error_code ec;
  std::filesystem::remove_all(shadow, ec);
  if (ec) return errno_error(ec.value());
  durability_model fresh;
  if (auto t = fresh.track(root, shadow); !t) return std::unexpected(t.error());
  return report;
}

}  // namespace keel::io
