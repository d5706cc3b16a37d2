/* SPDX-License-Identifier: Apache-2.0 */
/* keel's C API from C11, as a C user sees it: every call, its errors, and a store shared with
 * a forked child. Exits 0 when every check holds; else prints the failed check's line and
 * exits 1. Usage: keel_c_test DIR (an empty scratch directory). */

#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "keel/keel.h"

static int failures = 0;
#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              keel_last_error_message());                                                      \
      ++failures;                                                                              \
    }                                                                                          \
  } while (0)
#define CHECK_OK(call) CHECK((call) == 0)

static char dir[4096];

static const char* at(const char* name) {
  static char path[8192];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return path;
}

static void test_version_and_errors(void) {
  int major = -1, minor = -1, patch = -1;
  const char* v = keel_version(&major, &minor, &patch);
  char expect[64];
  snprintf(expect, sizeof expect, "%d.%d.%d", major, minor, patch);
  CHECK(strcmp(v, expect) == 0);
  CHECK(major >= 0 && minor >= 0 && patch >= 0);
  CHECK(keel_version(NULL, NULL, NULL) == v);
  CHECK(strcmp(keel_strerror(0), "Success") == 0);
  CHECK(strstr(keel_strerror(ENOSPC), "space") != NULL);
  CHECK(strstr(keel_strerror(KEEL_CORRUPT), "corrupt") != NULL);
  CHECK(strlen(keel_strerror(KEEL_CONFLICT)) > 0);
  CHECK(strlen(keel_strerror(KEEL_NOT_FOUND)) > 0);
  CHECK(strlen(keel_strerror(-1)) > 0);
  CHECK(keel_strerror(KEEL_CONFLICT) == keel_strerror(KEEL_CONFLICT)); /* static storage */
}

