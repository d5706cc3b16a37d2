#pragma once
// The write-back cache's index: a radix tree over the 64-bit offset space whose level widths
// are fixed at compile time (the TAI thesis's 16 EB / 1 GB / 2 MB / 4 KB nodes, <34, 9, 9, 12>:
// its text says BTree<43, 9, 9, 12>, which sums to 73, not 64; a sparse top level, then
// 512-way nodes, then leaves covering 2^12 = 4 KiB). Nodes exist only where something is
// cached and are freed when they empty. Not thread-safe: the cache serialises its callers.

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <type_traits>

namespace keel::aio::detail {

template <class Leaf, unsigned... Widths>
class radix_tree {
  static constexpr std::array<unsigned, sizeof...(Widths)> widths{Widths...};
  static constexpr std::size_t levels = sizeof...(Widths);
  static_assert(levels >= 3, "a top level, at least one node level, and the leaf span");
  static_assert((Widths + ...) == 64, "the levels cover the 64-bit offset space");
  // Nodes are levels 1 .. levels - 2; those of level levels - 2 hold the leaves.
  static constexpr std::size_t last_node_level = levels - 2;

 public:
  //! Bytes one leaf covers.
  static constexpr std::uint64_t leaf_span = std::uint64_t{1} << widths[levels - 1];

  radix_tree() = default;
  radix_tree(const radix_tree&) = delete;
  radix_tree& operator=(const radix_tree&) = delete;

  //! The leaf covering `offset`, or null.
  [[nodiscard]] Leaf* find(std::uint64_t offset) const noexcept {
    auto it = top_.find(offset >> shift(0));
    if (it == top_.end()) return nullptr;
    const node* n = it->second.get();
    for (std::size_t l = 1; l < last_node_level; ++l) {
      n = n->children[index(offset, l)].get();
      if (n == nullptr) return nullptr;
    }
    return n->leaves[index(offset, last_node_level)].get();
  }

  //! The leaf covering `offset`, made (with `make()`, returning std::unique_ptr<Leaf>) if
  //! there is none.
  template <class Make>
  Leaf& get_or_make(std::uint64_t offset, Make&& make) {
    auto& root = top_[offset >> shift(0)];
    if (!root) root = std::make_unique<node>(1);
    node* n = root.get();
    for (std::size_t l = 1; l < last_node_level; ++l) {
      auto& child = n->children[index(offset, l)];
      if (!child) {
        child = std::make_unique<node>(l + 1);
        ++n->used;
      }
      n = child.get();
    }
    auto& leaf = n->leaves[index(offset, last_node_level)];
    if (!leaf) {
      leaf = make();
      ++n->used;
      ++size_;
    }
    return *leaf;
  }

  //! Puts `with` in place of the leaf covering `offset`, which must exist, and hands that
  //! over.
  std::unique_ptr<Leaf> exchange(std::uint64_t offset, std::unique_ptr<Leaf> with) noexcept {
    node* n = top_.find(offset >> shift(0))->second.get();
    for (std::size_t l = 1; l < last_node_level; ++l)
      n = n->children[index(offset, l)].get();
    std::unique_ptr<Leaf>& slot = n->leaves[index(offset, last_node_level)];
    std::swap(slot, with);
    return with;
  }

  //! Removes the leaf covering `offset` (if any), freeing the nodes it leaves empty.
  void erase(std::uint64_t offset) noexcept { (void)take(offset); }

  //! Removes the leaf covering `offset` and hands it over (null if there was none), freeing
  //! the nodes it leaves empty.
  std::unique_ptr<Leaf> take(std::uint64_t offset) noexcept {
    std::unique_ptr<Leaf> taken;
    auto it = top_.find(offset >> shift(0));
    if (it == top_.end()) return taken;
    if (erase_in(*it->second, offset, taken)) top_.erase(it);
    return taken;
  }

  //! Calls `visit(leaf_offset, leaf)` for every leaf overlapping [from, to), in offset order;
  //! a `visit` that returns bool stops the walk by returning false. `visit` must not add or
  //! remove leaves.
  template <class Visit>
  void for_each(std::uint64_t from, std::uint64_t to, Visit&& visit) const {
    if (from >= to) return;
    for (auto it = top_.lower_bound(from >> shift(0)); it != top_.end(); ++it) {
      const std::uint64_t base = it->first << shift(0);
      if (base >= to) break;
      if (!walk(*it->second, base, from, to, visit)) return;
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

 private:
  struct node {
    explicit node(std::size_t l) : level(l) {
      if (level < last_node_level) {
        children = std::make_unique<std::unique_ptr<node>[]>(fanout(level));
      } else {
        leaves = std::make_unique<std::unique_ptr<Leaf>[]>(fanout(level));
      }
    }
    std::size_t level;
    std::size_t used = 0;  // non-null entries
    std::unique_ptr<std::unique_ptr<node>[]> children;
    std::unique_ptr<std::unique_ptr<Leaf>[]> leaves;
  };

  // The offset bits below level `l`'s index.
  static constexpr unsigned shift(std::size_t l) noexcept {
    unsigned s = 0;
    for (std::size_t k = l + 1; k < levels; ++k)
      s += widths[k];
    return s;
  }
  static constexpr std::size_t fanout(std::size_t l) noexcept {
    return std::size_t{1} << widths[l];
  }
  static std::size_t index(std::uint64_t offset, std::size_t l) noexcept {
    return static_cast<std::size_t>((offset >> shift(l)) & (fanout(l) - 1));
  }

  // Moves the leaf into `taken`; returns whether `n` is empty afterwards.
  bool erase_in(node& n, std::uint64_t offset, std::unique_ptr<Leaf>& taken) noexcept {
    const std::size_t i = index(offset, n.level);
    if (n.level < last_node_level) {
      auto& child = n.children[i];
      if (child && erase_in(*child, offset, taken)) {
        child.reset();
        --n.used;
      }
    } else if (n.leaves[i]) {
      taken = std::move(n.leaves[i]);
      --n.used;
      --size_;
    }
    return n.used == 0;
  }

  // Returns false when `visit` asked to stop.
  template <class Visit>
  bool walk(const node& n, std::uint64_t base, std::uint64_t from, std::uint64_t to,
            Visit& visit) const {
    const unsigned child_shift = shift(n.level);
    const std::uint64_t span = std::uint64_t{1} << child_shift;
    // Only the entries that can overlap [from, to).
    const std::size_t first =
        from > base ? static_cast<std::size_t>((from - base) >> child_shift) : 0;
    for (std::size_t i = first; i < fanout(n.level); ++i) {
      const std::uint64_t start = base + std::uint64_t{i} * span;
      if (start >= to) break;
      if (n.level == last_node_level) {
        if (!n.leaves[i]) continue;
        if constexpr (std::is_same_v<decltype(visit(start, *n.leaves[i])), bool>) {
          if (!visit(start, *n.leaves[i])) return false;
        } else {
          visit(start, *n.leaves[i]);
        }
      } else if (n.children[i] && !walk(*n.children[i], start, from, to, visit)) {
        return false;
      }
    }
    return true;
  }

  std::map<std::uint64_t, std::unique_ptr<node>> top_;
  std::size_t size_ = 0;
};

}  // namespace keel::aio::detail
