/* SPDX-License-Identifier: Apache-2.0 */
/* A C program built against an installed keel: puts, gets back and locks. */
#include <keel/keel.h>

#include <stdio.h>
#include <string.h>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  char path[4096];
  snprintf(path, sizeof path, "%s/consumer-c-store", argv[1]);
  keel_store* s = NULL;
  int rc = keel_store_open(path, NULL, &s);
  if (rc != 0) {
    fprintf(stderr, "open: %s\n", keel_last_error_message());
    return 3;
  }
  if (keel_put(s, "key", 3, "value", 5) != 0) return 4;
  char buf[16];
  size_t len = 0;
  if (keel_get(s, "key", 3, buf, sizeof buf, &len) != 0 || len != 5 ||
      memcmp(buf, "value", 5) != 0) {
    return 5;
  }
  keel_store_close(s);
  snprintf(path, sizeof path, "%s/consumer-c.lock", argv[1]);
  keel_mutex* m = NULL;
  if (keel_mutex_open("byte_ranges", path, &m) != 0) return 6;
  keel_entity e = {keel_entity_of("name", 4), 1};
  keel_guard* g = NULL;
  if (keel_mutex_lock(m, &e, 1, 0, &g) != 0 || keel_guard_unlock(g) != 0) return 7;
  keel_mutex_close(m);
  printf("installed keel %s from C: ok\n", keel_version(NULL, NULL, NULL));
  return 0;
}