static void test_store(void) {
  keel_store* s = NULL;
  keel_store_options o;
  keel_store_options_init(&o);
  CHECK(o.version == KEEL_STORE_OPTIONS_VERSION);
  CHECK(o.create_if_missing == 1 && o.verify_checksums == 1 && o.lock_timeout_ms == 30000);

  /* Bad input: clear errors, no handle. */
  CHECK(keel_store_open(NULL, NULL, &s) == EINVAL && s == NULL);
  o.create_if_missing = 0;
  CHECK(keel_store_open(at("absent"), &o, &s) == ENOENT && s == NULL);
  CHECK(strstr(keel_last_error_path(), "absent") != NULL);
  o.create_if_missing = 1;
  o.version = 99;
  CHECK(keel_store_open(at("s"), &o, &s) == EINVAL && s == NULL);
  keel_store_options_init(&o);
  o.compact_dead_fraction = 2.0;
  CHECK(keel_store_open(at("s"), &o, &s) == EINVAL && s == NULL);
  /* A directory holding something else is refused and left alone. */
  mkdir(at("foreign"), 0700);
  FILE* f = fopen(at("foreign/data"), "w");
  CHECK(f != NULL);
  if (f != NULL) fclose(f);
  CHECK(keel_store_open(at("foreign"), NULL, &s) == KEEL_NOT_KEEL_FILE && s == NULL);

  CHECK_OK(keel_store_open(at("s"), NULL, &s));
  if (s == NULL) return;

  /* put, get (into a buffer, and its length alone), erase. */
  const char value[] = "binary\0value";
  CHECK_OK(keel_put(s, "k1", 2, value, sizeof value));
  char buf[64];
  size_t len = 0;
  CHECK_OK(keel_get(s, "k1", 2, buf, sizeof buf, &len));
  CHECK(len == sizeof value && memcmp(buf, value, len) == 0);
  len = 0;
  CHECK_OK(keel_get(s, "k1", 2, NULL, 0, &len));
  CHECK(len == sizeof value);
  memset(buf, 'x', sizeof buf);
  CHECK_OK(keel_get(s, "k1", 2, buf, 3, &len));
  CHECK(len == sizeof value && memcmp(buf, "bin", 3) == 0 && buf[3] == 'x');
  CHECK_OK(keel_put(s, "empty", 5, NULL, 0));
  CHECK_OK(keel_get(s, "empty", 5, buf, sizeof buf, &len));
  CHECK(len == 0);
  CHECK(keel_get(s, "nope", 4, buf, sizeof buf, &len) == KEEL_NOT_FOUND);
  CHECK(keel_erase(s, "nope", 4) == KEEL_NOT_FOUND);
  CHECK_OK(keel_erase(s, "empty", 5));
  CHECK(keel_get(s, "empty", 5, buf, sizeof buf, &len) == KEEL_NOT_FOUND);

  /* Keys: empty, over the limit, a length without bytes. */
  static char big[KEEL_MAX_KEY_SIZE + 1];
  memset(big, 'k', sizeof big);
  CHECK(keel_put(s, "", 0, "v", 1) == EINVAL);
  CHECK(keel_put(s, big, sizeof big, "v", 1) == KEEL_TOO_LARGE);
  CHECK_OK(keel_put(s, big, KEEL_MAX_KEY_SIZE, "v", 1));
  CHECK(keel_put(s, NULL, 3, "v", 1) == EINVAL);
  CHECK(keel_put(s, "k", 1, NULL, 3) == EINVAL);
  CHECK(keel_get(s, "k1", 2, buf, sizeof buf, NULL) == EINVAL);

  /* Transactions: own writes seen, views, commit, conflict, abort. */
  keel_txn* t = NULL;
  CHECK_OK(keel_txn_begin(s, &t));
  CHECK_OK(keel_txn_put(t, "t1", 2, "one", 3));
  const void* view = NULL;
  CHECK_OK(keel_txn_get_view(t, "t1", 2, &view, &len));
  CHECK(len == 3 && memcmp(view, "one", 3) == 0);
  CHECK_OK(keel_txn_get_view(t, "k1", 2, &view, &len));
  CHECK(len == sizeof value && memcmp(view, value, len) == 0);
  CHECK(keel_get(s, "t1", 2, buf, sizeof buf, &len) == KEEL_NOT_FOUND); /* not yet */
  CHECK_OK(keel_txn_erase(t, "k1", 2));
  CHECK(keel_txn_get(t, "k1", 2, buf, sizeof buf, &len) == KEEL_NOT_FOUND);
  uint64_t seq = 0;
  CHECK_OK(keel_txn_commit(t, KEEL_DURABLE_SYNC, &seq));
  CHECK(seq > 0);
  CHECK_OK(keel_get(s, "t1", 2, buf, sizeof buf, &len));
  CHECK(len == 3);
  CHECK(keel_get(s, "k1", 2, buf, sizeof buf, &len) == KEEL_NOT_FOUND);

  keel_txn* a = NULL;
  keel_txn* b = NULL;
  CHECK_OK(keel_txn_begin(s, &a));
  CHECK_OK(keel_txn_begin(s, &b));
  CHECK_OK(keel_txn_get(a, "t1", 2, buf, sizeof buf, &len));
  CHECK_OK(keel_txn_put(a, "t1", 2, "a", 1));
  CHECK_OK(keel_txn_get(b, "t1", 2, buf, sizeof buf, &len));
  CHECK_OK(keel_txn_put(b, "t1", 2, "b", 1));
  CHECK_OK(keel_txn_commit(a, KEEL_DURABLE_DEFAULT, NULL));
  CHECK(keel_txn_commit(b, KEEL_DURABLE_DEFAULT, NULL) == KEEL_CONFLICT);
  CHECK_OK(keel_get(s, "t1", 2, buf, sizeof buf, &len));
  CHECK(len == 1 && buf[0] == 'a');
  CHECK_OK(keel_txn_begin(s, &t));
  CHECK_OK(keel_txn_put(t, "gone", 4, "x", 1));
  keel_txn_abort(t);
  CHECK(keel_get(s, "gone", 4, buf, sizeof buf, &len) == KEEL_NOT_FOUND);
  CHECK_OK(keel_txn_begin(s, &t));
  CHECK(keel_txn_commit(t, 7, NULL) == EINVAL); /* a durability that is none of them */
  keel_txn_abort(NULL);

  /* Cursors: every key once, of the store and of a transaction's snapshot. */
  for (int i = 0; i < 1000; ++i) {
    char k[32];
    int n = snprintf(k, sizeof k, "key-%d", i);
    CHECK_OK(keel_put(s, k, (size_t)n, k, (size_t)n));
  }
  keel_cursor* c = NULL;
  CHECK_OK(keel_cursor_open(s, 0, &c));
  int seen = 0, matched = 0;
  const void *k, *v;
  size_t kl, vl;
  int rc;
  while ((rc = keel_cursor_next(c, &k, &kl, &v, &vl)) == 0) {
    ++seen;
    if (kl > 4 && memcmp(k, "key-", 4) == 0 && kl == vl && memcmp(k, v, kl) == 0) ++matched;
  }
  CHECK(rc == KEEL_NOT_FOUND);
  CHECK(matched == 1000);
  CHECK(seen == 1002); /* t1 and the longest key */
  CHECK(keel_cursor_next(c, &k, &kl, &v, &vl) == KEEL_NOT_FOUND);
  keel_cursor_close(c);
  CHECK_OK(keel_txn_begin(s, &t));
  CHECK_OK(keel_cursor_open_txn(t, 1, &c));
  CHECK_OK(keel_put(s, "later", 5, "x", 1)); /* after the snapshot: not seen */
  seen = 0;
  while ((rc = keel_cursor_next(c, &k, &kl, NULL, NULL)) == 0) {
    ++seen;
    CHECK(!(kl == 5 && memcmp(k, "later", 5) == 0));
  }
  CHECK(rc == KEEL_NOT_FOUND && seen == 1002);
  keel_cursor_close(c);
  CHECK(keel_txn_put(t, "w", 1, "x", 1) == EINVAL); /* a transaction that scanned is for reading */
  keel_txn_abort(t);

  /* A cursor whose transaction ended (aborted, or committed) fails with EINVAL from then on,
   * even once another transaction has taken its memory: it never reads another snapshot, nor
   * a freed one. A cursor closed first leaves nothing for its transaction's end to touch. */
  for (int commit = 0; commit < 2; ++commit) {
    keel_cursor* early = NULL;
    CHECK_OK(keel_txn_begin(s, &t));
    CHECK_OK(keel_cursor_open_txn(t, 0, &c));
    CHECK_OK(keel_cursor_open_txn(t, 0, &early));
    CHECK_OK(keel_cursor_next(c, &k, &kl, &v, &vl));
    keel_cursor_close(early);
    if (commit) {
      CHECK_OK(keel_txn_commit(t, KEEL_DURABLE_DEFAULT, NULL));
    } else {
      keel_txn_abort(t);
    }
    keel_txn* other = NULL;
    CHECK_OK(keel_txn_begin(s, &other));
    CHECK(keel_cursor_next(c, &k, &kl, &v, &vl) == EINVAL);
    CHECK(keel_cursor_next(c, &k, &kl, &v, &vl) == EINVAL);
    keel_cursor_close(c);
    keel_txn_abort(other);
  }

  /* A child of a fork uses the same store; the parent sees its commit. */
  pid_t pid = fork();
  if (pid == 0) {
    int r = keel_put(s, "child", 5, "hello", 5);
    _exit(r == 0 ? 0 : 1);
  }
  int status = 0;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
        WEXITSTATUS(status) == 0);
  CHECK_OK(keel_get(s, "child", 5, buf, sizeof buf, &len));
  CHECK(len == 5 && memcmp(buf, "hello", 5) == 0);

  /* stats, verify, compact, checkpoint, backup. */
  keel_store_stat st;
  memset(&st, 0xff, sizeof st);
  CHECK_OK(keel_store_stats(s, &st, sizeof st));
  CHECK(st.records == 1004 && st.segments >= 1 && st.users >= 1 && st.visible_seq >= seq);
  uint64_t two[2] = {0, 0};
  CHECK_OK(keel_store_stats(s, (keel_store_stat*)two, sizeof(uint64_t))); /* an older caller */
  CHECK(two[0] == 1004 && two[1] == 0);
  /* A newer caller: the fields this library does not know come back 0. */
  uint64_t wide[sizeof(keel_store_stat) / sizeof(uint64_t) + 2];
  memset(wide, 0xff, sizeof wide);
  CHECK_OK(keel_store_stats(s, (keel_store_stat*)wide, sizeof wide));
  CHECK(wide[0] == 1004);
  CHECK(wide[sizeof(keel_store_stat) / sizeof(uint64_t)] == 0);
  CHECK(wide[sizeof(keel_store_stat) / sizeof(uint64_t) + 1] == 0);
  uint64_t commits = 0, damaged = 99;
  CHECK_OK(keel_store_verify(s, &commits, &damaged));
  CHECK(commits > 0 && damaged == 0);
  uint64_t removed = 99;
  CHECK_OK(keel_store_compact(s, &removed));
  CHECK(removed != 99);
  CHECK_OK(keel_store_checkpoint(s));
  uint64_t keys = 0;
  CHECK_OK(keel_store_backup(s, at("copy"), &keys));
  CHECK(keys == 1004);
  CHECK(keel_store_backup(s, at("copy"), NULL) == EEXIST);
  keel_store_close(s);
  keel_store_close(NULL);

  /* The copy opens and holds what the store did; read-only refuses writes. */
  keel_store_options_init(&o);
  o.read_only = 1;
  o.create_if_missing = 0;
  CHECK_OK(keel_store_open(at("copy"), &o, &s));
  if (s == NULL) return;
  CHECK_OK(keel_get(s, "child", 5, buf, sizeof buf, &len));
  CHECK(keel_put(s, "x", 1, "y", 1) == KEEL_READ_ONLY);
  keel_store_close(s);
  /* error_if_exists. */
  keel_store_options_init(&o);
  o.error_if_exists = 1;
  CHECK(keel_store_open(at("copy"), &o, &s) == EEXIST);
}

