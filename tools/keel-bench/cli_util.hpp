#pragma once
// Argument and output helpers the measuring commands share.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstddef>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace keel::tools {

//! Parses "N:N:..." into counts from 1 to `max`; throws CLI::ValidationError naming `option`.
inline std::vector<std::size_t> parse_count_list(const std::string& option, const std::string& list,
                                                 std::size_t max) {
  std::vector<std::size_t> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ':')) {
    std::size_t used = 0;
    unsigned long v = 0;
    try {
      v = std::stoul(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v == 0 || v > max) {
      throw CLI::ValidationError(option,
                                 fmt::format("'{}' is not a count from 1 to {}", item, max));
    }
    out.push_back(v);
  }
  if (out.empty()) throw CLI::ValidationError(option, "empty list");
  return out;
}

//! Writes `doc` to `path` ("-": stdout). Prints why and returns false when it cannot.
inline bool write_json(const std::string& command, const std::string& path,
                       const nlohmann::json& doc) {
  if (path == "-") {
    fmt::print("{}\n", doc.dump(2));
    return true;
  }
  std::ofstream f(path);
  f << doc.dump(2) << '\n';
  if (!f) {
    fmt::print(stderr, "keel-bench {}: cannot write {}\n", command, path);
    return false;
  }
  return true;
}

}  // namespace keel::tools
