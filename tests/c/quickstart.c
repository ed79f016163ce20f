/* The README's C quick start: one scheduler step through the paged KV manager. */
#include <stdio.h>

#include "kvplug.h"

#define CHECK(call)                                                        \
  do {                                                                     \
    kvp_status st_ = (call);                                               \
    if (st_ != KVP_OK) {                                                   \
      fprintf(stderr, "%s: %s\n", kvp_status_string(st_), kvp_last_error()); \
      return 1;                                                            \
    }                                                                      \
  } while (0)

int main(void) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 64; /* block_size stays 16 */
  kvp_manager *m = NULL;
  CHECK(kvp_manager_create(&cfg, &m));

  /* Admit two requests, then grow both by one decode token. */
  CHECK(kvp_manager_add(m, 100, 40));
  CHECK(kvp_manager_add(m, 101, 7));
  int64_t ids[2] = {100, 101};
  int32_t ones[2] = {1, 1};
  CHECK(kvp_manager_grow(m, ids, ones, 2));

  /* The step's attention inputs, written into our buffers. */
  enum { MAX_BLOCKS = 4 };
  int32_t table[2][MAX_BLOCKS], lens[2], slots[2], num_slots = 0;
  CHECK(kvp_manager_describe(m, ids, 2, &table[0][0], MAX_BLOCKS, lens, slots, 2, &num_slots));
  for (int i = 0; i < 2; i++)
    printf("seq %lld: len %d, blocks [%d %d %d %d], new token in slot %d\n", (long long)ids[i],
           lens[i], table[i][0], table[i][1], table[i][2], table[i][3], slots[i]);

  /* Running out of blocks is an answer, not a crash: nothing changed. */
  int32_t too_many[2] = {10000, 1};
  kvp_status st = kvp_manager_grow(m, ids, too_many, 2);
  if (st != KVP_ERR_OUT_OF_BLOCKS) return 1;
  printf("%s: %s\n", kvp_status_string(st), kvp_last_error());

  kvp_manager_stats stats = KVP_MANAGER_STATS_INIT;
  CHECK(kvp_manager_stats_get(m, &stats));
  printf("%d of %d blocks used, fragmentation %.2f\n", stats.used_blocks, stats.num_blocks,
         stats.fragmentation);

  CHECK(kvp_manager_remove(m, ids, 2));
  kvp_manager_destroy(m);
  return 0;
}