static void test_store_damage(void) {
  /* A record damaged by hand: verify names the file and the offset. */
  keel_store* s = NULL;
  CHECK_OK(keel_store_open(at("d"), NULL, &s));
  if (s == NULL) return;
  char value[4096];
  memset(value, 'v', sizeof value);
  CHECK_OK(keel_put(s, "victim", 6, value, sizeof value));
  keel_store_close(s);
  FILE* seg = fopen(at("d/seg/0000000000000001"), "r+b");
  CHECK(seg != NULL);
  if (seg == NULL) return;
  /* The value's bytes: flip one 'v' in the segment. */
  char page[8192];
  size_t n = fread(page, 1, sizeof page, seg);
  long where = -1;
  for (size_t i = 0; i + 16 < n; ++i) {
    if (memcmp(page + i, "vvvvvvvvvvvvvvvv", 16) == 0) {
      where = (long)i + 100;
      break;
    }
  }
  CHECK(where > 0);
  fseek(seg, where, SEEK_SET);
  fputc('w', seg);
  fclose(seg);
  CHECK_OK(keel_store_open(at("d"), NULL, &s));
  if (s == NULL) return;
  size_t len = 0;
  CHECK(keel_get(s, "victim", 6, NULL, 0, &len) == KEEL_CORRUPT);
  CHECK(strstr(keel_last_error_path(), "seg/0000000000000001") != NULL);
  CHECK(keel_last_error_offset() != UINT64_MAX);
  CHECK(strstr(keel_last_error_message(), "seg/0000000000000001") != NULL);
  uint64_t damaged = 0;
  CHECK(keel_store_verify(s, NULL, &damaged) == KEEL_CORRUPT);
  CHECK(damaged >= 1);
  keel_store_close(s);
}

