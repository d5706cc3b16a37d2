#pragma once
// `keel kv dump` and `keel kv load`: a store as text, in the format of LMDB's mdb_dump and
// mdb_load (Berkeley DB's db_dump format), so a store moves across versions and machines, and
// to and from LMDB: a header (VERSION=3, format=bytevalue or print, type=btree, HEADER=END),
// then each key and its value on lines of their own that start with a space, then DATA=END.
// bytevalue writes every byte as two hex digits; print writes printable ASCII as it is, a
// backslash as two, and any other byte as a backslash and two hex digits.

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>

#include "keel/kv/store.hpp"

namespace keel::tools {

//! Writes the store, one snapshot of it, to `out`; the keys written. A failed write is an
//! error (std::errc::io_error, or the errno of the write).
result<std::uint64_t> dump_store(kv::store& s, std::FILE* out, bool printable) noexcept;

//! Reads a dump from `in` and calls `put` for each key and value, in order. A dump keel cannot
//! take (bad header, a named or duplicate-keyed LMDB database, a bad line, a key with no value,
//! a key or value out of keel's bounds) is std::errc::invalid_argument with `why` saying which
//! line and what (`why` is set for these alone). A failed `put` is its error, with
//! `failed_line` the line of its key.
result<std::uint64_t> read_dump(
    std::FILE* in, const std::function<result<void>(std::string_view, std::string_view)>& put,
    std::string& why, std::uint64_t& failed_line) noexcept;

}  // namespace keel::tools
