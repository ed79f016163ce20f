/* Checks what a build of the library carries: `kernels_built with` expects
 * the CUDA kernels (a kernel call answers OK on a GPU machine, NO_DEVICE
 * elsewhere), `kernels_built without` expects a build without them (every
 * kernel call answers UNSUPPORTED, saying how to build them). Either way the
 * CPU parts work. Used by tests/fresh_clone.sh. */
#include <stdio.h>
#include <string.h>

#include "kvplug.h"

static int fail(const char *what, kvp_status st) {
  fprintf(stderr, "kernels_built: %s: %s: %s\n", what, kvp_status_string(st), kvp_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 2 || (strcmp(argv[1], "with") != 0 && strcmp(argv[1], "without") != 0)) {
    fprintf(stderr, "usage: kernels_built with|without\n");
    return 2;
  }
  int want_kernels = strcmp(argv[1], "with") == 0;

  /* The CPU parts: one manager round trip. */
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 8;
  kvp_manager *m = NULL;
  kvp_status st = kvp_manager_create(&cfg, &m);
  if (st != KVP_OK) return fail("kvp_manager_create", st);
  if ((st = kvp_manager_add(m, 1, 20)) != KVP_OK) return fail("kvp_manager_add", st);
  kvp_manager_destroy(m);

  /* A valid KV write of no tokens: it loads the kernels and launches nothing. */
  kvp_kv_write_args a = KVP_KV_WRITE_ARGS_INIT;
  a.dtype = KVP_DTYPE_F16;
  a.head_dim = 128;
  a.num_tokens = 0;
  a.num_kv_heads = 8;
  a.num_blocks = 16;
  a.block_size = 16;
  a.key_token_stride = a.value_token_stride = 8 * 128;
  a.key_head_stride = a.value_head_stride = 128;
  a.cache_block_stride = 16 * 8 * 128;
  a.cache_token_stride = 8 * 128;
  a.cache_head_stride = 128;
  const char *names[2] = {"kvp_kv_write", "kvp_attn_prepare"};
  kvp_status first = KVP_OK;
  for (int i = 0; i < 2; i++) {
    st = i == 0 ? kvp_kv_write(&a, 0) : kvp_attn_prepare();
    if (i == 0) first = st;
    if (want_kernels) {
      if (st != KVP_OK && st != KVP_ERR_NO_DEVICE) return fail(names[i], st);
    } else {
      if (st != KVP_ERR_UNSUPPORTED) return fail(names[i], st);
      if (strstr(kvp_last_error(), names[i] + 4) == NULL ||
          strstr(kvp_last_error(), "built without its CUDA kernels") == NULL || strstr(kvp_last_error(), "make") == NULL)
        return fail("the message of a build without kernels", st);
    }
  }
  printf("kernels_built: library %s its kernels, as expected (%s)\n", want_kernels ? "with" : "without",
         want_kernels ? kvp_status_string(first) : kvp_last_error());
  return 0;
}
