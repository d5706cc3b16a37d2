#!/usr/bin/env python3
"""Each word of the index file's header is written only by the files that own it.

src/kv/index_file.hpp lists, above the header's words, which file writes which word. This
check finds every write of a word in src/kv: a store, fetch or exchange through
h64(header::X) or through a name bound to it, and the word's address taken
(base() + header::X) other than to read it. A write from a file the list does not name for
that word fails, as does a listed word the header does not have, or a file listed for a
word it does not write (the list stays true).

Usage: header_writers.py SOURCE_DIR
"""
import collections
import glob
import os
import re
import sys

WRITE = (r'\.(?:store|fetch_add|fetch_sub|fetch_or|fetch_and|fetch_max|'
         r'compare_exchange_strong|compare_exchange_weak|exchange)\(')


def owners(layout):
    """The list's {file: {word}}, and the header's words."""
    words = set(re.findall(r'constexpr std::size_t (\w+) = ', layout.split('namespace header {')[1]
                           .split('}  // namespace header')[0]))
    block = layout.split('// Who writes which word:')[1].split('namespace header {')[0]
    # The entries: "FILE: word word ..." from a line's start, notes in brackets left out.
    entries = block.split('\n//\n')[-1]
    text = ' '.join(line.lstrip('/ ') for line in entries.splitlines())
    text = re.sub(r'\([^)]*\)', ' ', text)
    table = collections.defaultdict(set)
    parts = re.split(r'([\w.]+\.(?:cpp|hpp)):', text)
    for f, ws in zip(parts[1::2], parts[2::2]):
        table[f].update(re.findall(r'[a-z_]+', ws))
    return table, words


def writes(text):
    """The header words `text` writes."""
    found = set()
    for m in re.finditer(r'h64\(header::(\w+)[^;]*?\)\s*' + WRITE, text):
        found.add(m.group(1))
    for m in re.finditer(r'(\w+)\s*(?:=|\(|\{)\s*(?:[\w>.-]*(?:->|\.))?h64\(header::(\w+)[^;]*?\)',
                         text):
        if re.search(r'\b' + re.escape(m.group(1)) + WRITE, text[m.end():]):
            found.add(m.group(2))
    for line in text.splitlines():
        for m in re.finditer(r'\+\s*header::(\w+)', line):
            if re.search(r'memcmp\(|memcpy\(&|reinterpret_cast<const ', line):
                continue  # read
            found.add(m.group(1))
    return found


def main():
    root = sys.argv[1]
    layout = open(os.path.join(root, 'src/kv/index_file.hpp')).read()
    table, words = owners(layout)
    bad = []
    for f, ws in table.items():
        for w in ws - words:
            bad.append(f'index_file.hpp lists {w} for {f}: no such header word')
    files = sorted(glob.glob(os.path.join(root, 'src/kv/*.cpp')) +
                   glob.glob(os.path.join(root, 'src/kv/*.hpp')))
    seen = 0
    written = collections.defaultdict(set)
    for path in files:
        name = os.path.basename(path)
        if name == 'index_file.hpp':
            continue
        for w in sorted(writes(open(path).read())):
            seen += 1
            written[name].add(w)
            if w not in table.get(name, set()):
                bad.append(f'src/kv/{name} writes header::{w}, which index_file.hpp does not '
                           f'give it')
    for f, ws in table.items():
        for w in sorted(ws & words - written[f]):
            bad.append(f'index_file.hpp gives header::{w} to {f}, which does not write it')
    if seen < 40:
        bad.append(f'only {seen} writes found: the check no longer sees them')
    for b in bad:
        print(b)
    if not bad:
        print(f'{seen} writes of header words, each by a file that owns the word')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