static void test_mutex(void) {
  CHECK(keel_mutex_algorithm(0) != NULL);
  size_t count = 0;
  while (keel_mutex_algorithm(count) != NULL)
    ++count;
  CHECK(count >= 7);
  CHECK(keel_entity_of("a", 1) == keel_entity_of("a", 1));
  CHECK(keel_entity_of("a", 1) != keel_entity_of("b", 1));
  CHECK(keel_entity_of("a", 1) <= KEEL_ENTITY_MAX);

  keel_mutex* m = NULL;
  CHECK(keel_mutex_open("no_such_algorithm", at("lock"), &m) == EINVAL && m == NULL);
  for (size_t i = 0; i < count; ++i) {
    const char* name = keel_mutex_algorithm(i);
    char path[64];
    snprintf(path, sizeof path, "lock-%s", name);
    if (strcmp(name, "lock_files") == 0 || strcmp(name, "flock") == 0) mkdir(at(path), 0700);
    int rc = keel_mutex_open(name, at(path), &m);
    CHECK(rc == 0);
    if (rc != 0) continue;
    keel_entity set[2] = {{keel_entity_of("x", 1), 1}, {7, 0}};
    keel_guard* g = NULL;
    CHECK_OK(keel_mutex_lock(m, set, 2, -1, &g));
    /* Held by this thread: a second lock of it is a deadlock refused. */
    keel_guard* again = NULL;
    rc = keel_mutex_lock(m, set, 1, 0, &again);
    CHECK(rc == EDEADLK && again == NULL);
    /* Held by another process: a try fails at once, a deadline runs out. */
    pid_t pid = fork();
    if (pid == 0) {
      keel_mutex* mc = NULL;
      keel_guard* gc = NULL;
      if (keel_mutex_open(name, at(path), &mc) != 0) _exit(10);
      int r1 = keel_mutex_lock(mc, set, 1, 0, &gc);
      int r2 = keel_mutex_lock(mc, set, 1, 20, &gc);
      keel_entity other = {8, 1};
      int r3 = keel_mutex_lock(mc, &other, 1, 0, &gc);
      int r4 = keel_guard_unlock(gc);
      keel_mutex_close(mc);
      _exit(r1 == EWOULDBLOCK && r2 == ETIMEDOUT && r3 == 0 && r4 == 0 ? 0 : 1);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
          WEXITSTATUS(status) == 0);
    CHECK_OK(keel_guard_unlock(g));
    CHECK_OK(keel_guard_unlock(NULL));
    /* Bad sets. */
    keel_entity too_big = {KEEL_ENTITY_MAX + 1, 1};
    CHECK(keel_mutex_lock(m, &too_big, 1, 0, &g) == EINVAL);
    CHECK(keel_mutex_lock(m, NULL, 1, 0, &g) == EINVAL);
    CHECK(keel_mutex_lock(m, set, SIZE_MAX, 0, &g) == EINVAL);
    CHECK_OK(keel_mutex_lock(m, NULL, 0, 0, &g)); /* the empty set */
    CHECK_OK(keel_guard_unlock(g));
    keel_mutex_close(m);
    m = NULL;
    CHECK_OK(keel_mutex_remove_resources(name, at(path)));
  }
  CHECK(keel_mutex_remove_resources("no_such_algorithm", at("lock")) == EINVAL);
  keel_mutex_close(NULL);
  /* One path, two algorithms: refused. */
  keel_mutex* first = NULL;
  keel_mutex* second = NULL;
  CHECK_OK(keel_mutex_open("byte_ranges", at("shared-lock"), &first));
  CHECK(keel_mutex_open("atomic_append", at("shared-lock"), &second) ==
        KEEL_USED_BY_ANOTHER_ALGORITHM);
  keel_mutex_close(first);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: keel_c_test DIR\n");
    return 2;
  }
  snprintf(dir, sizeof dir, "%s", argv[1]);
  test_version_and_errors();
  test_store();
  test_store_damage();
  test_mutex();
  if (failures != 0) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures == 0 ? 0 : 1;
}
