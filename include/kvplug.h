/*
 * kvplug.h - the C interface of libkvplug.
 *
 * kvplug manages an LLM serving engine's KV cache and runs the attention
 * kernels that read it. This header is the library's only interface and its
 * single source of truth: every function, type and rule a host needs is here.
 *
 * Conventions (they hold for every function unless its comment says
 * otherwise):
 *
 *   Status.    Every function returns kvp_status. KVP_OK (0) is success; any
 *              other value is an error and kvp_last_error() returns a message
 *              for it. New codes may be added in minor versions: treat unknown
 *              codes as errors.
 *   Atomicity. A call that fails changes nothing: no state is modified and no
 *              caller buffer is written, unless its comment says otherwise.
 *              The exception is KVP_ERR_INTERNAL, a bug in kvplug (a broken
 *              assumption or a recovered panic): the object the call was on
 *              may be half-changed; destroy it rather than use it further.
 *   Memory.    Arrays are owned by the caller. The library reads input arrays
 *              and writes output arrays only during the call and keeps no host
 *              pointer after it returns. Device pointers passed to kernel
 *              launches belong to the caller; the library never frees them.
 *   Handles.   Opaque, typed (kvp_manager *, ...). Created by kvp_X_create and
 *              released by kvp_X_destroy, which accepts NULL. A handle used
 *              after destroy, or a pointer that is not a handle of that type,
 *              gives KVP_ERR_INVALID_HANDLE (it is never dereferenced); a
 *              destroy given one does nothing (kvp_manager_destroy leaves a
 *              kvp_vcache alone). kvp_live_handles counts the live ones.
 *   Threads.   All functions may be called from any thread. Each object
 *              documents its own thread-safety; kvp_manager serialises
 *              concurrent calls on one handle with an internal lock.
 *   Structs.   Structs passed by pointer begin with size_t struct_size and
 *              evolve by one rule, stated under "Struct versions" below:
 *              initialise each with its KVP_..._INIT macro, which sets
 *              struct_size and leaves every other field 0, which always means
 *              the field's default; then set the fields you need.
 *   Integers.  Counts are int32_t, sequence ids int64_t (the engine's own ids),
 *              block ids and token ids int32_t, device pointers and CUDA
 *              streams uint64_t (a CUdeviceptr, a CUstream; stream 0 is the
 *              legacy default stream).
 *
 * Go runtime facts a host must know: the library contains a Go runtime. Never
 * dlclose() it (the runtime cannot be unloaded). Load it at most once per
 * process. Do not fork() after loading it and use it in the child: every
 * function called in a child forked after the library was loaded fails at
 * once with KVP_ERR_UNSUPPORTED (destroy functions do nothing; kvp_version
 * and kvp_version_string still answer), since entering the runtime there
 * could deadlock. Engines that fork workers load it in each worker after
 * the fork, or use spawn.
 *
 * The ABI is stable within a major version.
 *
 * Changes in 0.7 for a host built against 0.6 (binary compatible):
 *   - FP8 caches on Hopper's prefill mainloop: kvp_paged_prefill and
 *     kvp_paged_cascade read an e4m3 cache under plans cut for the Hopper
 *     (sm_90a) mainloop, which widen its tiles to the call's 16-bit type on
 *     their way into shared memory (they answered INVALID_ARGUMENT in 0.6).
 *     KVP_PREFILL_NO_HOPPER and KVP_CASCADE_NO_HOPPER still keep the sm_80
 *     kernels.
 *   - KVP_PREFILL_FP8_QKV (a kvp_prefill_plan_args.flags bit; 0.6 answered
 *     INVALID_ARGUMENT for it): FP8 Q/K/V prefill over an e4m3 cache on
 *     Hopper, head_dim 128 (see kvp_prefill_plan).
 *   - The host tier with layer groups ("Layer groups"): a manager with
 *     full-attention and sliding-window groups accepts a host tier (it
 *     answered UNSUPPORTED in 0.6); kvp_manager_flush_copies may then need
 *     room for more demotions than demote_ahead (its BUFFER_TOO_SMALL
 *     answer says how many).
 *   - kvp_manager_match_blocks and kvp_block_match: a prompt's hit and
 *     beside it group 0's longest cached prefix, where a recurrent
 *     group's hit stops short for want of a checkpoint; an engine ends a
 *     prompt's step there to leave one ("Layer groups").
 *   - Tier stores by the copy engines: kvp_kv_layers gains flags
 *     (appended); KVP_TIER_COPY_STORE_COPY_ENGINE makes a tier copier
 *     hand its demotions to the copy engines (cuMemcpyBatchAsync) instead
 *     of its kernel, leaving the SMs to the kernels running beside them
 *     (see "tier copy"). 0 keeps the kernel, as before.
 *   - E4M3 caches with token-head scales: num_blocks * block_size *
 *     num_kv_heads below 2^31 (it was 2^50; INVALID_ARGUMENT past it), and
 *     the decode reads a row whose K scale is 0 as unreadable (kvp_kv_scale).
 *   - kvp_manager_config.write_through_slack, in the place of
 *     host_tier_reserved (same size and offset; 0, which 0.6 required
 *     there, keeps 0.6's behaviour): write-through stores wait while the
 *     GPU pool's free blocks exceed it ("Host KV tier", Write-through).
 *   - kvp_manager_match_room: the blocks an admission of a prompt could
 *     allocate now beyond its GPU hit, for a scheduler that decides how
 *     much of a prompt to admit before admitting it.
 *   - kvp_paged_prefill refuses a stale plan (INVALID_ARGUMENT): one whose
 *     workspace a later plan has written another work list into (0.6 ran
 *     it over that list). Its fingerprint is plan-state word
 *     KVP_PLAN_STATE_WORK_LIST (a plan copied whole keeps it).
 *   - The shared tier: a prompt whose first block past its GPU and host
 *     matches the server said it lacks is not looked up again for a
 *     second (kvp_tier_stats gains shared_remembered, appended), and the
 *     stores have connections of their own ("Shared KV tier").
 *
 * Changes in 0.6 for a host built against 0.5 (binary compatible):
 *   - Layer groups for hybrid models ("Layer groups" in the manager's
 *     section): kvp_manager_config gains layer_groups, num_layer_groups,
 *     max_model_len and block_bytes (appended); new kvp_layer_group,
 *     kvp_manager_describe_groups (one call: a block table and slot
 *     mapping per group), kvp_manager_group_blocks and
 *     kvp_manager_take_copies. Sliding-window groups give back the blocks
 *     no query reads; recurrent groups hold one state block per sequence;
 *     the prefix cache holds every kind, recurrent states at checkpoints.
 *     A manager without groups behaves as before.
 *   - Attention sinks: kvp_paged_decode_args and kvp_paged_prefill_args
 *     (so kvp_paged_cascade too) gain an appended `sinks`, one float32
 *     logit per query head added to the softmax denominator (gpt-oss);
 *     0 = none, as before.
 *   - FP8 caches in the host tier: kvp_tier_copier_create takes e4m3
 *     layers (layers->kv) and copies each block's per-token-head scales
 *     with it (it answered UNSUPPORTED in 0.5); see "tier copy".
 *   - FP8 shared-prefix attention: kvp_paged_cascade reads an e4m3 cache
 *     (it answered UNSUPPORTED in 0.5); new flag KVP_CASCADE_NO_HOPPER
 *     plans for the sm_80 kernels that read it on a Hopper GPU.
 *   - Sliding windows in decode: kvp_paged_decode_args gains an appended
 *     `window_size` (0 = none, as before), and a prefill plan with a window
 *     now routes uniform short queries to the decode kernel too.
 *   - KV events per layer group ("KV events of layer groups" in the prefix
 *     cache's section): a manager with layer groups records every group's
 *     cached blocks; new kvp_kv_group_event, a kvp_kv_event with its
 *     group, kvp_manager_drain_group_events and
 *     kvp_manager_next_group_event_size. kvp_manager_drain_events reports
 *     group 0's events, as before. The event publisher sends every
 *     group's events with vLLM's group_idx. A manager without groups
 *     records and publishes what it did.
 *
 * Changes in 0.5 for a host built against 0.4 (binary compatible):
 *   - FP8 KV caches: kvp_paged_kv.dtype may be KVP_DTYPE_E4M3 under an f16
 *     or bf16 call, with the new appended field scale_kind
 *     (KVP_KV_SCALE_TOKEN_HEAD: one float32 scale per token and kv head,
 *     written by kvp_kv_write; KVP_KV_SCALE_TENSOR: one calibrated scale)
 *     and the scale arrays k_scale and v_scale. kvp_kv_write quantises
 *     into it; kvp_paged_decode reads it, and so does kvp_paged_prefill on
 *     the sm_80 mainloop (plan with KVP_PREFILL_NO_HOPPER on a Hopper GPU;
 *     a Hopper plan is INVALID_ARGUMENT); kvp_paged_cascade and the tier
 *     copier answer KVP_ERR_UNSUPPORTED for such a cache in this version.
 *
 * Changes in 0.4 for a host built against 0.3 (binary compatible; one
 * source change):
 *   - One paged-KV descriptor, kvp_paged_kv: a layer's K and V caches, their
 *     strides, the block table, the block size and count and the cache's
 *     dtype, with room for the scale arrays of scaled cache formats. The
 *     launch args (kvp_kv_write_args, kvp_paged_decode_args,
 *     kvp_paged_prefill_args, the last also kvp_paged_cascade's) gain an
 *     appended pointer `kv` to one; set it and leave the args' own cache
 *     fields 0. Args that leave kv NULL describe the cache as before, so a
 *     0.3 host runs unchanged; new cache formats come through the
 *     descriptor only. kvp_kv_layers gains `kv`, the layers' descriptors,
 *     for the tier copier.
 *   - kvp_attn_plan's last six words are named `state` (they were
 *     `reserved`, which they never were: they hold the plan's state).
 *     Same offsets and meaning; a host that read plan.reserved[...]
 *     renames it to plan.state[...].
 *   - A struct_size that ends inside a pointer field (no header's size)
 *     is KVP_ERR_STRUCT_SIZE.
 *
 * Changes in 0.3 for a host built against 0.2:
 *   - Prefix cache: blocks a step fills stay uncomputed until the new
 *     kvp_manager_mark_computed; kvp_manager_remove drops a sequence's
 *     uncomputed blocks from the cache, and refuses with the new status
 *     KVP_ERR_IN_USE while a live sequence shares them. A 0.2 host that
 *     does not call mark_computed keeps correct results but no longer
 *     caches blocks across requests: call it once per step after the
 *     forward pass ("Computed K/V" in the prefix cache section).
 *   - kvp_prefix_stats gains uncomputed_blocks and dropped_uncomputed
 *     (appended, by the struct rule below).
 *   - The host tier's write-through (kvp_manager_config.write_through,
 *     appended): copies of computed blocks that stay on the GPU.
 *   - The shared tier and store speak AUTH, TLS, a keyed MAC and Valkey
 *     Cluster (fields appended to kvp_manager_config,
 *     kvp_shared_store_config and both stats structs).
 *   - A call in a child forked after the library was loaded fails at once
 *     with KVP_ERR_UNSUPPORTED instead of entering the Go runtime.
 *   - kvp_manager_add and kvp_manager_admit refuse a prompt that needs more
 *     blocks than the whole pool has with KVP_ERR_INVALID_ARGUMENT (before:
 *     OUT_OF_BLOCKS, or admit's short count), so a scheduler does not
 *     retry it forever.
 *
 * Struct versions. Every struct that begins with struct_size follows one rule
 * (zstd's and sqlite's promise of append-only parameter structs, with the
 * forward-compatibility check of Linux's extensible system calls):
 *   - Fields are only ever appended; none is removed, reordered or given a new
 *     meaning within a major version. A field's value 0 is its default.
 *   - The library accepts every struct_size from the struct's first released
 *     size (listed below) to its own sizeof. An input struct's fields past the
 *     caller's struct_size take their defaults; an output struct is written
 *     only up to the caller's struct_size. So a host compiled against an
 *     older header keeps working with a newer library.
 *   - A struct_size larger than the library's own comes from a newer header:
 *     accepted when every byte past the library's size is 0 (the host left
 *     the fields this library does not know at their defaults), refused with
 *     KVP_ERR_STRUCT_SIZE otherwise, so a setting is never silently ignored.
 *     Output structs get those bytes zeroed.
 *   - struct_size below the first released size, or above 64 KiB, gives
 *     KVP_ERR_STRUCT_SIZE.
 *   - A pointer field of an input struct holding a value in the first page
 *     (non-zero and below 4096: garbage, never an address) gives
 *     KVP_ERR_INVALID_ARGUMENT, whether or not the call would read it.
 *   First released sizes (x86-64 and aarch64 Linux):
 *     kvp_manager_config     through block_size (16 bytes)
 *     kvp_manager_stats      through num_blocks (12 bytes)
 *     kvp_prefix_stats       through queries (16 bytes)
 *     kvp_vcache_stats       through page_size (16 bytes)
 *     kvp_cascade_plan_args  through headroom (112 bytes)
 *     kvp_tier_stats         through reserved (160 bytes)
 *     kvp_shared_store_config through reserved (64 bytes)
 *     kvp_shared_store_stats through reserved (88 bytes)
 *     kvp_kv_write_args      through slot_mapping (128 bytes)
 *     kvp_paged_decode_args  through q_len (192 bytes)
 *     kvp_paged_prefill_args through reserved2 (144 bytes)
 *     kvp_kv_layers          through v_block_stride (56 bytes)
 *     kvp_paged_kv           through v_scale (104 bytes)
 *     every other struct     its whole size in version 0.2.0
 *   Structs that are elements of caller arrays (kvp_mm_item, kvp_prefix_keys,
 *   kvp_prefix_match, kvp_block_copy, kvp_block_mm, kvp_kv_event,
 *   kvp_kv_group_event, kvp_tier_copy, kvp_tier_match, kvp_layer_group,
 *   kvp_block_match)
 *   have no
 *   struct_size: their layout is fixed for a major version, and a new layout
 *   would come with new functions.
 *
 * Layout of this file: each part declares its types, then its functions.
 * The functions of every part sit inside #ifndef KVPLUG_NO_PROTOTYPES, a
 * macro that only the library's own Go glue defines (it declares the same
 * functions with Go's types). Hosts never define it.
 */
#ifndef KVPLUG_H
#define KVPLUG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                  */
/* ------------------------------------------------------------------------ */

#define KVP_VERSION_MAJOR 0
#define KVP_VERSION_MINOR 7
#define KVP_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH, comparable with kvp_version(). */
#define KVP_VERSION_NUMBER \
  (KVP_VERSION_MAJOR * 10000 + KVP_VERSION_MINOR * 100 + KVP_VERSION_PATCH)

/* KVP_STRUCT_INIT(T): a T with struct_size = sizeof(T) and every other field
 * 0, its default; every KVP_..._INIT macro of a versioned struct is this.
 * Use it to initialise: `kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;`.
 * (C: a designated initializer; C++: a value-initialised T, so neither
 * warns under -Wextra.) */
#ifdef __cplusplus
#define KVP_STRUCT_INIT(T) ([] { T kvp_v_{}; kvp_v_.struct_size = sizeof(T); return kvp_v_; }())
#else
#define KVP_STRUCT_INIT(T) {.struct_size = sizeof(T)}
#endif

/* ------------------------------------------------------------------------ */
/* Limits                                                                   */
/* ------------------------------------------------------------------------ */

/* Bounds of counts the functions check (INVALID_ARGUMENT beyond them), the
 * library's own constants: a count is refused before anything is sized by
 * it. Each function's comment says which of its arguments they bound. */
#define KVP_MAX_BATCH (1 << 20)         /* sequence ids (or slots) of one manager or vcache call */
#define KVP_MAX_ATTN_BATCH 65535        /* sequences of one attention plan or launch */
#define KVP_MAX_PROMPT_TOKENS (1 << 30) /* tokens of one prompt or sequence */
#define KVP_MAX_MM_ITEMS (1 << 20)      /* multimodal items of one prompt */
#define KVP_MAX_SALT_LEN 1024           /* bytes of a prompt's cache salt */
#define KVP_MAX_BYTES 0x7fffffffffffffffULL /* a byte count (workspace_bytes): INT64_MAX */
#define KVP_MAX_TIER_LAYERS 1024        /* layers of one tier copier's KV layout */
#define KVP_MAX_LAYER_GROUPS 64         /* layer groups of one manager */

#ifndef KVPLUG_NO_PROTOTYPES
/* The version of the loaded library, encoded as KVP_VERSION_NUMBER. A host
 * built against this header should check that kvp_version() / 10000 equals
 * KVP_VERSION_MAJOR. */
uint32_t kvp_version(void);

/* The loaded library's version as "MAJOR.MINOR.PATCH"; static storage. */
const char *kvp_version_string(void);
#endif


/* ------------------------------------------------------------------------ */
/* Status codes and errors                                                  */
/* ------------------------------------------------------------------------ */

typedef enum kvp_status {
  KVP_OK = 0,
  KVP_ERR_INVALID_ARGUMENT = 1,   /* a value out of range: zero, negative or huge count, bad enum */
  KVP_ERR_NULL_POINTER = 2,       /* a required pointer or buffer is NULL */
  KVP_ERR_STRUCT_SIZE = 3,        /* a struct's struct_size is not one this library accepts */
  KVP_ERR_INVALID_HANDLE = 4,     /* NULL, destroyed, or not a handle of this type */
  KVP_ERR_UNKNOWN_SEQUENCE = 5,   /* no live sequence has that id (never added, or removed) */
  KVP_ERR_DUPLICATE_SEQUENCE = 6, /* the id is live already, or repeated within one batch */
  KVP_ERR_OUT_OF_BLOCKS = 7,      /* too few free (or evictable) blocks; nothing changed */
  KVP_ERR_BUFFER_TOO_SMALL = 8,   /* a caller buffer cannot hold the result; nothing written */
  KVP_ERR_NO_DEVICE = 9,          /* no CUDA driver or no usable device on this machine */
  KVP_ERR_CUDA = 10,              /* a CUDA driver call failed; the message names it */
  KVP_ERR_UNSUPPORTED = 11,       /* a valid request this build or device does not support */
  KVP_ERR_OUT_OF_MEMORY = 12,     /* a memory budget is exhausted; nothing changed */
  KVP_ERR_NOT_FOUND = 13,         /* a key (prefix, slot, pin) that is not present */
  KVP_ERR_INTERNAL = 14,          /* a bug in kvplug (a recovered panic); please report it */
  KVP_ERR_IN_USE = 15             /* the call would take state another live sequence still uses
                                     (blocks it shares that no forward pass computed yet); nothing changed */
} kvp_status;

#ifndef KVPLUG_NO_PROTOTYPES
/* The message of the last failed call made by the calling thread, in storage
 * owned by that thread, valid until the thread's next failing kvplug call.
 * Successful calls do not clear it. Never NULL (empty when no call failed). */
const char *kvp_last_error(void);

/* The enumerator's name ("KVP_ERR_OUT_OF_BLOCKS"), or "KVP_ERR_UNKNOWN_STATUS" for a
 * code this version does not define; static storage; never NULL. */
const char *kvp_status_string(kvp_status status);
#endif


/* ------------------------------------------------------------------------ */
/* Logging                                                                  */
/* ------------------------------------------------------------------------ */

typedef enum kvp_log_level {
  KVP_LOG_DEBUG = 0,
  KVP_LOG_INFO = 1,
  KVP_LOG_WARN = 2,
  KVP_LOG_ERROR = 3,
  KVP_LOG_OFF = 4
} kvp_log_level;

/* Receives one formatted log line (no trailing newline). msg is valid only
 * during the call. It may be called from any thread, concurrently; it must not
 * call back into kvplug: the code that logged may hold a lock the call would
 * need. A call on a handle (any kvp_manager_* or kvp_vcache_* function, a
 * destroy included), kvp_vcache_create or kvp_live_handles made from inside
 * the callback fails with KVP_ERR_UNSUPPORTED and changes nothing (a destroy
 * does nothing). */
typedef void (*kvp_log_fn)(void *user, int level, const char *msg);

#ifndef KVPLUG_NO_PROTOTYPES
/* Routes the library's logs to fn (NULL: silence them; the default) and sets
 * the minimum level delivered. The library never writes to stdout or stderr.
 * Errors: KVP_ERR_INVALID_ARGUMENT for a level outside [DEBUG, OFF]. */
kvp_status kvp_set_logger(kvp_log_fn fn, void *user, int level);

/* Changes the minimum level only. */
kvp_status kvp_set_log_level(int level);

/* *out = the number of live handles of every type (created and not yet
 * destroyed), for a host's leak checks. Errors: NULL_POINTER. */
kvp_status kvp_live_handles(int64_t *out);
#endif


/* ------------------------------------------------------------------------ */
/* Paged KV manager                                                         */
/* ------------------------------------------------------------------------ */
/*
 * A kvp_manager owns a pool of num_blocks KV blocks of block_size tokens each
 * and the block table of every live sequence. The engine's scheduler calls it
 * once per stage of each step: add (admit), grow, describe, remove. It manages
 * block ids only: the KV memory itself is the engine's, laid out
 * [num_blocks, block_size, kv_heads, head_dim], and slot s means
 * block s / block_size, row s % block_size.
 *
 * block_size 1 is token-granular mode (TokenAttention): every block is one
 * token slot and a sequence's block table row is its req-to-token row. In
 * every mode a sequence's new blocks extend its last block's run
 * contiguously when the pool has such a run, so kernels read runs rather than
 * scattered slots.
 *
 * Thread-safety: all functions on one kvp_manager are safe to call from
 * several threads; they are serialised by the handle's lock. Distinct managers
 * are independent.
 */
typedef struct kvp_manager kvp_manager;

/* Layer groups (hybrid models; since 0.6). A model that mixes kinds of
 * layers -- full attention, sliding-window attention (gpt-oss, Gemma 3),
 * recurrent layers (Qwen3-Next's linear attention, Mamba in Jamba,
 * Falcon-H1, Granite-4) -- declares them as layer groups in
 * kvp_manager_config.layer_groups, every group with the same number of
 * layers (pad a group with unused layers where needed). The groups share
 * the one pool and its block size: the engine lays its K/V out in layer
 * slots, slot j a tensor of num_blocks blocks, and block b of slot j
 * belongs to layer j of the group that holds b. So a block id means the
 * same bytes in every slot, and a kvp_block_copy, which copies every slot
 * of src into dst, is right whatever group the block is in.
 *
 * Each sequence has a block table per group, which
 * kvp_manager_describe_groups writes in one call:
 *   - group 0 must be full attention; its table is the one
 *     kvp_manager_describe writes;
 *   - another full-attention group: the same number of blocks, its own;
 *   - a sliding-window group of W tokens: the same number of entries, but
 *     the blocks that no query can read any more are dropped (entry -1)
 *     and go back to the pool. A query at position p reads tokens
 *     [p - W + 1, p] (kvp_paged_prefill_args.window_size W); the next
 *     queries of a sequence of length L are at positions >= L, so
 *     kvp_manager_grow drops, before it allocates, the blocks that end
 *     before token L - W + 1, L its length before the call, and counts
 *     them as free. A prompt keeps all its blocks for the step that
 *     computes it, until its first grow (a chunked prefill keeps a chunk
 *     plus W tokens);
 *   - a recurrent group: one block per sequence, its state (state_bytes
 *     per layer slot, at most block_bytes). kvp_manager_fork gives each
 *     child a new state block and a kvp_block_copy from its parent's.
 * kvp_manager_fork's copies: per child, one per attention group when the
 * parent's last block is partial, and one per recurrent group.
 * kvp_manager_stats counts the blocks of every group (internal_waste: the
 * empty slots of every attention group's last block).
 *
 * Prefix cache (enable_prefix_cache): a cached block of group 0 keeps, in
 * every other attention group, the block holding the same tokens. A
 * prompt hits its longest cached prefix of h blocks for which every
 * window group still holds the blocks that its query at position
 * h * block_size reads (kvp_manager_admit and kvp_manager_match report
 * that hit); the admitted sequence takes them, its window tables starting
 * with the entries before them at -1. Window blocks are evicted on their
 * own: those a sequence's window slid past, with no hit point within the
 * window after them, before any cached block; those at the end of a
 * finished sequence or read by a hit point (the end of an earlier match,
 * a shared system prompt's end), after every cached block, so that a
 * conversation's next turn still hits under pressure. Pins concern group
 * 0's blocks; KV events report every group's ("KV events of layer
 * groups" in the prefix cache's section).
 *
 * A recurrent group's state is cached at checkpoints: where a sequence's
 * step ends at the end of a cached block whose number (counting from 1)
 * is a multiple of checkpoint_every (of every recurrent group's: their
 * common multiple, since a partial state resumes nothing; give the groups
 * one interval), kvp_manager_mark_computed gives the
 * checkpoint a block, if the pool has one to spare, and queues the copy of
 * the sequence's state into it. A prompt then hits only up to its last
 * checkpoint, and the admitted sequence's new state block gets a copy of
 * it, queued too. The engine takes the queue with kvp_manager_take_copies
 * every step, before the forward pass, and performs the copies in order on
 * the step's stream (each one as a kvp_block_copy: every layer slot of src
 * into dst), so that a hit never starts from a state that is not there.
 * No checkpoint is taken before the engine's first take_copies call. An
 * engine that chunks its prefill at multiples of checkpoint_every blocks
 * gets a checkpoint at every chunk's end. A checkpoint exists only where a
 * step ended, so a prompt's hit may stop well short of the blocks group 0
 * caches (a shared system prompt computed in chunks has states at the
 * chunks' ends only): kvp_manager_match_blocks gives both, and an engine
 * that ends the prompt's step at the longer one (rounded down to a
 * multiple of checkpoint_every blocks) leaves a checkpoint there, from
 * which the next prompt with that prefix resumes.
 *
 * The host tier (since 0.7) holds full-attention and sliding-window groups:
 * one host slot per (cached block, group), a slot one block id's layer
 * slots as without groups (a block id belongs to one group). A cached
 * block's companions in the other groups are demoted with it, and a host
 * hit obeys the GPU rule (every full-attention group's blocks, every window
 * group's blocks covering the window before the hit point), reloading only
 * those. With groups, recurrent groups, the shared tier, write_through and
 * demote_evicted answer KVP_ERR_UNSUPPORTED at create; CPU-tier events
 * report group 0's blocks. kvp_manager_cascade_plan plans group 0's tables. */
typedef enum kvp_layer_group_kind {
  KVP_GROUP_FULL_ATTENTION = 0, /* every token's K/V */
  KVP_GROUP_SLIDING_WINDOW = 1, /* the last window tokens' K/V */
  KVP_GROUP_RECURRENT = 2       /* one state per sequence */
} kvp_layer_group_kind;

typedef struct kvp_layer_group {
  int32_t kind;        /* kvp_layer_group_kind */
  int32_t window;      /* sliding window: the tokens a query reads, itself
                          included, in [1, max_model_len - 1] (or
                          [1, 2^30] without max_model_len); 0 otherwise */
  int64_t state_bytes; /* recurrent: one layer's state in bytes, in
                          [1, block_bytes]; 0 otherwise */
  int32_t checkpoint_every; /* recurrent with the prefix cache: keep the
                               state at the end of every cached block whose
                               number is a multiple of this, in [1, 2^20];
                               0 otherwise (see "Prefix cache" above) */
  int32_t reserved;         /* must be 0 */
} kvp_layer_group;

typedef struct kvp_manager_config {
  size_t struct_size;  /* sizeof(kvp_manager_config) */
  int32_t num_blocks;  /* blocks in the pool, in [1, 2^26]; no default (0) */
  int32_t block_size;  /* tokens per block, in [1, 2^16]; 0 = 16; 1 = token mode */
  /* num_blocks * block_size must be below 2^31: slots are int32. */

  int32_t enable_prefix_cache; /* nonzero: cache full blocks of sequences
                                  admitted by their tokens (see "Prefix
                                  cache" below); default 0 */
  int32_t enable_kv_events;    /* nonzero: record KV events for
                                  kvp_manager_drain_events (and, with
                                  layer groups, every group's for
                                  kvp_manager_drain_group_events); needs
                                  enable_prefix_cache; default 0 */
  int32_t max_pending_events;  /* bound on undrained events; 0 = 65536;
                                  raised to num_blocks + host_tier_slots
                                  + 1 */

  /* Host KV tier (see "Host KV tier" below); all 0 = none. */
  int32_t host_tier_slots;     /* blocks the host tier holds, in [0, 2^30];
                                  0 = no host tier; needs
                                  enable_prefix_cache and host_block_bytes */
  int32_t demote_ahead;        /* blocks kvp_manager_flush_copies keeps free
                                  or being demoted, in [0, num_blocks];
                                  0 = nothing is demoted */
  int32_t demote_evicted;      /* nonzero: demote the cached blocks that
                                  allocations evict, in the next
                                  flush_copies batch (see "Host KV tier":
                                  the engine must copy the batch's
                                  demotions on the step's stream before
                                  the step writes any K/V); default 0;
                                  needs a host tier */
  int64_t host_block_bytes;    /* bytes of one block's K/V, all layers, K
                                  and V, as the engine lays it out (its
                                  size in a host slot); >= 1 with a host
                                  tier, 0 without; slots * bytes <= 2^46 */

  /* Shared KV tier (see "Shared KV tier" below); all NULL and 0 = none.
   * The strings are read during kvp_manager_create only (the library
   * keeps copies). */
  const char *shared_tier_addr;      /* "host:port" of a Valkey or Redis
                                        server, at most 1024 bytes; NULL =
                                        no shared tier; needs a host tier */
  const char *shared_tier_namespace; /* the identity of the model and K/V
                                        layout the blocks belong to, 1-64
                                        characters of [A-Za-z0-9_.-];
                                        required with an address */
  int32_t shared_tier_timeout_ms;    /* bound on each round trip to the
                                        server, transfer included, in
                                        [0, 60000]; 0 = 250 */
  int32_t shared_tier_put_queue;     /* demoted blocks waiting to be
                                        stored, in [0, 2^20]; 0 = 256 */

  void *host_tier_memory;            /* the host tier's memory, the
                                        engine's: host_tier_slots *
                                        host_block_bytes bytes, 16-byte
                                        aligned (e.g. cudaHostAlloc'd, which
                                        a tier copier then uses as it is),
                                        valid and unused by anything else
                                        until kvp_manager_destroy, which
                                        does not free it; NULL = the
                                        library allocates it; needs a host
                                        tier */

  /* Shared tier security (see "Shared KV tier", Security); all NULL and 0
   * = none: no AUTH, plaintext, no MAC. No field holds a secret: the
   * password and the MAC keys are read from the environment variable or
   * the file named here (one of the two), at kvp_manager_create (which
   * refuses a variable unset or empty, a file missing or empty) and the
   * password again on every connect. Strings of at most 1024 bytes, read
   * during kvp_manager_create only; each needs shared_tier_addr. */
  const char *shared_tier_username;        /* ACL user sent with AUTH,
                                              without white space; NULL =
                                              the default user (AUTH
                                              password); needs a password */
  const char *shared_tier_password_env;    /* the name of an environment
                                              variable holding the AUTH
                                              password ([A-Za-z_][A-Za-z0-9_]*) */
  const char *shared_tier_password_file;   /* the path of a file holding
                                              it (any bytes; one trailing
                                              newline is dropped) */
  const char *shared_tier_tls_ca_file;     /* PEM file of the CAs the
                                              server's certificate must
                                              chain to; NULL = the system's
                                              roots; needs shared_tier_tls */
  const char *shared_tier_tls_cert_file;   /* PEM client certificate, for
                                              a server that asks for one;
                                              with shared_tier_tls_key_file;
                                              needs shared_tier_tls */
  const char *shared_tier_tls_key_file;    /* its PEM key */
  const char *shared_tier_tls_server_name; /* the name the server's
                                              certificate must be for; NULL
                                              = the host of
                                              shared_tier_addr; needs
                                              shared_tier_tls */
  const char *shared_tier_mac_keys_env;    /* the name of an environment
                                              variable holding the MAC
                                              keys: one or two keys of 16
                                              to 128 bytes in hex digits,
                                              separated by white space or
                                              a comma; the first signs, both
                                              verify; NULL = no MAC */
  const char *shared_tier_mac_keys_file;   /* the path of a file holding
                                              them */
  int32_t shared_tier_tls;                 /* 1: TLS on every connection,
                                              the server's certificate
                                              verified; 0 = plaintext */
  int32_t shared_tier_reserved;            /* must be 0 */

  int32_t write_through;       /* (since 0.3) at most this many computed
                                  blocks each kvp_manager_flush_copies
                                  copies to the host tier while they stay
                                  in the GPU prefix cache ("Host KV tier",
                                  Write-through), in [0, num_blocks];
                                  0 = none; needs a host tier */
  int32_t write_through_slack; /* (since 0.7; was host_tier_reserved,
                                  which had to be 0) while the GPU pool
                                  has more than this many free blocks,
                                  flush_copies hands out no write-through
                                  store: the computed blocks wait in the
                                  queue until the free blocks fall to it
                                  ("Host KV tier", Write-through). In
                                  [0, num_blocks]; nonzero needs
                                  write_through > 0 and at least
                                  demote_ahead (demotion ahead keeps the
                                  free blocks above a smaller slack, so
                                  few stores would go out); at least a
                                  few steps' allocations; 0 = store
                                  every flush */

  /* Layer groups (since 0.6; see "Layer groups" above); all 0 = one
   * full-attention group. Read during kvp_manager_create only. */
  const kvp_layer_group *layer_groups; /* num_layer_groups groups, group 0
                                          full attention; NULL = none */
  int32_t num_layer_groups;  /* in [0, KVP_MAX_LAYER_GROUPS]; 0 with NULL */
  int32_t max_model_len;     /* the model's context limit in tokens, in
                                [0, 2^30]; 0 = not given; a window must be
                                below it */
  int64_t block_bytes;       /* bytes of one block in one layer slot, in
                                [0, 2^46]; needed with a recurrent group */
} kvp_manager_config;

#define KVP_MANAGER_CONFIG_INIT KVP_STRUCT_INIT(kvp_manager_config)

/* A KV block copy the engine must perform: copy block src's rows to block dst
 * (all layers, K and V) before the next kernel reads dst. */
typedef struct kvp_block_copy {
  int32_t src;
  int32_t dst;
} kvp_block_copy;

/* Pool and fragmentation statistics at the time of the call. */
typedef struct kvp_manager_stats {
  size_t struct_size;          /* set by the caller: sizeof(kvp_manager_stats) */
  int32_t num_blocks;          /* pool size */
  int32_t block_size;          /* tokens per block */
  int32_t free_blocks;         /* in the free queue */
  int32_t used_blocks;         /* referenced by at least one sequence */
  int32_t peak_used_blocks;    /* highest used_blocks since creation */
  int32_t cached_blocks;       /* unreferenced blocks kept by the prefix cache */
  int32_t shared_blocks;       /* referenced by more than one sequence */
  int32_t num_seqs;            /* live sequences */
  int64_t num_tokens;          /* tokens over all live sequences */
  int64_t allocated_slots;     /* used_blocks * block_size */
  int64_t internal_waste;      /* empty slots in partially filled last blocks */
  double fragmentation;        /* internal_waste / allocated_slots (0 when none) */
} kvp_manager_stats;

#define KVP_MANAGER_STATS_INIT KVP_STRUCT_INIT(kvp_manager_stats)

#ifndef KVPLUG_NO_PROTOTYPES

/* Creates a manager (with a host tier when host_tier_slots > 0, whose
 * memory it allocates, and a shared tier below it when shared_tier_addr
 * is set: it does not connect, so a server that is down makes the first
 * lookups misses, not an error). Errors: NULL_POINTER (cfg or out),
 * STRUCT_SIZE, INVALID_ARGUMENT (num_blocks or block_size out of range; a
 * host tier without the prefix cache or host_block_bytes,
 * host_tier_slots, demote_ahead or host_block_bytes out of range,
 * reserved not 0; a shared tier without a host tier, an address empty
 * or longer than 1024 bytes, a namespace missing or not as stated,
 * shared_tier_timeout_ms or shared_tier_put_queue out of range, or
 * namespace, timeout or queue set without an address; a security field
 * set without an address, a username without a password, a password or
 * MAC keys in both an environment variable and a file, a variable unset
 * or empty, a file missing, unreadable or empty, MAC keys not as stated,
 * shared_tier_tls not 0 or 1, a TLS field set without it, a certificate
 * without its key, a CA or certificate file that does not load,
 * shared_tier_reserved not 0: no message holds a secret), OUT_OF_MEMORY
 * (the host tier's memory). */
kvp_status kvp_manager_create(const kvp_manager_config *cfg, kvp_manager **out);

/* Destroys a manager and every sequence in it, and frees its host tier's
 * memory (no copy to or from it may be in flight). With a shared tier it
 * first writes the blocks still queued for it (each round trip bounded
 * by shared_tier_timeout_ms; a server that is down skips them at once)
 * and closes the connection. NULL is a no-op. The caller must ensure no
 * other thread is using the handle. */
void kvp_manager_destroy(kvp_manager *m);

/* Adds sequence seq_id with a prompt of prompt_len tokens and allocates its
 * ceil(prompt_len / block_size) blocks. The prompt's tokens are this step's
 * new tokens of the sequence (see kvp_manager_describe).
 * Errors: INVALID_ARGUMENT (prompt_len < 1 or > 2^30, or more blocks than the
 * whole pool has: it could never be added, so it is not OUT_OF_BLOCKS, which
 * a scheduler retries), DUPLICATE_SEQUENCE, OUT_OF_BLOCKS (not now). */
kvp_status kvp_manager_add(kvp_manager *m, int64_t seq_id, int32_t prompt_len);

/* Grows each sequence seq_ids[i] by num_tokens[i] tokens (>= 0), allocating
 * blocks as needed. All or none: if the batch as a whole needs more blocks
 * than are free, KVP_ERR_OUT_OF_BLOCKS is returned (the message says how many
 * were needed and free) and no sequence grows; the scheduler then preempts
 * and retries. The tokens added by this call become each sequence's new
 * tokens (num_tokens[i] = 0 makes it none).
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n < 1 or > 2^20, a count < 0 or
 * > 2^24), UNKNOWN_SEQUENCE, DUPLICATE_SEQUENCE (an id twice in the batch),
 * OUT_OF_BLOCKS. */
kvp_status kvp_manager_grow(kvp_manager *m, const int64_t *seq_ids,
                            const int32_t *num_tokens, int32_t n);

/* Forks parent into n children (parallel sampling, beam search). Each child
 * shares the parent's full blocks. If the parent's last block is partially
 * filled, each child gets a new block for it (copy-on-write done eagerly, as
 * every child writes its next token there) and one kvp_block_copy per child is
 * written to copies[]; *num_copies receives how many (0 or n). Children have
 * the parent's length and no new tokens.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n < 1 or > 2^20), UNKNOWN_SEQUENCE
 * (parent), DUPLICATE_SEQUENCE (a child live already or repeated),
 * BUFFER_TOO_SMALL (max_copies < n while a copy is needed), OUT_OF_BLOCKS. */
kvp_status kvp_manager_fork(kvp_manager *m, int64_t parent,
                            const int64_t *children, int32_t n,
                            kvp_block_copy *copies, int32_t max_copies,
                            int32_t *num_copies);

/* Removes n sequences and releases their blocks. All or none: an unknown id
 * (including one removed before: a double remove) or an id repeated in the
 * batch fails the call and removes nothing.
 * With the prefix cache, the blocks the sequences filled since the last
 * kvp_manager_mark_computed leave the cache ("Computed K/V" in the prefix
 * cache section); if a live sequence outside the batch shares one of them,
 * the call fails with IN_USE and its message names that sequence.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n < 1 or > 2^20), UNKNOWN_SEQUENCE,
 * DUPLICATE_SEQUENCE, IN_USE. */
kvp_status kvp_manager_remove(kvp_manager *m, const int64_t *seq_ids, int32_t n);

/* Records that the K/V of every new token described so far is computed: the
 * step's forward pass has run, or is enqueued on the stream that every later
 * reader of the cache (attention, tier copies) follows. Blocks filled so far
 * become computed, so removing their sequences keeps them cached ("Computed
 * K/V" in the prefix cache section). Call once per step, after launching the
 * forward pass and before removing finished sequences. O(1); a no-op without
 * the prefix cache. If a step fails after this call, its blocks hold no valid
 * K/V: remove every sequence and kvp_manager_clear_prefix_cache.
 * Errors: INVALID_HANDLE. */
kvp_status kvp_manager_mark_computed(kvp_manager *m);

/* Describes a batch of n sequences into caller buffers, in batch order. Any
 * of the three outputs may be NULL to skip it.
 *   block_table  [n][max_blocks] int32, row i = seq_ids[i]'s block ids in
 *                order, padded with -1. Read only the first
 *                ceil(seq_lens[i] / block_size) entries of a row.
 *   seq_lens     [n] int32, each sequence's length in tokens.
 *   slot_mapping the slot of every new token of each sequence (the tokens of
 *                its latest add or grow), sequences in batch order, tokens in
 *                position order; at most slot_capacity entries.
 * *num_slots (required) receives the number of slot_mapping entries (it is
 * computed even when slot_mapping is NULL, so a caller can size its buffer).
 * Describe changes nothing: calling it twice gives the same answer.
 * Errors: NULL_POINTER (seq_ids, num_slots), INVALID_ARGUMENT (n < 1 or
 * > 2^20, max_blocks < 1 while block_table is given, slot_capacity < 0),
 * UNKNOWN_SEQUENCE, BUFFER_TOO_SMALL (a sequence has more than max_blocks
 * blocks, or more than slot_capacity new tokens in all; nothing written). */
kvp_status kvp_manager_describe(kvp_manager *m, const int64_t *seq_ids, int32_t n,
                                int32_t *block_table, int32_t max_blocks,
                                int32_t *seq_lens, int32_t *slot_mapping,
                                int32_t slot_capacity, int32_t *num_slots);

/* Fills *out with the manager's statistics at the time of the call.
 * Errors: NULL_POINTER, STRUCT_SIZE (out->struct_size smaller than
 * sizeof(size_t) + 4, so that not even num_blocks fits). */
kvp_status kvp_manager_stats_get(kvp_manager *m, kvp_manager_stats *out);

/* Checks the manager's internal invariants (free list, reference counts,
 * block tables); for tests and debugging. O(num_blocks + tokens).
 * Errors: INTERNAL with a description of the first broken invariant. */
kvp_status kvp_manager_check(kvp_manager *m);

/* kvp_manager_describe for every layer group at once (since 0.6; see
 * "Layer groups"). num_groups must be the manager's group count (1
 * without groups). block_tables and slot_mappings are NULL or arrays of
 * num_groups pointers, each NULL (not wanted) or a buffer with
 * kvp_manager_describe's layout and size (every table [n, max_blocks],
 * every slot mapping slot_capacity entries); entry g is group g's, entry 0
 * what kvp_manager_describe writes. A sliding-window group's rows hold -1
 * where blocks were dropped; a recurrent group's row is its state block,
 * padded with -1, and it has no slot mapping (its entry is not written).
 * *num_slots: the batch's new tokens, the length of every attention
 * group's slot mapping. Errors: kvp_manager_describe's, and
 * INVALID_ARGUMENT when num_groups is not the manager's. */
kvp_status kvp_manager_describe_groups(kvp_manager *m, const int64_t *seq_ids, int32_t n,
                                       int32_t num_groups, int32_t *const *block_tables,
                                       int32_t max_blocks, int32_t *seq_lens,
                                       int32_t *const *slot_mappings, int32_t slot_capacity,
                                       int32_t *num_slots);

/* Writes the blocks each layer group holds now to out[0 .. groups) (a
 * block forked sequences share counts once) and the manager's group
 * count to *num_groups (1 without groups), which capacity must reach.
 * O(num_blocks + blocks held). Errors: NULL_POINTER (num_groups; out with
 * capacity > 0), INVALID_ARGUMENT (capacity < 0), BUFFER_TOO_SMALL
 * (capacity below the group count; *num_groups still written). */
kvp_status kvp_manager_group_blocks(kvp_manager *m, int32_t *out, int32_t capacity,
                                    int32_t *num_groups);

/* Moves the oldest queued block copies into out[0 .. capacity) (since 0.6;
 * see "Layer groups", Prefix cache): *num_copies receives how many it moved,
 * *num_left (if not NULL) how many wait still. The engine performs them in
 * order, each copying every layer slot of block src into block dst, on the
 * stream of the next forward pass and before it; call it every step after
 * the scheduler's calls until nothing is left. A queued copy holds its two
 * blocks (no eviction, removal or clear frees them) until this call hands
 * it out, so take the copies after the step's last admit, grow or remove
 * and perform them before the next. Only a manager with a
 * recurrent group in the prefix cache queues copies; the first call also
 * tells it that the engine performs them. Errors: NULL_POINTER
 * (num_copies; out with capacity > 0), INVALID_ARGUMENT (capacity < 0). */
kvp_status kvp_manager_take_copies(kvp_manager *m, kvp_block_copy *out, int32_t capacity,
                                   int32_t *num_copies, int32_t *num_left);

#endif /* KVPLUG_NO_PROTOTYPES */

/* ==== section: prefix cache (begin) ==== */
/*
 * Prefix cache (a manager created with enable_prefix_cache). The full
 * blocks of sequences admitted by their tokens are cached under a chained
 * 128-bit hash of (parent block's hash, the block's tokens, the prompt's
 * extra keys) and arranged in a prefix tree (core/prefix/HASH.md has the
 * exact algorithm and byte layout; core/prefix/testdata/hash_vectors.json
 * has test vectors). A later prompt with the same prefix starts on those
 * blocks instead of computing them, and they stay cached after their
 * sequences finish, until an allocation needs them.
 *
 * Flow per step:
 *   kvp_manager_admit        new requests: matches their longest cached
 *                            prefix, allocates the rest, reports the
 *                            matched tokens; only the rest are new tokens
 *                            (their slots come from kvp_manager_describe).
 *   kvp_manager_grow_tokens  running requests, with the tokens themselves,
 *                            so that blocks they fill are cached.
 *   (the forward pass)
 *   kvp_manager_mark_computed  once the step's forward pass is launched.
 *   kvp_manager_remove       finished requests: their cached blocks stay,
 *                            evictable.
 * kvp_manager_add and kvp_manager_grow keep working; their tokens are not
 * known, so the blocks they fill stay private to the sequence.
 *
 * Computed K/V (the contract; since 0.3). A block is cached as soon as the
 * call that fills it (admit, grow_tokens) returns, before the engine
 * computes its K/V, and stays uncomputed until the engine calls
 * kvp_manager_mark_computed: call it once per step, after launching the
 * step's forward pass (the K/V writes enqueued on the stream every later
 * reader of the cache follows) and before removing the step's finished
 * sequences. A sequence removed while blocks it filled are uncomputed
 * (preempted, aborted, a step abandoned) takes them out of the cache: no
 * later prompt matches them, no tier demotes or stores them. A sequence
 * admitted later in the same step may start on uncomputed blocks (correct
 * when the step's forward pass writes every new token's K/V of a layer
 * before that layer's attention reads the cache, as paged engines do; an
 * engine that runs a step's sequences in separate forward passes must run
 * them in admission order); the filler's removal then fails with
 * KVP_ERR_IN_USE, naming the sharer, unless both go in one remove batch
 * (or the filler goes after mark_computed). Preempting the most recently
 * admitted sequence first never meets it. Blocks reloaded from the host
 * tier count as computed at admission. An engine that never calls
 * mark_computed keeps correct results but caches nothing across requests.
 * Chunked prefill: kvp_manager_match the whole prompt (m tokens cached),
 * admit its first m + chunk tokens, then grow_tokens one chunk per step.
 * Pass the whole prompt's keys to admit, multimodal items past the first
 * chunk included: the keys belong to the sequence, and every block it
 * fills is hashed with the items that overlap it, wherever the chunks end
 * (items not known at admission can follow with kvp_manager_add_mm_items
 * before their tokens).
 *
 * Eviction: every allocation (add, admit, grow, grow_tokens, fork) that
 * finds too few free blocks evicts cached blocks no sequence holds: lowest
 * priority first, then least recently used, ties to the deepest block
 * (the end of the longest prefix); only leaves of the tree go, so a prefix
 * is never cut in the middle. O(log n) per block. When free plus evictable
 * blocks are too few, the call fails (OUT_OF_BLOCKS) with nothing evicted.
 * Pins keep a prefix cached whatever the pressure.
 *
 * Identity: the same tokens under a different adapter, multimodal content
 * or salt are a different prefix. A tenant salt enters the first block's
 * hash, so prompts with different salts never share a block.
 */

/* A multimodal input of a prompt (an image, an audio clip): its
 * placeholder tokens occupy prompt positions [offset, offset + length), and
 * hash is the caller's 16-byte digest of its content (e.g. of the image
 * bytes and processor settings). */
typedef struct kvp_mm_item {
  int32_t offset;
  int32_t length;
  uint8_t hash[16];
} kvp_mm_item;

/* A prompt's extra keys. Passed in arrays, one per prompt, so it has no
 * struct_size: it will not grow (new keys would come with new functions).
 * They describe the whole prompt: a call given a prefix of its tokens (a
 * chunk) takes the same keys, and an item may extend past the tokens
 * given or lie wholly beyond them (a full block's hash depends only on
 * the items that overlap it, so the prefix's blocks hash as the whole
 * prompt's do). */
typedef struct kvp_prefix_keys {
  uint64_t adapter;        /* LoRA adapter id; 0 = none */
  const kvp_mm_item *mm;   /* num_mm items, offsets >= 0 and strictly
                              increasing, lengths >= 1, each ending by
                              2^31-1; NULL when num_mm 0 */
  int32_t num_mm;          /* in [0, 2^20] */
  int32_t salt_len;        /* bytes of salt, in [0, 1024]; 0 = no salt */
  const uint8_t *salt;     /* tenant salt; NULL when salt_len 0 */
} kvp_prefix_keys;

#define KVP_PREFIX_KEYS_INIT {0, NULL, 0, 0, NULL}

/* What kvp_manager_match found for one prompt. */
typedef struct kvp_prefix_match {
  int32_t matched_tokens;  /* longest cached prefix in full blocks; never
                              the whole prompt (its last token is always
                              computed) */
  int32_t partial_block;   /* with want_partial: a cached block whose first
                              partial_tokens rows hold the KV of the
                              prompt's next partial_tokens tokens, for a
                              caller that copies rows; -1 when none */
  int32_t partial_tokens;
} kvp_prefix_match;

/* What kvp_manager_match_blocks found for one prompt (since 0.7). */
typedef struct kvp_block_match {
  int32_t matched_tokens;  /* the hit admit would take: kvp_prefix_match's */
  int32_t block_tokens;    /* group 0's longest cached prefix in full
                              blocks (never the whole prompt), at least
                              matched_tokens; longer where a recurrent
                              group has no checkpoint at its end (or a
                              window group lacks a block the next query
                              reads). Equal without layer groups. */
} kvp_block_match;

/* Prefix cache counters (since creation or the last reset) and sizes. */
typedef struct kvp_prefix_stats {
  size_t struct_size;      /* set by the caller: sizeof(kvp_prefix_stats) */
  int64_t queries;         /* prompts matched (admit and match) */
  int64_t query_tokens;    /* their tokens */
  int64_t hit_tokens;      /* of those, matched in cached full blocks */
  int64_t partial_tokens;  /* tokens of partial matches (match) */
  int64_t inserts;         /* blocks cached */
  int64_t dedups;          /* filled blocks found cached already (kept private) */
  int64_t evictions;       /* blocks evicted */
  int64_t events_dropped;  /* KV events lost to a full queue (a resync follows) */
  int32_t cached_blocks;   /* blocks in the cache, held or not */
  int32_t locked_blocks;   /* held by a live sequence */
  int32_t pinned_blocks;   /* covered by a pin */
  int32_t evictable_blocks;/* that an allocation could evict now */
  int32_t pending_events;  /* undrained KV events */
  int32_t uncomputed_blocks; /* cached blocks filled since the last
                              kvp_manager_mark_computed (since 0.3) */
  int64_t dropped_uncomputed; /* uncomputed blocks removals took out of the
                              cache (since 0.3) */
} kvp_prefix_stats;

#define KVP_PREFIX_STATS_INIT KVP_STRUCT_INIT(kvp_prefix_stats)

/* KV event kinds: the fields of vLLM's KV events, for a router that tracks
 * which engine caches which prefix. */
enum {
  KVP_KV_EVENT_BLOCK_STORED = 1,   /* a block entered the cache */
  KVP_KV_EVENT_BLOCKS_REMOVED = 2, /* blocks left it (GPU: children before
                                      parents) */
  KVP_KV_EVENT_ALL_CLEARED = 3     /* forget every block of every medium: the
                                      cache was cleared, or a snapshot of
                                      BLOCK_STORED events follows (after a
                                      full queue); the host tier's blocks
                                      follow it either way */
};

/* Where the blocks of a BLOCK_STORED or BLOCKS_REMOVED event are held
 * (kvp_kv_event.medium; vLLM's "medium", sent as the name given here). */
enum {
  KVP_MEDIUM_GPU = 0,    /* "GPU": the prefix cache's own blocks */
  KVP_MEDIUM_CPU = 1,    /* "CPU": the host tier's (see "Host KV tier") */
  KVP_MEDIUM_SHARED = 2  /* "SHARED": a tier shared by instances (reserved) */
};

/* A multimodal entry of a stored block: offset is the item's first
 * position relative to the block's first (negative when the item began in
 * an earlier block). */
typedef struct kvp_block_mm {
  int32_t offset;
  uint8_t hash[16];
} kvp_block_mm;

/* One KV event. Its variable parts live in the caller's arrays passed to
 * kvp_manager_drain_events, at the offsets given here. The salt is not
 * reported (it may be a secret): a router sees a first block's salted hash.
 * A host tier block's BLOCK_STORED (medium CPU) has the fields its GPU
 * BLOCK_STORED had: the same hash, its chain's parent, tokens and keys. */
typedef struct kvp_kv_event {
  int32_t kind;            /* KVP_KV_EVENT_... */
  int32_t block_size;      /* BLOCK_STORED: the block's tokens */
  uint64_t adapter;        /* BLOCK_STORED */
  uint8_t hash[16];        /* BLOCK_STORED: the block's hash */
  uint8_t parent[16];      /* BLOCK_STORED: its parent's; zero for a first block */
  int32_t tokens_offset;   /* BLOCK_STORED: tokens[tokens_offset ..+ block_size] */
  int32_t mm_offset;       /* BLOCK_STORED: mm[mm_offset ..+ num_mm] */
  int32_t num_mm;
  int32_t hashes_offset;   /* BLOCKS_REMOVED: hashes[hashes_offset ..+ num_hashes] */
  int32_t num_hashes;
  int32_t medium;          /* BLOCK_STORED, BLOCKS_REMOVED: KVP_MEDIUM_...
                              (this was a reserved field, always 0: the
                              GPU, which it still is without a host tier) */
} kvp_kv_event;

/* KV events of layer groups (since 0.6). A manager with layer groups and
 * enable_kv_events records, besides group 0's events (the prefix cache's
 * blocks, as above), the events of the blocks every other group keeps
 * with them: a cached block's companion in another attention group (the
 * block holding the same tokens) and a recurrent group's checkpoint (the
 * state after them). Such a block's BLOCK_STORED carries its group-0
 * block's hash, parent, tokens and keys, with its group's index; its
 * BLOCKS_REMOVED names that hash, and comes when the block goes, with its
 * group-0 block or alone: a window group's blocks and checkpoints are
 * evicted on their own. A full-attention group's blocks come and go with
 * group 0's. A group's blocks form a set, not a chain: a window group may
 * keep a block and not its parent's. ALL_CLEARED and snapshots cover
 * every group (a snapshot lists group 0's blocks, then each group's).
 *
 * A router that keeps every group's set from the events knows a prompt's
 * hit exactly, as kvp_manager_admit and kvp_manager_match give it: h
 * blocks, the largest h, at most the number of the prompt's full blocks
 * group 0 holds in a row (never the block of its last token), for which
 * every window group of W tokens holds the prompt's blocks
 * max(0, h * block_size - W + 1) / block_size .. h - 1 and every
 * recurrent group holds block h - 1 (h = 0 needs nothing). Group 0's
 * events alone overestimate the hits of a hybrid model.
 *
 * kvp_manager_drain_group_events returns every group's events in order,
 * each in a kvp_kv_group_event. kvp_manager_drain_events returns group
 * 0's and passes over the others, which are then gone: its kvp_kv_event
 * has no group, and another group's event read as group 0's would store a
 * block twice or remove one still cached. A consumer uses one of the two
 * drains, with its own next-size call; without layer groups they give the
 * same events. pending_events counts every group's. */
typedef struct kvp_kv_group_event {
  kvp_kv_event event; /* the event, as kvp_manager_drain_events fills it,
                         its offsets into the drain's arrays */
  int32_t group;      /* BLOCK_STORED, BLOCKS_REMOVED: its blocks' layer
                         group (vLLM's group_idx), 0 without groups; 0 for
                         ALL_CLEARED, which concerns every group */
  int32_t reserved;   /* 0 */
} kvp_kv_group_event;

#ifndef KVPLUG_NO_PROTOTYPES

/* Admits n new sequences by their prompts, in batch order. Prompt i's
 * tokens are tokens[token_offsets[i] .. token_offsets[i+1]) (token_offsets
 * has n + 1 entries, non-decreasing), its extra keys keys[i] (keys may be
 * NULL: none for all). Sequence seq_ids[i] starts on the cached blocks of
 * the prompt's longest cached prefix in full blocks (never its last token)
 * and matched_tokens[i] (if not NULL) receives their count; the rest of the
 * prompt is its new tokens. Its full blocks are cached at once, so later
 * prompts of the same batch share them; they stay uncomputed until
 * kvp_manager_mark_computed ("Computed K/V" in the prefix cache section). Without the prefix cache nothing
 * matches: admit is then add with the tokens ignored. With a host tier the
 * match goes on there, and with a shared tier below it, on the server
 * (see "Host KV tier" and "Shared KV tier": blocks reloaded, counted in
 * matched_tokens).
 *
 * The keys are the sequence's for its whole life: the blocks that later
 * grow_tokens calls fill are hashed with them. Under chunked prefill the
 * tokens are the first chunk and keys[i] the whole prompt's (items may
 * extend past the chunk).
 *
 * Admission stops at the first prompt that does not fit (free plus
 * evictable blocks, after its match, are fewer than it needs): *num_admitted
 * receives how many were admitted, always a prefix of the batch, and the
 * call returns KVP_OK. Running out of blocks is not an error here; prompts
 * [*num_admitted, n) are untouched, for the scheduler to retry later. A
 * prompt that needs more blocks than the whole pool has could never be
 * admitted: that is INVALID_ARGUMENT, naming it, with nothing admitted.
 * Errors, detected before anything changes: NULL_POINTER (seq_ids, tokens
 * with a non-empty batch, token_offsets, num_admitted), INVALID_ARGUMENT
 * (n < 1 or > 2^20, a prompt of 0 or more than 2^30 tokens or more blocks
 * than the pool, offsets, keys), DUPLICATE_SEQUENCE (an id live or
 * repeated). One exception to "before anything changes": with a shared
 * tier, the ids are checked before its read and again after it (the read
 * runs without the manager's lock), and an id that another thread made
 * live meanwhile fails the call with DUPLICATE_SEQUENCE after the blocks
 * read are in the host tier: they stay there, cached K/V that the next
 * match finds, and no sequence, block table or GPU block changed. */
kvp_status kvp_manager_admit(kvp_manager *m, const int64_t *seq_ids, int32_t n,
                             const int32_t *tokens, const int64_t *token_offsets,
                             const kvp_prefix_keys *keys, int32_t *matched_tokens,
                             int32_t *num_admitted);

/* kvp_manager_grow with the new tokens themselves: tokens holds
 * num_tokens[0] tokens of seq_ids[0], then num_tokens[1] of seq_ids[1], and
 * so on. Blocks these tokens fill are cached (for sequences admitted by
 * their tokens; a sequence added or grown without tokens since just grows).
 * All or none, with the errors of kvp_manager_grow; tokens may be NULL only
 * when every count is 0. */
kvp_status kvp_manager_grow_tokens(kvp_manager *m, const int64_t *seq_ids,
                                   const int32_t *num_tokens, int32_t n,
                                   const int32_t *tokens);

/* Appends num_items multimodal items to live sequence seq_id's keys, for
 * tokens still to come that its admission did not name (a later turn with
 * an image, a chunk whose items were not known yet). Every block the
 * sequence fills afterwards is hashed with the items that overlap it.
 * Items follow the rules of kvp_prefix_keys, start after the sequence's
 * last item, and must not overlap a block the sequence has filled: the
 * first item's offset must be at least the start of its partial last
 * block (its length, when that is a block boundary), since the full blocks
 * are cached without it. Sequences forked from seq_id earlier keep their
 * keys. For a sequence whose tokens are not known (kvp_manager_add, or a
 * kvp_manager_grow since), or without the prefix cache, the items are
 * checked and dropped. num_items 0 is a no-op.
 * Errors, with nothing changed: NULL_POINTER (items with num_items > 0),
 * INVALID_ARGUMENT (num_items < 0 or > 2^20, an item, its order or place),
 * UNKNOWN_SEQUENCE. */
kvp_status kvp_manager_add_mm_items(kvp_manager *m, int64_t seq_id,
                                    const kvp_mm_item *items, int32_t num_items);

/* Finds each of n prompts' longest cached prefix (as admit would) without
 * admitting anything, and fills out[i]; with want_partial nonzero also the
 * partial block (none with layer groups: a block holds group 0's rows, not
 * the other groups' K/V or states). A router's or scheduler's query. The matched blocks count
 * as used now for eviction; the queries are counted in the stats. Without
 * the prefix cache every prompt matches 0. Prompts are given as in admit;
 * an empty prompt is allowed here and matches 0.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n, offsets, keys). */
kvp_status kvp_manager_match(kvp_manager *m, int32_t n, const int32_t *tokens,
                             const int64_t *token_offsets,
                             const kvp_prefix_keys *keys, int32_t want_partial,
                             kvp_prefix_match *out);

/* kvp_manager_match without the partial block, with each prompt's block
 * match beside its hit (kvp_block_match): for an engine serving recurrent
 * layer groups, which ends a prompt's step at block_tokens (rounded down
 * to a checkpoint boundary) when that lies past matched_tokens, so that a
 * checkpoint is taken where the cached prefix ends ("Layer groups"). Counts
 * its queries and touches the hit's blocks as kvp_manager_match does; the
 * GPU prefix cache only. Since 0.7.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n, offsets, keys). */
kvp_status kvp_manager_match_blocks(kvp_manager *m, int32_t n, const int32_t *tokens,
                                    const int64_t *token_offsets,
                                    const kvp_prefix_keys *keys, kvp_block_match *out);

/* Pins the cached full blocks of a prefix (all of them, the last included)
 * so they are never evicted, until kvp_manager_unpin(*pin_id). Blocks of the
 * prefix cached later are not covered: pin again. *num_blocks (may be NULL)
 * receives the number pinned. keys may be NULL.
 * Errors: NULL_POINTER (tokens with num_tokens > 0, pin_id),
 * INVALID_ARGUMENT (prefix cache off, num_tokens < 0 or > 2^30, keys),
 * NOT_FOUND (no block of the prefix is cached), UNSUPPORTED (a manager with
 * layer groups: their window blocks and states would not be kept, and the
 * pinned prefix would stop hitting). */
kvp_status kvp_manager_pin(kvp_manager *m, const int32_t *tokens, int32_t num_tokens,
                           const kvp_prefix_keys *keys, uint64_t *pin_id,
                           int32_t *num_blocks);

/* Releases one pin. Its blocks stay cached, evictable once nothing holds
 * them. Errors: INVALID_ARGUMENT (prefix cache off), NOT_FOUND (unknown
 * id, unpinned already, or dropped by kvp_manager_clear_prefix_cache). */
kvp_status kvp_manager_unpin(kvp_manager *m, uint64_t pin_id);

/* Sets the eviction priority of the cached full blocks of a prefix: lower
 * priorities are evicted first; blocks start at 0 (blocks cached later
 * under the prefix start at 0 too). *num_blocks (may be NULL) receives how
 * many were set. Errors: as kvp_manager_pin. */
kvp_status kvp_manager_set_priority(kvp_manager *m, const int32_t *tokens,
                                    int32_t num_tokens, const kvp_prefix_keys *keys,
                                    int32_t priority, int32_t *num_blocks);

/* Fills *out with the prefix cache's statistics (all zero when the cache
 * is off). Errors: NULL_POINTER, STRUCT_SIZE (out->struct_size below
 * sizeof(size_t) + 8). */
kvp_status kvp_manager_prefix_stats(kvp_manager *m, kvp_prefix_stats *out);

/* Zeroes the prefix cache's counters (not its sizes). */
kvp_status kvp_manager_prefix_stats_reset(kvp_manager *m);

/* Evicts every cached block no sequence holds and drops every pin, for a
 * model or adapter reload, and records an ALL_CLEARED event. *num_freed (may
 * be NULL) receives the number of blocks freed. Refused with
 * INVALID_ARGUMENT, changing nothing, while live sequences hold cached
 * blocks: remove them first. A no-op without the prefix cache. */
kvp_status kvp_manager_clear_prefix_cache(kvp_manager *m, int32_t *num_freed);

/* Drains the oldest pending KV events, in order (with layer groups, group
 * 0's: see "KV events of layer groups" above): as many whole events as
 * fit events[max_events], tokens[max_tokens] (a stored block's tokens),
 * mm[max_mm] (a stored block's multimodal entries) and hashes[max_hashes]
 * (16 bytes each; removed blocks' hashes); a BLOCKS_REMOVED event with more
 * hashes than fit is split across calls. *num_events receives the count;
 * 0 means none pending. Call until it returns 0 to drain everything. If
 * more than max_pending_events pile up undrained, they are replaced by
 * ALL_CLEARED and a snapshot of the cache (stats.events_dropped counts
 * them), so a consumer that applies the events in order always ends with
 * the cache's set of blocks. mm and hashes may be NULL with max 0.
 * A stored block's multimodal entries are as many as the items that
 * overlap it, without a fixed bound: a caller with fixed buffers handles
 * BUFFER_TOO_SMALL by asking kvp_manager_next_event_size and growing.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (KV events off, max_events < 1,
 * another max < 0), BUFFER_TOO_SMALL (not even the oldest event fits;
 * nothing drained; the message names the buffer and the room needed). */
kvp_status kvp_manager_drain_events(kvp_manager *m, kvp_kv_event *events,
                                    int32_t max_events, int32_t *tokens,
                                    int32_t max_tokens, kvp_block_mm *mm,
                                    int32_t max_mm, uint8_t *hashes,
                                    int32_t max_hashes, int32_t *num_events);

/* The room the oldest pending KV event needs in kvp_manager_drain_events'
 * buffers: *tokens and *mm for a BLOCK_STORED (its block's tokens and
 * multimodal entries), *hashes 1 for a BLOCKS_REMOVED (a longer one is
 * split across calls); all 0 for ALL_CLEARED or when none is pending.
 * Buffers at least this large always drain one event. Outputs may be NULL.
 * Errors: INVALID_ARGUMENT (KV events off). */
kvp_status kvp_manager_next_event_size(kvp_manager *m, int32_t *tokens, int32_t *mm,
                                       int32_t *hashes);

/* kvp_manager_drain_events for every layer group's events (since 0.6; see
 * "KV events of layer groups" above): the same arrays, limits and rules,
 * events[i].event as kvp_manager_drain_events writes it and
 * events[i].group its group. Without layer groups it returns what
 * kvp_manager_drain_events would, every group 0. BUFFER_TOO_SMALL is
 * answered with kvp_manager_next_group_event_size.
 * Errors: those of kvp_manager_drain_events. */
kvp_status kvp_manager_drain_group_events(kvp_manager *m, kvp_kv_group_event *events,
                                          int32_t max_events, int32_t *tokens,
                                          int32_t max_tokens, kvp_block_mm *mm,
                                          int32_t max_mm, uint8_t *hashes,
                                          int32_t max_hashes, int32_t *num_events);

/* kvp_manager_next_event_size for kvp_manager_drain_group_events (since
 * 0.6): the room the oldest pending event of any group needs.
 * kvp_manager_next_event_size answers for group 0's oldest, the one
 * kvp_manager_drain_events returns next. Errors: INVALID_ARGUMENT (KV
 * events off). */
kvp_status kvp_manager_next_group_event_size(kvp_manager *m, int32_t *tokens, int32_t *mm,
                                             int32_t *hashes);

#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: prefix cache (end) ==== */

/* ==== section: host KV tier (begin) ==== */
/*
 * Host KV tier (a manager created with host_tier_slots > 0 and the prefix
 * cache). Cached blocks the GPU pool evicts ahead of need are demoted into
 * host memory instead of dropped, and a prompt whose prefix continues in
 * the host tier is admitted with those blocks reloaded into GPU blocks
 * (kvp_manager_admit counts them in matched_tokens: not computed).
 *
 * Memory: host_tier_slots slots of host_block_bytes each, one region
 * (kvp_manager_host_tier_memory): the library allocates it, or the engine
 * hands its own in (kvp_manager_config.host_tier_memory, e.g. memory it
 * allocated pinned). A tier copier
 * (kvp_tier_copier_create, next section) page-locks it and maps it for the
 * device, and copies each step's batch (demotions first); an engine that
 * copies by other means may cudaHostRegister the region itself. Either
 * registration must be undone (kvp_tier_copier_destroy, or the engine's
 * cudaHostUnregister) before kvp_manager_destroy frees the region.
 *
 * The engine drives the copies (it knows its K/V layout). Per step, after
 * the step's admissions and before its forward pass:
 *   kvp_manager_flush_copies     demotes least recently used cached blocks
 *                                until free plus being-demoted blocks reach
 *                                demote_ahead, and returns the step's copy
 *                                batch: demotions (GPU block -> host slot)
 *                                and the reloads admissions queued (host
 *                                slot -> GPU block), with a ticket.
 *   (engine)                     copies every layer's K and V of each op,
 *                                the reloads ordered before the step's
 *                                attention (same stream, or an event).
 *   kvp_manager_complete_copies  once the copies have finished (or failed),
 *                                from any thread: demoted blocks' host
 *                                slots become matchable and their GPU
 *                                blocks free; reloads' slots are unpinned.
 * Until a batch completes, its GPU blocks are neither free nor evictable
 * and its host slots neither matched nor reused, so the bytes under a copy
 * never change. A failed reload leaves its blocks cached without valid
 * K/V: treat it as fatal for the prefix cache (remove the sequences, then
 * kvp_manager_clear_prefix_cache). Allocations that find too few free
 * blocks evict at once without demoting (counted in evicted_undemoted):
 * demote_ahead should cover a step's allocations, unless demote_evicted
 * is set.
 *
 * demote_evicted (opt-in): the cached blocks an allocation (add, admit,
 * grow, fork) evicts go to their new owner at once, and their demotions
 * (host slots reserved under their hashes) come in the next
 * kvp_manager_flush_copies batch, ahead of its other demotions; such a
 * demotion holds no GPU block, and complete_copies only commits (or
 * releases) its host slot. Their K/V is intact until the step writes the
 * new owner's, so the mode needs the engine to follow one ordering rule:
 * with demote_evicted, call flush_copies after the step's last allocation,
 * and enqueue the batch's demotions on the step's stream before anything
 * that writes K/V in that step (not on a side stream): before the batch's
 * reloads, the fork copy-on-write copies, kv_write and attention. An
 * allocation after the step's flush would have its evicted blocks copied
 * in the next step, after they were overwritten: an engine that allocates
 * then must not set demote_evicted. A block allocated since the last
 * flush that an allocation evicts again is dropped (its K/V is not
 * written yet), as is one for which every host slot is pinned (both in
 * evicted_undemoted); one the host tier holds already is skipped_present.
 *
 * Write-through (write_through > 0; since 0.3): the host tier copies blocks
 * instead of moving them. Each block a step fills is queued once
 * kvp_manager_mark_computed says its K/V exists (a block a removal drops
 * uncomputed never is), and each kvp_manager_flush_copies hands out up to
 * write_through queued blocks, oldest first, as copies GPU block -> host
 * slot after the batch's demotions (the engine copies them as it copies
 * demotions). The GPU blocks stay in the prefix cache: until the batch
 * completes, each copy holds its block (neither evictable nor reused, and
 * the hold is not an access, so the eviction order is unchanged), and
 * complete_copies commits the host slots and announces them (CPU
 * BLOCK_STORED). A GPU eviction later costs nothing, and an engine that
 * completes each batch before its next step's allocations sees the GPU
 * prefix cache match exactly what it would without the tier; the tier only
 * adds host hits. Queued blocks the GPU evicts before their turn are
 * counted in write_through_lost. Use it with demote_ahead 0 (moving ahead
 * of need is what it replaces).
 * write_through_slack (since 0.7): a pool that holds the whole working set
 * never evicts a cached block, and every store is then wasted copy
 * bandwidth. With write_through_slack > 0, flush_copies hands out no
 * store while the GPU pool's free blocks (those no cached block occupies:
 * kvp_manager_stats.free_blocks) exceed the slack; the computed blocks
 * stay queued, oldest first (write_through_queue), and once the free
 * blocks fall to the slack or below each flush stores up to write_through
 * of them, as without it. No queued block is lost meanwhile, because a
 * cached block is evicted only by an allocation that finds the free
 * blocks short: while they outlast the allocations of the steps before
 * the flushes that store the queue, every queued block is still cached
 * at its turn. The caller's obligation: a slack of at least the
 * allocations of the few steps the queue needs to drain (its length over
 * write_through); with less, the first evictions may take queued blocks
 * before their store (counted in write_through_lost). The GPU prefix
 * cache's hits are the same with any slack (stores never evict). 0
 * stores every flush.
 * A block sits in host slot s as host_block_bytes bytes at
 * base + s * host_block_bytes, in whatever layout the engine copies it in
 * (the library never reads it). Keys: the first 8 bytes of the block's
 * chained hash. kvp_manager_clear_prefix_cache leaves the host tier: a
 * model or adapter reload needs a new manager.
 *
 * KV events (enable_kv_events): the host tier's blocks have their own, of
 * medium KVP_MEDIUM_CPU ("CPU" on the wire, as vLLM's offloaded blocks), in
 * the one stream with the GPU's and under the same max_pending_events
 * (raised to num_blocks + host_tier_slots + 1): a BLOCK_STORED when
 * complete_copies commits a demotion (none while its copy is in flight or
 * when it failed; its GPU BLOCKS_REMOVED came at flush_copies), a
 * BLOCKS_REMOVED when flush_copies (or a shared tier's fetch) reuses the
 * slot of a resident block (the host LRU's eviction). Reloads change nothing there (their GPU
 * BLOCK_STORED comes at admission). Snapshots, and the ALL_CLEARED of
 * kvp_manager_clear_prefix_cache, are followed by a BLOCK_STORED for each
 * block the host tier holds.
 *
 * Threads: as every kvp_manager function, these are safe to call
 * concurrently on one manager (they serialise); the caller's arrays must
 * not change during a call.
 */

/* One block copy of a host tier batch: GPU block `block` and host slot
 * `slot` (demotions copy block -> slot, reloads slot -> block). */
typedef struct kvp_tier_copy {
  int32_t block;
  int32_t slot;
} kvp_tier_copy;

/* What kvp_manager_match_tiers found for one prompt: its first gpu_tokens
 * in the GPU prefix cache, the next host_tokens in the host tier (whole
 * blocks; together never the prompt's last token). */
typedef struct kvp_tier_match {
  int32_t gpu_tokens;
  int32_t host_tokens;
} kvp_tier_match;

/* The host tier's counters (since creation) and gauges; all zero without a
 * host tier. */
typedef struct kvp_tier_stats {
  size_t struct_size;          /* set by the caller: sizeof(kvp_tier_stats) */
  int64_t demotions_queued;    /* demotion copies handed out by flush_copies */
  int64_t demotions_completed; /* committed to the host tier */
  int64_t demotions_failed;    /* reported failed (write-through stores
                                  aside: write_through_lost) */
  int64_t skipped_full;        /* demotions skipped: every host slot pinned */
  int64_t skipped_present;     /* demotions skipped: the host tier holds the block */
  int64_t evicted_undemoted;   /* blocks an allocation evicted at once */
  int64_t reloads;             /* host-to-GPU copies queued by admissions */
  int64_t reloads_completed;   /* of which reported complete */
  int64_t reloads_failed;      /* of which reported failed */
  int64_t host_hit_tokens;     /* tokens admissions matched in the host tier */
  int64_t match_queries;       /* prompts asked of kvp_manager_match_tiers */
  int64_t match_gpu_tokens;    /* tokens it found in the GPU prefix cache */
  int64_t match_host_tokens;   /* tokens it found in the host tier beyond them */
  int64_t host_evictions;      /* host slots' blocks evicted to make room */
  int64_t host_hits;           /* blocks matched in the host tier */
  int64_t host_misses;         /* blocks looked up there and not found */
  int32_t in_flight;           /* GPU blocks whose demotion has not completed */
  int32_t host_slots;          /* host_tier_slots */
  int32_t host_resident;       /* slots holding a committed block */
  int32_t host_reserved;       /* slots with a demotion copy in flight */
  int32_t host_pinned;         /* slots pinned (reloads in flight, reserved) */
  int32_t reserved;            /* 0 */
  /* The shared tier's (see "Shared KV tier" below); all zero without one. */
  int64_t shared_lookups;       /* calls that looked blocks up (an
                                   admission's or match's batch) */
  int64_t shared_hits;          /* blocks found there, consecutively after a
                                   prompt's GPU and host matches */
  int64_t shared_misses;        /* blocks not found, or not looked up (the
                                   call failed or was skipped) */
  int64_t shared_fetched;       /* blocks read into host slots */
  int64_t shared_fetch_misses;  /* blocks found whose read then missed (gone
                                   since, corrupt, short) or no slot took */
  int64_t shared_hit_tokens;    /* tokens admissions matched in blocks the
                                   same call fetched (in host_hit_tokens) */
  int64_t shared_match_tokens;  /* the same for kvp_manager_match_tiers (in
                                   match_host_tokens) */
  int64_t shared_puts_queued;   /* committed demotions queued for a store */
  int64_t shared_puts_done;     /* of which stored */
  int64_t shared_puts_present;  /* of which not sent: held there already */
  int64_t shared_puts_failed;   /* of which not stored: the call failed or
                                   was skipped, or the server refused */
  int64_t shared_puts_dropped;  /* committed demotions not queued: the
                                   queue was full */
  int64_t shared_corrupt;       /* values that failed a check: misses */
  int64_t shared_timeouts;      /* round trips past shared_tier_timeout_ms */
  int64_t shared_errors;        /* round trips failed otherwise (refused
                                   connections), commands refused */
  int64_t shared_skipped;       /* calls skipped without a round trip, the
                                   server having failed on the call's path
                                   (lookups, stores) within its backoff
                                   window */
  int64_t shared_bytes_read;    /* value bytes read, headers included */
  int64_t shared_bytes_written; /* value bytes written, headers included */
  int32_t shared_queue_len;     /* blocks waiting to be stored now */
  int32_t shared_available;     /* 1: neither path (lookups, stores) is in
                                   a backoff window */
  int64_t shared_auth_failures; /* of shared_errors: AUTH refused (or its
                                   password file unreadable), commands
                                   refused with NOAUTH or NOPERM */
  int64_t shared_tls_failures;  /* of shared_errors: TLS handshakes or
                                   certificate verifications that failed */
  int64_t shared_mac_failures;  /* of shared_corrupt: values whose MAC did
                                   not verify (none, another key's,
                                   altered) */
  /* The shared tier in cluster mode (since 0.3; "Shared KV tier", Cluster). */
  int64_t shared_redirects;     /* MOVED and ASK replies followed */
  int64_t shared_map_reads;     /* slot maps read */
  int32_t shared_cluster;       /* 1: the server is a cluster */
  int32_t shared_primaries;     /* its primaries in the last map */
  /* Write-through (since 0.3; see "Host KV tier", Write-through). */
  int64_t write_through_stored; /* computed blocks copied to the host tier
                                   while staying on the GPU (completed) */
  int64_t write_through_lost;   /* computed blocks the GPU evicted before
                                   their store's turn (and the host tier
                                   does not hold), or whose store failed */
  int32_t write_through_queue;  /* computed blocks waiting for their store */
  int32_t reserved2;            /* 0 */
  /* Since 0.7. */
  int64_t shared_remembered;    /* prompts not looked up: the server said
                                   it lacks their first block past the GPU
                                   and host matches within the last second */
} kvp_tier_stats;

#define KVP_TIER_STATS_INIT KVP_STRUCT_INIT(kvp_tier_stats)

#ifndef KVPLUG_NO_PROTOTYPES
/* Demotes least recently used cached blocks (see above) and returns the
 * step's copy batch: its demotions in demote[0, *num_demote) (eviction
 * order) and the reloads queued by admissions since the last flush in
 * reload[0, *num_reload) (admission order, each prompt's block order),
 * and its ticket in *ticket for kvp_manager_complete_copies; *ticket 0 and
 * both counts 0 when there is nothing to copy (then there is nothing to
 * complete). A block whose host slot cannot be reserved (every slot
 * pinned, or it is there already) is freed without a copy and counted.
 * demote must have room for demote_ahead minus the free blocks minus those
 * being demoted, plus (demote_evicted) the demotions allocations queued
 * since the last flush, plus (write_through) up to write_through
 * write-through stores (none while the free blocks exceed
 * write_through_slack), reload for the reloads queued: arrays of
 * demote_ahead + write_through (num_blocks + demote_ahead + write_through
 * with demote_evicted) and num_blocks entries always do without layer
 * groups; with them each
 * evicted block brings its companions' demotions too (up to 1 + groups
 * copies a block): arrays of num_blocks entries always do. Demotions come first in demote: those
 * allocations queued, then flush_copies' own. Otherwise BUFFER_TOO_SMALL, with nothing
 * changed and *num_demote and *num_reload set to the room needed.
 * demote (reload) may be NULL with max_demote (max_reload) 0.
 * Errors: NULL_POINTER (num_demote, num_reload, ticket; an array NULL with
 * its max > 0), INVALID_ARGUMENT (no host tier, a max < 0),
 * BUFFER_TOO_SMALL. */
kvp_status kvp_manager_flush_copies(kvp_manager *m, kvp_tier_copy *demote,
                                    int32_t max_demote, int32_t *num_demote,
                                    kvp_tier_copy *reload, int32_t max_reload,
                                    int32_t *num_reload, uint64_t *ticket);

/* Reports that the copies of batch `ticket` have finished (failed 0) or
 * failed (nonzero): each demoted block's host slot is committed (on
 * failure released) and its GPU block freed; each reload's host slot is
 * unpinned and the copy's hold on its GPU block dropped. Call it once per
 * nonzero ticket, from any thread.
 * Errors, with nothing changed: INVALID_ARGUMENT (no host tier), NOT_FOUND
 * (ticket unknown or completed already). */
kvp_status kvp_manager_complete_copies(kvp_manager *m, uint64_t ticket,
                                       int32_t failed);

/* Per tier kvp_manager_match: for each of n prompts (given as in
 * kvp_manager_admit; an empty prompt matches 0) the tokens of its longest
 * prefix in the GPU prefix cache (touched, as match does) and, beyond
 * them, the tokens of the blocks the host tier holds (touched in the host
 * tier's LRU, not pinned). A router's or scheduler's query; nothing is
 * admitted. With a shared tier, the blocks the server holds past those
 * are first fetched into the host tier and counted in host_tokens (a
 * prefetch for the admission that follows; see "Shared KV tier").
 * host_tokens is 0 without a host tier, both without the prefix
 * cache. Errors: NULL_POINTER (out, tokens, token_offsets),
 * INVALID_ARGUMENT (n < 1 or > 2^20, offsets, keys). */
kvp_status kvp_manager_match_tiers(kvp_manager *m, int32_t n, const int32_t *tokens,
                                   const int64_t *token_offsets,
                                   const kvp_prefix_keys *keys, kvp_tier_match *out);

/* For each of n prompts (given as in kvp_manager_admit; an empty prompt
 * has no hit), room[i]: the blocks an admission of it could allocate now
 * beyond its longest prefix in the GPU prefix cache, that is the free
 * blocks and the evictable cached ones, less the hit's blocks that the
 * admission would take out of the evictable ones (those no sequence, copy
 * or pin holds). kvp_manager_admit admits a prompt whose blocks past its
 * hit are at most room[i], if nothing changes in between. A hit that
 * running sequences share (a system prompt) costs nothing here, where
 * the free and evictable counts of kvp_manager_stats and
 * kvp_manager_prefix_stats less all the hit's blocks would undercount. A
 * query: no LRU touch, lock or counter. Without the prefix cache, the
 * free blocks. Since 0.7.
 * Errors: NULL_POINTER (room, tokens, token_offsets), INVALID_ARGUMENT
 * (n < 1 or > 2^20, offsets, keys), UNSUPPORTED (a manager with layer
 * groups, whose window groups take blocks of the same pool). */
kvp_status kvp_manager_match_room(kvp_manager *m, int32_t n, const int32_t *tokens,
                                  const int64_t *token_offsets,
                                  const kvp_prefix_keys *keys, int32_t *room);

/* Fills *out with the host tier's statistics (all zero without one).
 * Errors: NULL_POINTER, STRUCT_SIZE. */
kvp_status kvp_manager_tier_stats(kvp_manager *m, kvp_tier_stats *out);

/* The host tier's memory: *base receives its start, *slot_bytes
 * host_block_bytes and *num_slots host_tier_slots; slot s is
 * [base + s * slot_bytes, base + (s + 1) * slot_bytes). The region is the
 * manager's and stays valid until kvp_manager_destroy (no copy may be in
 * flight then). The engine writes a slot only under a demotion of the
 * current batch and reads one under a reload; outputs may be NULL.
 * Errors: INVALID_ARGUMENT (no host tier). */
kvp_status kvp_manager_host_tier_memory(kvp_manager *m, void **base,
                                        int64_t *slot_bytes, int32_t *num_slots);
#endif /* KVPLUG_NO_PROTOTYPES */
/*
 * Shared KV tier (a manager created with shared_tier_addr and a host tier):
 * a Valkey or Redis server that instances share, below each one's host
 * tier, so that an instance serves a prompt another instance computed.
 * With enable_kv_events, a block a fetch brings into the host tier is
 * announced as any host block: a BLOCK_STORED of medium KVP_MEDIUM_CPU when
 * its slot commits (its hash, parent, tokens, adapter and multimodal
 * entries from the prompt that wanted it), a BLOCKS_REMOVED (CPU) for a
 * resident host block whose slot the fetch took, and snapshots list it.
 * The server's own contents have no events (no medium SHARED is sent): it
 * evicts by its own maxmemory policy, unseen by the instances.
 *
 * Fetch: kvp_manager_admit and kvp_manager_match_tiers look, for each
 * prompt, past its GPU and host matches: the blocks the server holds under
 * the prompt's next chained hashes, consecutively, are read into fresh
 * host slots, and the call goes on as if the host tier held them (admit
 * reloads them and counts them in matched_tokens; match_tiers counts them
 * in host_tokens, so a router's match prefetches them). Two round trips
 * per call whatever the batch, each bounded by shared_tier_timeout_ms,
 * transfer included (size it for an admission batch's blocks at the
 * link's bandwidth: 1.25 GiB of a 10k-token Llama-3-8B history takes
 * about 0.5 s at the 2.5-2.8 GB/s one connection reads from a local
 * server), made without holding the manager's lock. A prompt whose first
 * block past its GPU and host matches the server said it lacks is not
 * looked up again for a second (counted in shared_remembered): a prompt
 * that waits for admission is matched and admitted every step, and each
 * lookup is a round trip on the serving path. A block this manager
 * stores is looked up again as soon as its store returns; one another
 * instance stores meanwhile is found at the first lookup after that
 * second. A server that did not answer is not taken as lacking anything.
 * A block that is absent, corrupt, short or another layout's is a miss,
 * and the prefix is computed; a read that times out keeps the blocks it
 * read whole and checked before the timeout (a prefix of the match). A
 * server that is down, slow or restarting costs one failed round trip,
 * then is skipped without a round trip for a backoff
 * window (1 s, doubling up to 30 s while it keeps failing); every such
 * call is counted (shared_errors, shared_timeouts, shared_skipped) and
 * none is an error. Lookups and reads, and stores, each have a window of
 * their own: a store that fails or times out (a slow server's large
 * pipeline) does not skip the lookups, and a lookup that succeeds does
 * not end the stores' window.
 *
 * Store: a block whose demotion kvp_manager_complete_copies commits is
 * queued for the server (its host slot pinned until read), and a thread of
 * the library writes the queue out, leaving out blocks the server holds
 * already, on connections of its own: admit's and match_tiers' lookups and
 * reads never wait behind a store. complete_copies never waits on the
 * server: a demotion that finds the queue (shared_tier_put_queue) full is
 * not stored, counted in shared_puts_dropped. kvp_manager_destroy writes
 * the queue out first.
 *
 * Keys and model identity: a block is stored under
 * kvplug:<namespace>:<its 128-bit chained hash in hex>, with a header
 * (the hash again, a fingerprint of the namespace, block size and
 * host_block_bytes, the payload's length and checksum) checked on every
 * read. The chained hash covers tokens, adapter, multimodal items and
 * salt, not the model: shared_tier_namespace must name everything the
 * K/V depends on (model and revision, dtype, layers, KV heads, head size,
 * block layout, tensor-parallel rank when ranks keep their own heads),
 * e.g. "llama-3.1-8b-instruct.bf16.l32.kv8.d128.tp0". Instances that
 * share blocks use the same namespace and host_block_bytes; a different
 * model needs a different namespace.
 *
 * Memory: the library never deletes keys; bound the server with its own
 * maxmemory and an eviction policy (allkeys-lru for a dedicated server).
 *
 * Security (the config's shared_tier_username ... shared_tier_tls; all off
 * by default):
 *   - AUTH: every new connection sends AUTH [username] password before its
 *     first command. The password comes from an environment variable or a
 *     file, read at create and again on every connect (a rotated file is
 *     used from the next connection on). A refused AUTH fails the call as
 *     a down server does (a miss, a backoff window), counted in
 *     shared_errors and shared_auth_failures and logged; a command the
 *     user may not run (NOPERM: the tier needs GET, SET and EXISTS on
 *     kvplug:<namespace>:*) counts there without a backoff window.
 *   - TLS: every connection does a TLS handshake (TLS 1.2 or later) and
 *     verifies the server's certificate against shared_tier_tls_ca_file
 *     or the system's roots, for shared_tier_tls_server_name or the
 *     address's host, presenting the client certificate when given. A
 *     handshake or verification failure (unknown CA, expired, another
 *     name, no TLS on the server, the client certificate refused) fails
 *     the call as a down server does, counted in shared_errors and
 *     shared_tls_failures and logged; nothing is ever sent in plaintext
 *     instead.
 *   - MAC: each value stored carries, after its header, the id of the
 *     first key and a keyed BLAKE3 tag of its payload, header and
 *     namespace; a read checks it with the key of that id, if it is one of
 *     the (one or two) keys, else the value is a miss, counted in
 *     shared_corrupt and shared_mac_failures. A client that can write to
 *     the server but lacks the key cannot make a value that an instance
 *     serves; it can still delete values, or put back an older value of
 *     the same block (the same K/V). Rotation without downtime: every
 *     instance to "old,new" (writes old, accepts both), then "new,old",
 *     then "new". Instances that share blocks share the keys: a value
 *     with a MAC is a miss for an instance without one, and the reverse.
 *   No log line or error message holds a password or key; the library
 *   logs the first failure of a run of failures, and a run's end.
 *
 * Threads: as for the host tier. The store thread touches only the host
 * slots it pinned and the server.
 */
/* ==== section: host KV tier (end) ==== */

/* ==== section: tier copy (begin) ==== */
/*
 * A tier copier copies a host tier's batches (kvp_manager_flush_copies, or
 * an engine's own tier) between the engine's paged KV caches in GPU memory
 * and host slots: every layer's K and V of every block of the batch in one
 * kernel launch per 500 demotions or reloads, on the engine's stream, reading and
 * writing the host slots directly (page-locked, mapped memory). Needs the
 * library's CUDA kernels and a GPU. With KVP_TIER_COPY_STORE_COPY_ENGINE
 * (layers->flags) the demotions go to the copy engines instead.
 *
 * Layouts. Block b of layer l is the block_bytes at k[l] + b *
 * k_block_stride (K) and v[l] + b * v_block_stride (V): one contiguous
 * chunk per block, layer and tensor, as in the [num_blocks, block_size,
 * kv_heads, head_dim] and [num_blocks, kv_heads, block_size, head_dim]
 * layouts, and in vLLM's and SGLang's paged caches. Host slot s holds
 * (layer l, tensor t = 0 K, 1 V) at host + s * slot_bytes + (l * kv + t) *
 * block_bytes, kv = 2 (1 without V): a slot is one contiguous value, the
 * one the shared tier stores. slot_bytes must hold num_layers * kv *
 * block_bytes (a manager's host_block_bytes is slot_bytes).
 *
 * FP8 caches (since 0.6; layers->kv only): an e4m3 cache with
 * KVP_KV_SCALE_TOKEN_HEAD scales moves with its scales: a block's scales of
 * (layer l, tensor t), block_size * num_kv_heads * 4 bytes (a multiple of
 * 16: block_size * num_kv_heads a multiple of 4), sit after all of the
 * slot's K/V chunks, at host + s * slot_bytes + num_layers * kv *
 * block_bytes + (l * kv + t) * block_size * num_kv_heads * 4, and
 * slot_bytes must hold them too. A KVP_KV_SCALE_TENSOR cache's one scale
 * stays with the engine: its slots hold the e4m3 chunks only. Every layer
 * has the same scale kind.
 *
 * Ordering: kvp_tier_copier_run only enqueues, the demotions in launches
 * (or batched copies) of their own ahead of the reloads' (a reload may
 * write a GPU block that a demotion of the same batch reads, with
 * demote_evicted), so that on the stream every demotion has read its
 * block before any reload of the batch writes one. The engine records an event
 * on the stream after it and calls kvp_manager_complete_copies once the
 * event has completed; reloads are ordered before the step's attention by
 * running on the step's stream (or an event it waits on).
 *
 * Context: the copier belongs to the CUDA context current on the creating
 * thread (device 0's primary context when none is); run it from threads
 * where that context is current, on streams of that context.
 *
 * Threads: kvp_tier_copier_run may be called from several threads (calls
 * serialise); destroy must not race a run. Arrays are the caller's and
 * read only during the call.
 */
typedef struct kvp_tier_copier kvp_tier_copier;

/* An engine's paged KV caches, per layer (see Layouts above). */
typedef struct kvp_kv_layers {
  size_t struct_size;      /* sizeof(kvp_kv_layers) */
  int32_t num_layers;      /* [1, KVP_MAX_TIER_LAYERS] */
  int32_t num_blocks;      /* blocks per layer, >= 1: ops naming others are refused */
  const uint64_t *k;       /* [num_layers] device addresses of block 0 of each layer's K */
  const uint64_t *v;       /* [num_layers] for V, or NULL: K only (one tensor per layer) */
  int64_t block_bytes;     /* one block of one layer's K (and V); a multiple of 16, <= 2^30 */
  int64_t k_block_stride;  /* bytes from block b to b+1 in K: >= block_bytes, multiple of 16 */
  int64_t v_block_stride;  /* the same in V (ignored without v) */
  /* Appended in 0.4: the layers as the attention calls take them, kv[l] the
   * kvp_paged_kv of layer l (see the attention kernels' section), instead
   * of the fields above, which must then be 0 (num_layers stays). Every
   * layer's descriptor must have the same shape (dtype, num_kv_heads,
   * num_blocks, block_size, a non-zero head_dim, strides) with each block's
   * tokens dense (token_stride = num_kv_heads * head_dim, head_stride =
   * head_dim), and V in every layer or in none (K only). NULL: the fields
   * above. */
  const struct kvp_paged_kv *const *kv;
  /* Appended in 0.7. */
  int32_t flags;    /* 0 or KVP_TIER_COPY_STORE_COPY_ENGINE */
  int32_t reserved; /* 0 */
} kvp_kv_layers;

/* kvp_kv_layers.flags: a copier's demotions (GPU block -> host slot) go to
 * the copy engines instead of the kernel's launches; reloads keep the
 * kernel. Where a block's chunks of every layer (K, V, and the scales
 * apart) sit at one pitch, below 2^31 bytes, in one allocation (one tensor
 * [layers][K, V][blocks][...]; not a cache over several mappings), a block
 * is one strided copy (cuMemcpy2DAsync); otherwise
 * one cuMemcpyBatchAsync a batch with a copy per block, layer and tensor,
 * which costs the driver about half a microsecond a copy. The kernel's
 * thread blocks take SMs from the kernels of other streams, the copy
 * engines do not; in a serving loop neither has been found faster
 * (bench/RESULTS.md, "Tier stores by the copy engines"). Needs a
 * CUDA 12.8 or newer driver (create answers UNSUPPORTED otherwise), and a
 * run with demotions a stream other than the legacy default stream (NULL
 * or CU_STREAM_LEGACY: INVALID_ARGUMENT), which the batched copy refuses. */
#define KVP_TIER_COPY_STORE_COPY_ENGINE 1

#define KVP_KV_LAYERS_INIT KVP_STRUCT_INIT(kvp_kv_layers)

#ifndef KVPLUG_NO_PROTOTYPES
/* Creates a copier for `layers` and the host region [host, host + num_slots
 * * slot_bytes) (16-byte aligned), which it page-locks and maps for the
 * device unless the engine registered it already (then it is used as it
 * is and left registered at destroy). The layer addresses are copied.
 * Errors: NULL_POINTER (layers, host, out, layers->k), STRUCT_SIZE,
 * INVALID_ARGUMENT (counts, sizes, strides, alignment, a null address,
 * unknown flags, reserved not 0), UNSUPPORTED (built without kernels;
 * KVP_TIER_COPY_STORE_COPY_ENGINE on a driver older than CUDA 12.8),
 * NO_DEVICE, CUDA (registering the memory), OUT_OF_MEMORY. */
kvp_status kvp_tier_copier_create(const kvp_kv_layers *layers, void *host, int64_t slot_bytes,
                                  int32_t num_slots, kvp_tier_copier **out);

/* Enqueues on `stream` (a CUstream / cudaStream_t; NULL = the legacy
 * default stream) the copies of demote[0, num_demote) (GPU block -> host
 * slot) and reload[0, num_reload) (host slot -> GPU block). Every op is
 * checked first: a block or slot out of range fails the call with nothing
 * enqueued. A batch must not name one block or slot twice with a
 * conflicting direction (a manager's batches never do).
 * Errors: INVALID_HANDLE, NULL_POINTER (an array NULL with its count > 0),
 * INVALID_ARGUMENT (a count < 0, an op out of range, another CUDA context
 * current, demotions of a KVP_TIER_COPY_STORE_COPY_ENGINE copier on the
 * legacy default stream), CUDA (a launch, a batched or strided copy; the
 * copies enqueued before the failing one stay enqueued: let the stream
 * finish before giving the batch's blocks and slots back). */
kvp_status kvp_tier_copier_run(kvp_tier_copier *c, const kvp_tier_copy *demote, int32_t num_demote,
                               const kvp_tier_copy *reload, int32_t num_reload, void *stream);

/* Destroys a copier: unregisters the host region when create registered
 * it. No copy of it may be in flight. NULL is a no-op. */
void kvp_tier_copier_destroy(kvp_tier_copier *c);
#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: tier copy (end) ==== */

/* ==== section: KV event publisher (begin) ==== */
/*
 * A KV event publisher sends a manager's KV events (enable_kv_events) out
 * of the process in vLLM's wire format (vllm/distributed/kv_events.py), so
 * that routers and indexers written for vLLM engines (llm-d's kv-cache
 * indexer, Dynamo's router, this repository's cmd/kvindex) track kvplug
 * engines unchanged:
 *
 *   PUB socket    every batch is a 3-frame message: topic, sequence number
 *                 (8 bytes big-endian, 0, 1, 2, ... from create), payload.
 *   payload       a msgpack EventBatch [ts, events, data-parallel rank] (the
 *                 rank left out when the config's is -1); each event a
 *                 map tagged by "type":
 *                 BlockStored {block_hashes, parent_block_hash, token_ids,
 *                 block_size, lora_id (the adapter, or nil), medium,
 *                 lora_name (nil), extra_keys (only when a block has
 *                 multimodal entries: per block nil or a list of [content
 *                 hash as 32 hex digits, offset relative to the block])},
 *                 BlockRemoved {block_hashes, medium}, AllBlocksCleared {}.
 *                 A chain of stored blocks goes as one BlockStored, as in
 *                 vLLM. A manager with layer groups publishes every
 *                 group's events, as vLLM's hybrid models do: each
 *                 BlockStored and BlockRemoved with group_idx (the layer
 *                 group) after the fields above, a BlockStored also with
 *                 kv_cache_spec_kind ("full_attention", "sliding_window",
 *                 "mamba" for a recurrent group) and, for a window,
 *                 kv_cache_spec_sliding_window (its window); positional
 *                 events put them in vLLM's places, extra_keys nil before
 *                 them. Without groups the events have none of them.
 *                 KVP_EVENTS_FORMAT_ARRAY selects vLLM's older
 *                 positional events; KVP_EVENTS_HASH_INT64 sends each hash
 *                 as its last 8 bytes, big-endian, as an integer (vLLM's
 *                 conversion) instead of its 16 bytes. The salt is never
 *                 sent (it may be a secret).
 *   ROUTER socket (replay_endpoint) a request is the first wanted sequence
 *                 number (8 bytes big-endian; from a DEALER with an empty
 *                 delimiter frame, or a REQ); the replies are [topic, seq,
 *                 payload] for every buffered batch from there on, then
 *                 [empty, -1, empty]. Asking for -2 (kvplug's extension;
 *                 a vLLM publisher just ends the replay) makes the
 *                 publisher send AllBlocksCleared and a BlockStored for
 *                 every cached block on PUB, at most once a second: for a
 *                 subscriber whose gap is older than the buffer.
 *
 * The publisher runs on its own goroutine: every flush_interval_us (or at
 * kvp_event_publisher_flush) it takes the manager's pending events under
 * the manager's lock (a copy), then encodes and sends them without it, so
 * no engine call waits on the network. Each subscriber has its own queue of
 * at most hwm batches and 64 MiB; a batch that finds it full is dropped for that subscriber
 * only and counted (dropped_sends); the subscriber sees the gap in the
 * sequence numbers and replays it. A subscriber that blocks a write for 10
 * s is disconnected. Memory is bounded by buffer_steps and buffer_bytes
 * (the replay buffer) plus the queues. If the publisher itself falls
 * behind by more than the manager's max_pending_events, the manager
 * replaces the backlog with ALL_CLEARED and a snapshot, as for drains.
 * At create the publisher asks for a snapshot, so its first batch is
 * AllBlocksCleared followed by the blocks cached already.
 *
 * While a publisher runs, it is the manager's one consumer of events:
 * do not call kvp_manager_drain_events or kvp_manager_drain_group_events
 * on that manager (the events would be split between the two), and
 * create at most one publisher per manager (a second is refused). Destroy
 * the publisher before its manager.
 * Endpoints: tcp://host:port (host "*" for every interface, as in vLLM; port 0
 * picks a free port, see kvp_event_publisher_stats) and ipc:///path.
 * Bind or connect: subscribers such as cmd/kvindex connect, so the PUB socket
 * must bind; set bind_mode = KVP_EVENTS_BIND for that. bind_mode's 0,
 * KVP_EVENTS_BIND_VLLM, is vLLM's rule and stays the C default (a field's 0
 * keeps its meaning within a major version): it binds an endpoint whose host
 * is "*" or "::", and ipc://, but connects to tcp://127.0.0.1:5557, where a
 * subscriber that connects too is refused forever. KVP_EVENTS_CONNECT is for
 * a subscriber that binds (llm-d's indexer can). The Python binding's
 * EventPublisher passes KVP_EVENTS_BIND unless told otherwise. The ROUTER
 * socket always binds.
 * Security: ZMTP's NULL mechanism, as vLLM: bind to trusted networks only.
 */
typedef struct kvp_event_publisher kvp_event_publisher;

enum {
  KVP_EVENTS_BIND_VLLM = 0,   /* vLLM's rule: bind when the endpoint has '*' or
                                 '::' or is ipc://, else connect */
  KVP_EVENTS_BIND = 1,        /* always bind */
  KVP_EVENTS_CONNECT = 2      /* always connect (the subscriber binds); redials */
};

enum {
  KVP_EVENTS_FORMAT_MAP = 0,   /* events as maps tagged by "type" (vLLM now) */
  KVP_EVENTS_FORMAT_ARRAY = 1  /* positional events [tag, fields...] (older vLLM) */
};

enum {
  KVP_EVENTS_HASH_BYTES = 0,  /* 16 bytes (core/prefix/HASH.md's canonical form) */
  KVP_EVENTS_HASH_INT64 = 1   /* the last 8 bytes as a big-endian unsigned integer */
};

typedef struct kvp_event_publisher_config {
  size_t struct_size;          /* sizeof(kvp_event_publisher_config) */
  const char *endpoint;        /* PUB endpoint (see "Endpoints" above); required */
  const char *replay_endpoint; /* ROUTER endpoint (always bound); NULL = no replay */
  const char *topic;           /* first frame of every message, at most 1024
                                  bytes; NULL = "" (vLLM's default); llm-d reads
                                  "kv@<instance>@<model>" */
  const char *medium;          /* "medium" of the GPU's events; NULL = "GPU"
                                  (the host tier's go as "CPU") */
  int32_t bind_mode;           /* KVP_EVENTS_BIND_...; default vLLM's rule
                                  (0): set KVP_EVENTS_BIND to serve a named
                                  host:port (see "Bind or connect" above) */
  int32_t event_format;        /* KVP_EVENTS_FORMAT_...; default MAP */
  int32_t hash_format;         /* KVP_EVENTS_HASH_...; default BYTES */
  int32_t data_parallel_rank;  /* sent with every batch, as vLLM does; default
                                  0; -1 leaves it out (the batches of vLLM
                                  before it had one) */
  int32_t buffer_steps;        /* batches kept for replay, in [0, 2^24]; 0 = 10000 */
  int32_t hwm;                 /* batches queued per subscriber, in [0, 2^24];
                                  0 = 10000 */
  int32_t max_batch_events;    /* events per batch, in [0, 2^20]; 0 = 1024 */
  int32_t flush_interval_us;   /* publish pending events this often, in
                                  [0, 60e6]; 0 = 1000 */
  int64_t buffer_bytes;        /* payload bytes kept for replay; 0 = 256 MiB */
} kvp_event_publisher_config;

#define KVP_EVENT_PUBLISHER_CONFIG_INIT KVP_STRUCT_INIT(kvp_event_publisher_config)

/* A publisher's counters since create. */
typedef struct kvp_event_publisher_stats {
  size_t struct_size;        /* set by the caller: sizeof(kvp_event_publisher_stats) */
  int64_t batches;           /* batches published (= the next sequence number) */
  int64_t events;            /* the manager's events they carried */
  int64_t bytes;             /* payload bytes */
  int64_t dropped_sends;     /* batches not queued to a subscriber whose queue was full */
  int64_t replay_requests;   /* replay requests served (snapshot requests included) */
  int64_t replay_batches;    /* batches sent by replays */
  int64_t snapshots;         /* snapshots taken (create, resync, -2 requests) */
  int64_t source_errors;     /* failed drains of the manager */
  int64_t buffered_batches;  /* batches in the replay buffer now */
  int64_t buffered_bytes;
  int32_t subscribers;       /* PUB connections now */
  int32_t pub_port;          /* the PUB socket's bound TCP port; 0 when
                                connecting or on ipc */
  int32_t replay_port;       /* the ROUTER socket's bound TCP port; 0 when none */
  int32_t reserved;          /* 0 */
} kvp_event_publisher_stats;

#define KVP_EVENT_PUBLISHER_STATS_INIT KVP_STRUCT_INIT(kvp_event_publisher_stats)

#ifndef KVPLUG_NO_PROTOTYPES

/* Starts publishing m's KV events: binds (or connects) the sockets and
 * starts the publisher's goroutine. Errors, with nothing started:
 * NULL_POINTER (cfg, out, endpoint), STRUCT_SIZE, INVALID_HANDLE (m),
 * INVALID_ARGUMENT (KV events off in m; m has a publisher already; an
 * endpoint that does not parse or cannot be bound, with the system's
 * reason; a field out of range). */
kvp_status kvp_event_publisher_create(kvp_manager *m, const kvp_event_publisher_config *cfg,
                                      kvp_event_publisher **out);

/* Publishes what is pending (waiting at most a second for subscribers to
 * take it), closes the sockets and stops the goroutine. NULL is a no-op. */
void kvp_event_publisher_destroy(kvp_event_publisher *p);

/* Wakes the publisher to publish the pending events now rather than at
 * its next interval (e.g. at the end of an engine step). Never waits. */
kvp_status kvp_event_publisher_flush(kvp_event_publisher *p);

/* Asks for a snapshot: the next batches carry AllBlocksCleared and a
 * BlockStored for every cached block, for subscribers that lost their view
 * (the events pending before it are superseded, not dropped). */
kvp_status kvp_event_publisher_resync(kvp_event_publisher *p);

/* Fills *out with the publisher's counters. Errors: NULL_POINTER,
 * STRUCT_SIZE (out->struct_size below sizeof(size_t) + 8). */
kvp_status kvp_event_publisher_stats_get(kvp_event_publisher *p, kvp_event_publisher_stats *out);

#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: KV event publisher (end) ==== */

/* ==== section: attention kernels (begin) ==== */
/*
 * CUDA kernels over the engine's own device memory: write this step's K and
 * V into the paged cache, paged decode attention (split-KV for long contexts
 * and small batches), and the merge of attention states.
 *
 * Launches. Each call checks its arguments, enqueues its kernel(s) on
 * `stream` (a CUstream as an integer; 0 = the legacy default stream) and
 * returns: no host synchronisation, no allocation, no host-device copy, so
 * the calls can be captured in CUDA graphs. Kernel faults surface later, on
 * the stream, like any kernel's. Launches use the calling thread's current
 * CUDA context (the engine's; PyTorch keeps its device's primary context
 * current); a thread with no current context gets device 0's primary context
 * made current. The kernels are loaded into a context on its first launch:
 * call kvp_attn_prepare() before capturing a graph. All functions are safe
 * to call from any thread.
 *
 * Errors: NULL_POINTER (args NULL, or a required device pointer 0),
 * STRUCT_SIZE, INVALID_ARGUMENT (bad enum, shape, stride, alignment or
 * count; the message names it), UNSUPPORTED (head_dim not 64/128/256, or a
 * device without the shared memory the kernel needs), BUFFER_TOO_SMALL (the
 * workspace), NO_DEVICE (no CUDA driver or device), CUDA (a driver call
 * failed; the message has the driver's error).
 *
 * Layouts. Strides count ELEMENTS of the tensor's dtype (float32 elements
 * for lse arrays); head_dim is contiguous. The paged cache is
 * [num_blocks, block_size, num_kv_heads, head_dim] with K and V as two
 * pointers sharing strides (a combined [num_blocks, 2, block_size, H, D]
 * tensor is passed as two pointers). block_size is any value >= 1 (1 is
 * token mode). GQA: query head i reads kv head i / (num_q_heads /
 * num_kv_heads). Tensors of the dtype and the workspace must be 16-byte
 * aligned with strides that are multiples of 16 bytes (8 elements of
 * f16/bf16, 4 of f32); int32 and float32 arrays need 4-byte alignment.
 * Written tensors must not overlap themselves.
 */
typedef enum kvp_dtype {
  KVP_DTYPE_F16 = 1,  /* IEEE half */
  KVP_DTYPE_BF16 = 2, /* bfloat16 */
  KVP_DTYPE_F32 = 3,  /* float, for tests: slower kernels */
  KVP_DTYPE_E4M3 = 4  /* FP8 e4m3 (OCP; torch.float8_e4m3fn): a cache format
                         only, kvp_paged_kv.dtype under an f16/bf16 call */
} kvp_dtype;

/* How an e4m3 cache is scaled (kvp_paged_kv.scale_kind): a stored element x
 * stands for x * scale.
 *   KVP_KV_SCALE_TOKEN_HEAD: one float32 scale per (token, kv head) for K
 *     and for V, k_scale and v_scale float32 [num_blocks, block_size,
 *     num_kv_heads] contiguous (the scale of block b, offset t, kv head h at
 *     (b * block_size + t) * num_kv_heads + h). kvp_kv_write computes each
 *     one from its row, max|x| / 448, so nothing needs calibrating and an
 *     outlier token costs only its own row's precision. Indexed by block
 *     like the cache, so a block's scales move with it: an engine that
 *     copies a block (a fork, a swap) copies its scale rows too. 4 bytes per
 *     head_dim bytes: 3.1% more than the e4m3 elements at head_dim 128.
 *     num_blocks * block_size * num_kv_heads must be below 2^31 (the
 *     decode keeps scale indices as int32; INVALID_ARGUMENT otherwise).
 *   KVP_KV_SCALE_TENSOR: one float32 for all of K (k_scale[0]) and one for
 *     V (v_scale[0]), a checkpoint's calibrated scales; kvp_kv_write divides
 *     by them and saturates at +-448.
 * Scales are positive (kvp_kv_write never writes 0): the decode reads a
 * row whose K scale is 0 as one it cannot read (masked, as a row of an
 * ignored block).
 * float32 rather than bf16 scales: exact for any row, the dtype engines
 * keep scales in, and a 1.5% difference in bytes. */
typedef enum kvp_kv_scale {
  KVP_KV_SCALE_NONE = 0, /* a 16-bit or f32 cache */
  KVP_KV_SCALE_TOKEN_HEAD = 1,
  KVP_KV_SCALE_TENSOR = 2
} kvp_kv_scale;

/* One layer's paged KV cache, as every call that reads or writes it takes
 * it: K and V [num_blocks, block_size, num_kv_heads, head_dim] as two
 * pointers sharing strides, the block table that maps a sequence's token t
 * to block block_table[row * block_table_stride + t / block_size] at offset
 * t % block_size (columns >= max_blocks_per_seq and block ids outside
 * [0, num_blocks) are ignored), and the cache's dtype (an e4m3 cache: its
 * scales too, see kvp_kv_scale). An engine fills one
 * per layer (the table fields are the same for every layer) and passes it
 * through the `kv` pointer of kvp_kv_write_args, kvp_paged_decode_args and
 * kvp_paged_prefill_args, and kvp_kv_layers.kv (one per layer) of the tier
 * copier. The KV write reads no table: its table fields may be 0. The
 * prefill args serve kvp_paged_prefill and kvp_paged_cascade. When
 * `kv` is set, the args' own cache fields (k_cache, v_cache, the
 * cache_*_stride, num_blocks, block_size, block_table, block_table_stride,
 * max_blocks_per_seq) must be 0 and the args' dtype and num_kv_heads, where
 * they have them, 0 or equal to the descriptor's (INVALID_ARGUMENT
 * otherwise: a cache is described once); under an e4m3 descriptor the
 * args' dtype is the call's own, f16 or bf16, and must be set. The
 * descriptor is read during the call only. */
typedef struct kvp_paged_kv {
  size_t struct_size;         /* sizeof(kvp_paged_kv) */
  int32_t dtype;              /* kvp_dtype of the caches: the call's (q, out) dtype or 0,
                                 or KVP_DTYPE_E4M3 under an f16/bf16 call */
  int32_t num_kv_heads;       /* >= 1 */
  int32_t num_blocks;         /* >= 1 */
  int32_t block_size;         /* tokens per block, >= 1 (1 is token mode) */
  uint64_t k_cache;           /* [num_blocks, block_size, num_kv_heads, head_dim] */
  uint64_t v_cache;           /* same strides as k_cache */
  int64_t block_stride;       /* elements (of the cache's dtype) between blocks */
  int64_t token_stride;       /* between a block's tokens */
  int64_t head_stride;        /* between kv heads */
  uint64_t block_table;       /* int32 [rows, block_table_stride]; 0 for kvp_kv_write */
  int64_t block_table_stride; /* >= max_blocks_per_seq; 0 = max_blocks_per_seq */
  int32_t max_blocks_per_seq; /* block table columns read; 0 for kvp_kv_write */
  int32_t head_dim;           /* 0 or the call's head_dim */
  uint64_t k_scale;           /* e4m3: float32 scales of K (kvp_kv_scale); else 0 */
  uint64_t v_scale;           /* e4m3: float32 scales of V; else 0 */
  /* Appended in 0.5 (first released size: through v_scale, 104 bytes). */
  int32_t scale_kind;         /* e4m3: a kvp_kv_scale other than NONE; else 0 */
  int32_t reserved;           /* 0 */
} kvp_paged_kv;

#define KVP_PAGED_KV_INIT KVP_STRUCT_INIT(kvp_paged_kv)

/* Scatter of this step's K and V ([num_tokens, num_kv_heads, head_dim]) into
 * the caches: token t goes to slot slot_mapping[t] = block * block_size +
 * offset. Slots < 0 (padding) and slots >= num_blocks * block_size are
 * skipped. num_tokens == 0 launches nothing. K and V caches that are the
 * same memory (k_cache == v_cache), or token-head scale arrays that are
 * (k_scale == v_scale), are INVALID_ARGUMENT: one would overwrite the
 * other. */
typedef struct kvp_kv_write_args {
  size_t struct_size; /* sizeof(kvp_kv_write_args) */
  int32_t dtype;      /* kvp_dtype */
  int32_t head_dim;   /* 64, 128 or 256 */
  int32_t num_tokens; /* >= 0 */
  int32_t num_kv_heads;
  int32_t num_blocks;
  int32_t block_size;
  uint64_t key;       /* [num_tokens, num_kv_heads, head_dim] */
  int64_t key_token_stride;
  int64_t key_head_stride;
  uint64_t value;     /* [num_tokens, num_kv_heads, head_dim] */
  int64_t value_token_stride;
  int64_t value_head_stride;
  uint64_t k_cache;   /* [num_blocks, block_size, num_kv_heads, head_dim] */
  uint64_t v_cache;   /* same strides as k_cache */
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  int64_t cache_head_stride;
  uint64_t slot_mapping; /* int32 [num_tokens] */
  const kvp_paged_kv *kv; /* appended in 0.4: the caches (see kvp_paged_kv); NULL = the fields above */
} kvp_kv_write_args;

#define KVP_KV_WRITE_ARGS_INIT KVP_STRUCT_INIT(kvp_kv_write_args)

/* Decode attention, q_len (1 to 16) new tokens per sequence: for sequence
 * b's new token t (row b * q_len + t of q and out, at position seq_lens[b]
 * - q_len + t) and query head i, out = softmax(scale * q K^T) V over tokens
 * [0, that position] (one token: [0, seq_lens[b])), token
 * t read from block block_table[b * block_table_stride + t / block_size] at
 * offset t % block_size. Table columns >= max_blocks_per_seq and block ids
 * outside [0, num_blocks) are ignored. An empty sequence (seq_len <= 0)
 * gives out = 0 and lse = -inf. lse (optional) is the natural-log
 * log-sum-exp of the scaled scores, the input kvp_merge_states needs.
 *
 * Attention sinks (gpt-oss; `sinks`, appended in 0.6, here and in
 * kvp_paged_prefill_args): a float32 [num_q_heads] device array (4-byte
 * aligned) of one logit s_h per query head, in natural-log units and NOT
 * multiplied by scale, or 0 for none. The sink adds exp(s_h) to the softmax
 * denominator and nothing to the numerator: out = sum_j exp(x_j) v_j /
 * (exp(s_h) + sum_j exp(x_j)), x_j = scale * q.k_j over the tokens the row
 * attends to (after the causal mask and the window). Split-KV counts it
 * once per row. With sinks, lse is log(exp(s_h) + sum_j exp(x_j)), the log
 * of that whole denominator, and a row with no tokens gives out = 0 and
 * lse = s_h. Such a state already holds its sink: do not merge it again
 * with kvp_merge_states (a merge would weigh the sink as if it were keys
 * with a zero value). Every dtype takes sinks (f32 too); the library cannot
 * see the array's length: it must hold num_q_heads floats.
 *
 * Split-KV: with num_splits > 1 each sequence is cut into num_splits chunks
 * (multiples of 64 tokens) attended by separate blocks and merged by a
 * second kernel, through the workspace; num_splits = 0 lets the library
 * choose from batch, heads, max_seq_len and the device (kvp_attn_num_splits
 * tells the choice), using no more splits than the workspace holds (none
 * without a workspace). batch == 0 launches nothing. */
typedef struct kvp_paged_decode_args {
  size_t struct_size; /* sizeof(kvp_paged_decode_args) */
  int32_t dtype;      /* kvp_dtype of q, the caches and out */
  int32_t head_dim;   /* 64, 128 or 256 */
  int32_t batch;      /* sequences, in [0, 65535] */
  int32_t num_q_heads;
  int32_t num_kv_heads; /* divides num_q_heads */
  int32_t num_blocks;
  int32_t block_size;
  int32_t max_blocks_per_seq; /* block table columns read */
  uint64_t q;                 /* [batch * q_len, num_q_heads, head_dim] */
  int64_t q_batch_stride;
  int64_t q_head_stride;
  uint64_t k_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
  uint64_t v_cache; /* same strides as k_cache */
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  int64_t cache_head_stride;
  uint64_t block_table;       /* int32 [batch, block_table_stride] */
  int64_t block_table_stride; /* >= max_blocks_per_seq */
  uint64_t seq_lens;          /* int32 [batch] */
  uint64_t out;               /* [batch * q_len, num_q_heads, head_dim] */
  int64_t out_batch_stride;   /* between rows of out (q_batch_stride: of q) */
  int64_t out_head_stride;
  uint64_t lse;             /* float32 [batch * q_len, num_q_heads] contiguous; 0 = not wanted */
  uint64_t workspace;       /* device memory of kvp_attn_workspace_size bytes; 0 = none */
  uint64_t workspace_bytes; /* its size */
  float scale;              /* softmax scale, finite, >= 0; 0 = 1/sqrt(head_dim) */
  int32_t num_splits;       /* 0 = library's choice; 1..256 = forced */
  int32_t max_seq_len;      /* bound on seq_lens for the choice of splits; 0 = max_blocks_per_seq * block_size */
  int32_t q_len;            /* new tokens per sequence, in [0, 16]; 0 and 1: one (decode).
                               Split-KV workspace: sized for batch * q_len rows */
  const kvp_paged_kv *kv;   /* appended in 0.4: the cache and block table (see kvp_paged_kv);
                               NULL = the fields above */
  uint64_t sinks;           /* appended in 0.6: float32 [num_q_heads] device pointer (attention
                               sinks, above); 0 = none */
  int32_t window_size;      /* appended in 0.6: 0 = no window; w > 0: the new token at position
                               pos sees positions [max(0, pos - w + 1), pos] only (a
                               sliding-window layer); the table entries before every new
                               token's window may be -1 (they are skipped or masked) */
  int32_t reserved;         /* 0 */
} kvp_paged_decode_args;

#define KVP_PAGED_DECODE_ARGS_INIT KVP_STRUCT_INIT(kvp_paged_decode_args)

/* Merge of attention states over the same queries (e.g. a shared prefix's
 * and each sequence's own tokens): v[i] [num_tokens, num_heads, head_dim]
 * (dtype) with lse s[i] [num_tokens, num_heads] (float32, natural log; -inf =
 * empty state) for i < num_states. out = sum_i exp(s_i - lse) v_i and
 * out_lse = lse = log(sum_i exp(s_i)); all states empty gives out = 0 and
 * out_lse = -inf. out may alias v[0] when their strides are equal, out_lse
 * s[0] likewise. num_tokens == 0 launches nothing. */
#define KVP_MERGE_MAX_STATES 8

typedef struct kvp_merge_states_args {
  size_t struct_size; /* sizeof(kvp_merge_states_args) */
  int32_t dtype;      /* kvp_dtype of v and out */
  int32_t head_dim;   /* 64, 128 or 256 */
  int32_t num_states; /* 1..KVP_MERGE_MAX_STATES */
  int32_t num_tokens;
  int32_t num_heads;
  int32_t reserved;                  /* must be 0 */
  uint64_t v[KVP_MERGE_MAX_STATES];  /* entries >= num_states ignored */
  uint64_t s[KVP_MERGE_MAX_STATES];  /* float32 */
  int64_t v_token_stride;            /* shared by every v[i] */
  int64_t v_head_stride;
  int64_t s_token_stride;            /* float32 elements, shared by every s[i] */
  int64_t s_head_stride;
  uint64_t out;                      /* [num_tokens, num_heads, head_dim] */
  int64_t out_token_stride;
  int64_t out_head_stride;
  uint64_t out_lse;                  /* float32; 0 = not wanted */
  int64_t out_lse_token_stride;
  int64_t out_lse_head_stride;
} kvp_merge_states_args;

#define KVP_MERGE_STATES_ARGS_INIT KVP_STRUCT_INIT(kvp_merge_states_args)

/* Paged prefill / extend attention over a varlen batch, planned once per
 * batch composition and run per layer.
 *
 * Sequence b has q_len_b = qo_indptr[b+1] - qo_indptr[b] new query tokens,
 * rows [qo_indptr[b], qo_indptr[b+1]) of q and out, at positions
 * [kv_len_b - q_len_b, kv_len_b) of the sequence (kv_len_b counts the new
 * tokens: write them with kvp_kv_write first). Row i at position pos_i and
 * query head h attends causally to tokens [0, pos_i] of its sequence, or,
 * with window_size w > 0, to its last w tokens [max(0, pos_i - w + 1), pos_i]
 * (FlashInfer's window_left is w - 1), read through the block
 * table as in decode (columns >= max_blocks_per_seq and block ids outside
 * [0, num_blocks) are ignored). A whole prompt (q_len = kv_len), the tail of
 * a prompt after a prefix-cache hit, a chunk of a long prompt, draft tokens
 * to verify and decode rows (q_len 1) mix freely in one batch.
 * lse (optional) is float32 [total_q, num_q_heads] contiguous, natural log.
 * Attention sinks (kvp_paged_prefill_args.sinks) as in kvp_paged_decode_args:
 * on every route (the decode route, the decode rows of a mixed batch,
 * split-KV, the Hopper and the sm_80 mainloops) and with a window, each
 * row's sink counted once; lse is then the log of the whole denominator.
 *
 * kvp_prefill_plan (once per step, on the host copies of qo_indptr and
 * kv_lens) checks the batch, picks the route (a batch, windowed or not,
 * whose every sequence brings the same q_len new tokens runs the decode
 * kernel when q_len is 1, or q_len * (num_q_heads / num_kv_heads) <= 16 --
 * speculative verification, multi-token prediction -- unless flags say
 * KVP_PREFILL_NO_DECODE_ROUTE) and, for the prefill route, enqueues a small
 * kernel that writes the work list into the workspace. In a mixed batch
 * (some sequences of one new token, others longer), the
 * prefill route leaves the one-token sequences to a decode launch that
 * kvp_paged_prefill adds (found through the device qo_indptr, split as
 * decode splits), instead of a prefill row tile each that their group
 * alone would fill; KVP_PREFILL_NO_DECODE_ROUTE keeps them on the prefill
 * kernel too. It fills a
 * kvp_attn_plan, a plain struct the engine keeps (and may copy) until the
 * step ends. kvp_paged_prefill (per layer) checks the layer's tensors against
 * the plan and enqueues one kernel (two for a split decode; the decode
 * rows of a mixed batch add one or two): no host work
 * beyond that, no allocation, no synchronisation. Graph capture: the prefill
 * route's launch has a fixed grid and reads the work list from the
 * workspace, so a captured run replays correctly for any later plan of the
 * same shape, route and num_splits planned into the same workspace (plan
 * outside the graph, before each replay, on the replay's stream); the decode
 * route's launch also depends on batch. Split-KV: when a batch's row tiles
 * fill less than half of the GPU (a short chunk over a long prefix), the
 * plan cuts each tile's K/V range into up to 8 runs whose partial states a
 * second kernel merges, as many as the workspace holds; flags
 * KVP_PREFILL_NO_SPLIT_KV (with KVP_PREFILL_NO_DECODE_ROUTE) keep every plan
 * on one prefill launch, for graphs that must serve any batch. The device
 * copies of qo_indptr and kv_lens must hold the host copies' values until
 * the step's runs have executed; the block table's contents are the caller's obligation as in
 * decode. The workspace belongs to one plan at a time: plan again only after
 * the previous plan's runs are enqueued on the same stream (or have
 * finished). A run of a prefill-route plan whose workspace a later plan has
 * since written another work list into (another batch, mainloop, split
 * count or decode routing), or a split decode launch its partials
 * (kvp_paged_decode, a decode-route plan's run), answers INVALID_ARGUMENT
 * ("stale plan"; 0.6 ran it over what was there); a later plan of the same
 * batch and flags writes the same list, and the earlier plan still runs. A plan's runs
 * must not overlap each other in time (enqueue them on one stream, as the
 * layers of a step are): besides split partials, the Hopper kernel's
 * blocks take work from a counter in the workspace, which each run leaves
 * at zero for the next. */
#define KVP_ATTN_PLAN_PREFILL 1       /* kvp_attn_plan.kind */
#define KVP_ATTN_ROUTE_PREFILL 1      /* kvp_attn_plan.route: prefill kernel */
#define KVP_ATTN_ROUTE_DECODE 2       /* one short q_len for all (see above): decode kernel */
#define KVP_PREFILL_NO_DECODE_ROUTE 1 /* kvp_prefill_plan_args.flags */
#define KVP_PREFILL_NO_SPLIT_KV 2     /* kvp_prefill_plan_args.flags */
#define KVP_PREFILL_NO_HOPPER 4       /* kvp_prefill_plan_args.flags: sm_80 kernel on Hopper too */
/* KVP_PREFILL_FP8_QKV: the fast FP8 mode of the Hopper mainloop, for runs
 * over an e4m3 cache (KVP_DTYPE_E4M3 in kvp_paged_kv). The default reads
 * such a cache by widening its K and V to q's 16-bit type on their way into
 * shared memory (the accurate mode). With this flag each query row is
 * quantised to e4m3 (one scale a row, from its largest magnitude) and both
 * products run on the 8-bit tensor cores: the K scales multiply the scores
 * in fp32; the V scales are folded into the softmax probabilities before
 * they are quantised, and the row sums add the quantised values, so a row's
 * weights still sum to one; each K/V tile's P V product is added to the
 * output in fp32 (two-level accumulation), so a lone strong token in a long
 * context is not lost to the 8-bit products' accumulation. Against a 16-bit
 * cache its error is about 1.4x the accurate mode's (bench/RESULTS.md). The
 * plan answers KVP_ERR_UNSUPPORTED for head_dim other than 128 or off Hopper (compute
 * capability 9.0), INVALID_ARGUMENT with KVP_PREFILL_NO_HOPPER; a run of such
 * a plan over a 16-bit cache answers INVALID_ARGUMENT. A batch that takes
 * the decode route is unaffected. */
#define KVP_PREFILL_FP8_QKV 8         /* kvp_prefill_plan_args.flags */
/* A prefill plan's plan-state words: the prefill kernel it was planned for
 * (0: sm_80, 1: Hopper's sm_90a, 2: its FP8 Q/K/V mode); the decode rows of a mixed batch (see
 * kvp_prefill_plan): their sequences | the decode launch's splits << 32, 0
 * when the prefill kernel takes every row; the device qo_indptr the decode
 * launch reads. */
#define KVP_ATTN_PLAN_STATE_WORDS 6 /* kvp_attn_plan.state: fixed within a major version */
#define KVP_PLAN_STATE_MAINLOOP 0
#define KVP_PLAN_STATE_DECODE_ROWS 1
#define KVP_PLAN_STATE_DECODE_INDEX 2
#define KVP_PLAN_STATE_WORK_LIST 3 /* a fingerprint of the work list the plan wrote into its workspace */

typedef struct kvp_prefill_plan_args {
  size_t struct_size; /* sizeof(kvp_prefill_plan_args) */
  int32_t dtype;      /* kvp_dtype of q, the caches and out */
  int32_t head_dim;   /* 64, 128 or 256 */
  int32_t num_q_heads;
  int32_t num_kv_heads; /* divides num_q_heads */
  int32_t batch;        /* sequences, in [0, 65535] */
  int32_t window_size;  /* 0 (default): no window; w > 0: tokens [pos - w + 1, pos] */
  int32_t flags;        /* 0 or KVP_PREFILL_NO_DECODE_ROUTE | KVP_PREFILL_NO_SPLIT_KV | KVP_PREFILL_NO_HOPPER | KVP_PREFILL_FP8_QKV */
  int32_t reserved;     /* must be 0 */
  const int32_t *qo_indptr_host; /* host [batch + 1]: 0, non-decreasing */
  const int32_t *kv_lens_host;   /* host [batch]: kv_lens[b] >= q_len_b */
  uint64_t qo_indptr;            /* device int32 [batch + 1], the same values */
  uint64_t kv_lens;              /* device int32 [batch], the same values */
  uint64_t workspace;            /* device, 16-byte aligned, kvp_prefill_workspace_size bytes */
  uint64_t workspace_bytes;
} kvp_prefill_plan_args;

#define KVP_PREFILL_PLAN_ARGS_INIT KVP_STRUCT_INIT(kvp_prefill_plan_args)

/* A planned batch. Filled by kvp_prefill_plan (the caller sets struct_size
 * only); the fields are for reading: kvp_paged_prefill checks them but
 * cannot tell a consistent edit from the library's values. `kind` says which
 * planner wrote it (room for other plans, e.g. a shared-prefix one, in the
 * same struct). */
typedef struct kvp_attn_plan {
  size_t struct_size; /* sizeof(kvp_attn_plan) */
  int32_t kind;       /* KVP_ATTN_PLAN_PREFILL; 0 = not planned */
  int32_t route;      /* KVP_ATTN_ROUTE_* */
  int32_t dtype;
  int32_t head_dim;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t window_left; /* -1: no window; else window_size - 1 */
  int32_t batch;
  int32_t total_q;    /* qo_indptr[batch] */
  int32_t max_q_len;
  int32_t max_kv_len;
  int32_t num_items;  /* prefill route: work items (row tiles) */
  int32_t grid;       /* prefill route: blocks of the launch */
  int32_t num_splits; /* split-KV count of either route (prefill: at most 8) */
  uint64_t workspace;
  uint64_t workspace_bytes;
  uint64_t kv_lens;   /* device */
  /* The plan's state, opaque to the host: the words KVP_PLAN_STATE_*,
   * whose meaning the plan's kind gives (a prefill plan's below; a cascade
   * plan's in the shared-prefix section). The calls that take the plan
   * read it back: copy it with the plan, never edit it. (Named `reserved`
   * before 0.4; same words.) */
  uint64_t state[KVP_ATTN_PLAN_STATE_WORDS];
} kvp_attn_plan;

#define KVP_ATTN_PLAN_INIT KVP_STRUCT_INIT(kvp_attn_plan)

/* One layer's tensors for a planned batch. q and out are
 * [total_q, num_q_heads, head_dim]; the cache and table as in decode. */
typedef struct kvp_paged_prefill_args {
  size_t struct_size; /* sizeof(kvp_paged_prefill_args) */
  int32_t num_blocks;
  int32_t block_size;
  int32_t max_blocks_per_seq; /* block table columns read; * block_size >= max kv_len */
  int32_t reserved;           /* must be 0 */
  uint64_t q;
  int64_t q_token_stride;
  int64_t q_head_stride;
  uint64_t k_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
  uint64_t v_cache; /* same strides as k_cache */
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  int64_t cache_head_stride;
  uint64_t block_table;       /* int32 [batch, block_table_stride] */
  int64_t block_table_stride; /* >= max_blocks_per_seq */
  uint64_t out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  uint64_t lse; /* float32 [total_q, num_q_heads] contiguous; 0 = not wanted */
  float scale;  /* softmax scale, finite, >= 0; 0 = 1/sqrt(head_dim) */
  int32_t reserved2; /* must be 0 */
  const kvp_paged_kv *kv; /* appended in 0.4: the cache and block table (see kvp_paged_kv);
                             NULL = the fields above */
  uint64_t sinks;         /* appended in 0.6: float32 [num_q_heads] device pointer (attention
                             sinks, see kvp_paged_decode_args); 0 = none. kvp_paged_cascade
                             takes them too */
} kvp_paged_prefill_args;

#define KVP_PAGED_PREFILL_ARGS_INIT KVP_STRUCT_INIT(kvp_paged_prefill_args)

#ifndef KVPLUG_NO_PROTOTYPES
/* *out = 1 when the CUDA driver loads and at least one device exists, else
 * 0. Errors: NULL_POINTER. */
kvp_status kvp_cuda_available(int32_t *out);

/* Loads the kernels into the calling thread's current context (device 0's
 * primary context when none is current) if not loaded yet. Launches do it on
 * first use; call this before capturing a CUDA graph.
 * Errors: NO_DEVICE, UNSUPPORTED (a build without kernels, or a GPU older
 * than sm_80), CUDA. */
kvp_status kvp_attn_prepare(void);

/* *out_bytes = the decode workspace for batches of up to max_batch
 * sequences with up to max_splits splits (0 = the library's default
 * ceiling, 32). Allocate it once (device memory, 16-byte aligned) and pass
 * it with every kvp_paged_decode. 0 when max_splits is 1. Needs no GPU.
 * Errors: NULL_POINTER, INVALID_ARGUMENT, UNSUPPORTED (head_dim). */
kvp_status kvp_attn_workspace_size(int32_t max_batch, int32_t num_q_heads, int32_t head_dim,
                                   int32_t max_splits, uint64_t *out_bytes);

/* *out = the split count kvp_paged_decode chooses (num_splits = 0) for this
 * batch shape on the current context's device, before capping it to the
 * workspace: compute it once per step and pass it as num_splits to every
 * layer, or leave num_splits 0. dtype is the call's, or KVP_DTYPE_E4M3 for
 * a decode over an e4m3 cache (whose kernel holds more blocks per SM).
 * Errors: NULL_POINTER, INVALID_ARGUMENT, NO_DEVICE, CUDA. */
kvp_status kvp_attn_num_splits(int32_t dtype, int32_t head_dim, int32_t batch, int32_t num_q_heads,
                               int32_t num_kv_heads, int32_t max_seq_len, int32_t *out);

/* Enqueues the KV write on stream. */
kvp_status kvp_kv_write(const kvp_kv_write_args *args, uint64_t stream);

/* Enqueues paged decode attention on stream (one kernel, or two with
 * split-KV). */
kvp_status kvp_paged_decode(const kvp_paged_decode_args *args, uint64_t stream);

/* Enqueues the merge of attention states on stream. */
kvp_status kvp_merge_states(const kvp_merge_states_args *args, uint64_t stream);

/* *out_bytes = the workspace kvp_prefill_plan needs for batches of up to
 * max_batch sequences and max_tokens query tokens in all, on either route.
 * Allocate it once (device memory, 16-byte aligned). Needs no GPU.
 * Errors: NULL_POINTER, INVALID_ARGUMENT, UNSUPPORTED (head_dim). */
kvp_status kvp_prefill_workspace_size(int32_t max_batch, int32_t max_tokens, int32_t num_q_heads,
                                      int32_t num_kv_heads, int32_t head_dim, uint64_t *out_bytes);

/* Plans a batch (see kvp_prefill_plan_args) and, on the prefill route,
 * enqueues the work-list kernel on stream. On error *plan is left as it was.
 * Errors: NULL_POINTER, STRUCT_SIZE, INVALID_ARGUMENT (offsets not from 0 or
 * decreasing, a q_len above its kv_len, shapes, flags, alignment),
 * UNSUPPORTED, BUFFER_TOO_SMALL (the workspace), NO_DEVICE, CUDA. */
kvp_status kvp_prefill_plan(const kvp_prefill_plan_args *args, kvp_attn_plan *plan, uint64_t stream);

/* Enqueues attention of a planned batch over one layer on stream.
 * Errors: NULL_POINTER, STRUCT_SIZE, INVALID_ARGUMENT (a plan not written by
 * kvp_prefill_plan, a block table shorter than the longest sequence, shapes,
 * strides, alignment), BUFFER_TOO_SMALL, UNSUPPORTED, NO_DEVICE, CUDA. */
kvp_status kvp_paged_prefill(const kvp_attn_plan *plan, const kvp_paged_prefill_args *args, uint64_t stream);
#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: attention kernels (end) ==== */

/* ==== section: shared-prefix attention (begin) ==== */
/*
 * Decode attention for batches whose sequences share KV blocks (a system
 * prompt shared by all, few-shot blocks shared by a group, forks of parallel
 * sampling or beam search sharing all but their tails): each shared run of
 * blocks is read once per step for the queries of every sequence that holds
 * it (batched through the tensor cores), each sequence's own tail once, and
 * the partial states are merged by log-sum-exp weights. The result is plain
 * decode attention (kvp_paged_decode) over each sequence's tokens.
 *
 * Varlen queries (kvp_cascade_plan_args.qo_indptr_host): new prompts or
 * chunks that share a cached prefix, mixed with decode rows. A shared run
 * ends before the first query token of every member (so every query token
 * of a member sees all of it: no mask), its K/V is read once for the query
 * tokens of all members, each sequence's own part (its cached tokens after
 * the shared runs and its new ones, causal over the new ones) once, and the
 * states of each query row are merged: the result is kvp_paged_prefill's.
 * Sharing pays there when it saves more K/V reads (the prefill kernel
 * reads a sequence's tokens once per 64-row tile of its query rows) than
 * the partial states cost; otherwise the plan's route is
 * KVP_ATTN_ROUTE_PREFILL, the prefill kernel, planned into the same
 * workspace.
 *
 * kvp_cascade_plan (once per step, or less: see kvp_cascade_update) reads
 * the batch's block table and lengths on the host, finds the tree of block
 * runs that two or more sequences hold in the same columns (whole blocks
 * within every holder's length), decides whether sharing pays (otherwise the
 * plan's route is plain decode, unless KVP_CASCADE_NO_DECODE_ROUTE), writes
 * the plan into the host workspace and enqueues its copy into the device
 * workspace on stream. kvp_paged_cascade (per layer) enqueues two kernels
 * (attention over the plan's work items, then the merge) or, on the decode
 * route, kvp_paged_decode's launch. Both workspaces are the engine's,
 * allocated once at the sizes kvp_cascade_workspace_size gives for a
 * capacity max_batch; plan with the same max_batch every step.
 *
 * Graph capture: the cascade route's launches have fixed grids and read the
 * plan from the device workspace, and a tail's end is read from the device
 * seq_lens, so a captured kvp_paged_cascade replays correctly for every later
 * cascade-route plan into the same workspaces (plan outside the graph,
 * before the replay, on the replay's stream; KVP_CASCADE_NO_DECODE_ROUTE
 * keeps every plan on that route). kvp_cascade_update checks on the host, in
 * O(batch), that a step whose sequences only grew still fits the plan (each
 * tail within the chunks planned for it, headroom tokens by default 64):
 * then nothing needs planning or copying.
 *
 * Caller's obligations the library cannot see: the device seq_lens and the
 * device block table hold the host copies' values when the runs execute
 * (lengths may grow as kvp_cascade_update allows); the columns a plan found
 * shared are not changed in any holder's row without a new plan; the host
 * workspace is not planned into again until the previous plan's copy has
 * executed (pinned memory) and the device workspace not until the previous
 * plan's runs have been enqueued on the same stream before the new copy.
 * A plan's runs must not overlap each other in time (enqueue them on one
 * stream, as the layers of a step are): they write the same partial states,
 * and on Hopper the first kernel's blocks take work from a counter in the
 * device workspace, which each run leaves at zero for the next.
 * What it can see is refused: a plan that does not fit the workspaces
 * (BUFFER_TOO_SMALL), a layer whose block size or table differ from the
 * plan's, a plan older than the workspaces' latest (INVALID_ARGUMENT).
 *
 * A cascade plan's kvp_attn_plan: kind KVP_ATTN_PLAN_CASCADE; route
 * KVP_ATTN_ROUTE_CASCADE, KVP_ATTN_ROUTE_DECODE or (varlen queries)
 * KVP_ATTN_ROUTE_PREFILL; batch; total_q (batch in decode); max_q_len;
 * max_kv_len the longest planned length (tail capacities included);
 * num_items, grid (and num_splits on the prefill route); kv_lens = the
 * device seq_lens; and the plan state in state[KVP_PLAN_STATE_*]: the
 * words below. f16 and bf16. kvp_cascade_update and kvp_paged_cascade read
 * the host workspace that state[KVP_PLAN_STATE_HOST_WORKSPACE] names:
 * pass plans as kvp_cascade_plan wrote them (copies are fine; an edited
 * address is undefined behaviour, as any bad pointer).
 */
#define KVP_PLAN_STATE_HOST_WORKSPACE 0       /* the host workspace's address */
#define KVP_PLAN_STATE_HOST_WORKSPACE_BYTES 1 /* its bytes */
#define KVP_PLAN_STATE_CAPACITY 2     /* max_batch | block_size << 32 */
#define KVP_PLAN_STATE_GENERATION 3   /* partial states | plan generation << 32 */
#define KVP_PLAN_STATE_SAVED_TOKENS 4 /* KV tokens per kv head the shared reads save this step */
#define KVP_PLAN_STATE_TOTAL_TOKENS 5 /* KV tokens per kv head plain decode would read */
#define KVP_ATTN_PLAN_CASCADE 2       /* kvp_attn_plan.kind */
#define KVP_ATTN_ROUTE_CASCADE 3      /* kvp_attn_plan.route: the cascade kernels */
#define KVP_CASCADE_NO_DECODE_ROUTE 1 /* kvp_cascade_plan_args.flags */
#define KVP_CASCADE_NO_HOPPER 4       /* kvp_cascade_plan_args.flags: plan for the sm_80 kernels on Hopper too
                                         (an e4m3 cache's plans; since 0.6) */
#define KVP_CASCADE_MAX_PARTS 16      /* partial states per sequence (bounds the workspaces) */
#define KVP_CASCADE_PREFILL_PARTS 2   /* partial states provided per query row beyond one per sequence */

typedef struct kvp_cascade_plan_args {
  size_t struct_size; /* sizeof(kvp_cascade_plan_args) */
  int32_t dtype;      /* kvp_dtype: F16 or BF16 */
  int32_t head_dim;   /* 64, 128 or 256 */
  int32_t num_q_heads;
  int32_t num_kv_heads; /* divides num_q_heads */
  int32_t batch;        /* sequences, in [0, max_batch] */
  int32_t max_batch;    /* the workspaces' capacity; 0 = batch */
  int32_t block_size;   /* 0 = 16 */
  int32_t max_blocks_per_seq;     /* block table columns read */
  int64_t block_table_stride;     /* >= max_blocks_per_seq; 0 = max_blocks_per_seq */
  const int32_t *block_table_host; /* host [batch, block_table_stride] */
  const int32_t *seq_lens_host;    /* host [batch], this step's token included */
  uint64_t seq_lens;               /* device int32 [batch], the same values */
  void *host_workspace;            /* host, 4-byte aligned (pinned: the copy is asynchronous) */
  uint64_t host_workspace_bytes;
  uint64_t workspace;              /* device, 16-byte aligned */
  uint64_t workspace_bytes;
  int32_t flags;                   /* 0 or KVP_CASCADE_NO_DECODE_ROUTE | KVP_CASCADE_NO_HOPPER */
  int32_t headroom;                /* tokens each tail may grow before a new plan is needed; 0 = 64 */
  /* Appended after the first release: varlen queries (prefill, chunks and
   * decode rows mixed).
   * NULL (default): one query token per sequence (decode). Otherwise
   * sequence b has query rows [qo_indptr[b], qo_indptr[b+1]) of q/out at
   * positions [seq_lens[b] - q_len, seq_lens[b]), causal, as
   * kvp_prefill_plan_args has them. */
  const int32_t *qo_indptr_host; /* host [batch + 1]: 0, non-decreasing, q_len <= seq_lens */
  uint64_t qo_indptr;            /* device int32 [batch + 1], the same values (with qo_indptr_host) */
  int32_t max_tokens;            /* the workspaces' query-row capacity; 0 = max_batch */
  int32_t reserved;              /* must be 0 */
} kvp_cascade_plan_args;

#define KVP_CASCADE_PLAN_ARGS_INIT KVP_STRUCT_INIT(kvp_cascade_plan_args)

#ifndef KVPLUG_NO_PROTOTYPES
/* *device_bytes and *host_bytes = the workspaces kvp_cascade_plan needs for
 * decode batches of up to max_batch sequences. Needs no GPU.
 * Errors: NULL_POINTER, INVALID_ARGUMENT, UNSUPPORTED (head_dim). */
kvp_status kvp_cascade_workspace_size(int32_t max_batch, int32_t num_q_heads, int32_t num_kv_heads,
                                      int32_t head_dim, uint64_t *device_bytes, uint64_t *host_bytes);

/* The same for batches with varlen queries: up to max_batch sequences and
 * max_tokens (>= max_batch) query rows in all; plan with
 * kvp_cascade_plan_args.max_tokens = max_tokens. The partial states take
 * num_q_heads * (head_dim + 1) * 4 bytes for each of KVP_CASCADE_MAX_PARTS
 * per sequence and KVP_CASCADE_PREFILL_PARTS per further query row (a
 * shared level and the tail); a plan that needs more takes the plain route
 * (or fails with BUFFER_TOO_SMALL under KVP_CASCADE_NO_DECODE_ROUTE).
 * max_tokens = max_batch gives kvp_cascade_workspace_size's sizes. Needs no
 * GPU. Errors: NULL_POINTER, INVALID_ARGUMENT, UNSUPPORTED (head_dim). */
kvp_status kvp_cascade_prefill_workspace_size(int32_t max_batch, int32_t max_tokens, int32_t num_q_heads,
                                              int32_t num_kv_heads, int32_t head_dim, uint64_t *device_bytes,
                                              uint64_t *host_bytes);

/* Plans a decode batch (see kvp_cascade_plan_args) into the workspaces and
 * fills *plan (the caller sets plan->struct_size only). On the cascade route
 * it enqueues the plan's copy to the device workspace on stream. On an
 * argument or planning error *plan and the workspaces are left as they
 * were. The exception (as the header's atomicity rule allows): when the
 * device work cannot be enqueued (CUDA, NO_DEVICE: the copy, or on the
 * prefill route the plan kernel), *plan is unchanged but the host workspace
 * already holds the new plan and the device workspace part of it; plan
 * again before any launch that reads them.
 * Errors: NULL_POINTER, STRUCT_SIZE, INVALID_ARGUMENT (shapes, a length
 * outside [0, max_blocks_per_seq * block_size], flags, alignment, query
 * tokens times num_q_heads / num_kv_heads past 2^31-1), UNSUPPORTED (dtype,
 * head_dim), BUFFER_TOO_SMALL (a workspace, batch above max_batch),
 * NO_DEVICE, CUDA. */
kvp_status kvp_cascade_plan(const kvp_cascade_plan_args *args, kvp_attn_plan *plan, uint64_t stream);

/* For a step whose sequences only grew: *fits = 1 when the cascade plan
 * still covers the lengths seq_lens_host[batch] (nothing to plan or copy;
 * update the device seq_lens as usual), 0 when it needs kvp_cascade_plan
 * again. O(batch), host only; a decode-route plan always fits, a plan with
 * varlen queries (qo_indptr_host) of other than one token each never does
 * (the next step's queries differ; 0.7 answered 1 for one of 0 tokens
 * beside one of 2). plan->
 * max_kv_len is unchanged. Errors: NULL_POINTER, STRUCT_SIZE,
 * INVALID_ARGUMENT (not a cascade plan, batch differs from the plan's, a
 * stale plan). */
kvp_status kvp_cascade_update(const kvp_attn_plan *plan, const int32_t *seq_lens_host, int32_t batch,
                              int32_t *fits);

/* Enqueues shared-prefix attention of a planned batch over one layer on
 * stream: q and out [total_q, num_q_heads, head_dim] (total_q = batch in
 * decode) with q_token_stride and out_token_stride between query rows; the
 * cache and the block table as in decode; lse [total_q, num_q_heads]
 * optional; args->sinks as in kvp_paged_prefill (the merge of each row's
 * partial states adds its sink once). On the prefill route it runs kvp_paged_prefill's kernel.
 * An e4m3 (FP8) cache (args->kv, as kvp_paged_prefill takes it) is read by
 * the kernels the plan was cut for, as a 16-bit one: on a Hopper GPU the
 * shared items and the prefill route on the wgmma mainloop, whose producer
 * widens the e4m3 tiles. Errors: NULL_POINTER, STRUCT_SIZE,
 * INVALID_ARGUMENT (a plan not written by kvp_cascade_plan, a stale plan, a
 * block size other than the plan's, a table shorter than the plan's
 * lengths, shapes, strides, alignment), UNSUPPORTED, NO_DEVICE, CUDA. */
kvp_status kvp_paged_cascade(const kvp_attn_plan *plan, const kvp_paged_prefill_args *args, uint64_t stream);

/* Plans the batch seq_ids[n] of manager m (the ids the step's
 * kvp_manager_describe takes, in the same order: row i of the plan is
 * seq_ids[i]) from the manager's own block tables and lengths, in one call:
 * the host needs no table of its own. The plan, the workspaces and *plan
 * are exactly what kvp_cascade_plan gives for the block table and lengths
 * kvp_manager_describe(m, seq_ids, n, ..., max_blocks_per_seq, ...) writes,
 * and args are its args (varlen queries included) except:
 *   batch               0 or n;
 *   block_size          0 or the manager's;
 *   max_blocks_per_seq  required: the columns of the device block table the
 *                       runs will read (a sequence with more blocks gives
 *                       BUFFER_TOO_SMALL, as describe does);
 *   block_table_host, seq_lens_host  NULL (INVALID_ARGUMENT otherwise);
 *   block_table_stride  not read.
 * The run (kvp_paged_cascade) still needs the device block table and
 * seq_lens holding describe's values: describe the batch as usual for them.
 * Ids may repeat (as in describe); n = 0 plans an empty batch (seq_ids may
 * then be NULL). The manager is locked only while its tables are read (a
 * copy of each row's blocks into library memory, never the caller's), so
 * the call is as thread-safe as the manager's functions; planning into one
 * pair of workspaces from several threads at once is not.
 *
 * Host only: with workspace 0 and host_workspace NULL the batch is planned
 * on the host for its summary alone, with no device or workspace needed
 * (seq_lens and qo_indptr are not read; qo_indptr_host is, and max_batch
 * and max_tokens default to the batch's sequences and query rows): *plan
 * gets kind, route, batch, total_q, max_q_len, max_kv_len, num_items and
 * the plan-state words KVP_PLAN_STATE_CAPACITY to KVP_PLAN_STATE_TOTAL_TOKENS
 * as a device plan would (the chunking of an H100, 264 resident blocks; the
 * route and the saved and total tokens do not depend on
 * the device; num_items is 0 on the prefill route, whose work list the
 * device plans), and grid, num_splits, workspace, workspace_bytes,
 * kv_lens and the host workspace's words 0. Such a plan names no
 * workspace: kvp_cascade_update and kvp_paged_cascade refuse it
 * (INVALID_ARGUMENT). Use it to measure a batch's sharing on any machine:
 * shared-prefix attention reads total - saved KV tokens per kv head
 * (state[KVP_PLAN_STATE_TOTAL_TOKENS] and [KVP_PLAN_STATE_SAVED_TOKENS])
 * where plain attention reads total (a step on the decode or prefill
 * route, which the planner takes where its cost model predicts sharing
 * not to pay, reads total). With one workspace given, the call is
 * kvp_cascade_plan's and fails for the other.
 *
 * On error *plan and the workspaces are left as they were.
 * Errors: INVALID_HANDLE, NULL_POINTER (args, plan, seq_ids with n > 0),
 * INVALID_ARGUMENT (n outside [0, 65535], the fields above, n *
 * max_blocks_per_seq above 2^28), UNKNOWN_SEQUENCE, BUFFER_TOO_SMALL, and
 * kvp_cascade_plan's. */
kvp_status kvp_manager_cascade_plan(kvp_manager *m, const int64_t *seq_ids, int32_t n,
                                    const kvp_cascade_plan_args *args, kvp_attn_plan *plan, uint64_t stream);
#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: shared-prefix attention (end) ==== */

/* ==== section: virtual-contiguous KV cache (begin) ==== */
/*
 * A kvp_vcache is a KV cache in contiguous virtual memory (vAttention). Each
 * layer's K and each layer's V is one dense virtual tensor
 *
 *     [max_batch][max_context][num_kv_heads][head_dim]   (dtype_bytes elements)
 *
 * reserved at creation; physical pages are mapped into it only as request
 * slots grow, so unmodified attention kernels (FlashAttention's plain
 * kernels, torch SDPA) index it like any dense tensor, with no block table.
 *
 * Strides. The per-slot region is padded up to a whole number of pages, so
 * that each slot maps independently: the slot (batch) stride is NOT
 * max_context * num_kv_heads * head_dim in general. Get the real strides
 * from kvp_vcache_strides() and pass them to kernels (torch.as_strided,
 * DLPack strides, or a kernel's batch-stride argument).
 *
 * Use per engine step: kvp_vcache_alloc_slot() for each admitted request
 * (it returns a slot in [0, max_batch), the request's row of every tensor),
 * kvp_vcache_step() with every running slot's context length before the
 * step's first kernel (the tokens it will hold after this step's writes),
 * kvp_vcache_free_slot() when a request ends. step() guarantees that tokens
 * [0, ctx_len) of each listed slot are backed in every layer's K and V;
 * touching memory beyond that is a GPU fault, as with any unmapped address.
 *
 * Background mapping (on by default): after each step a library thread maps
 * each slot's pages for ctx_len + lookahead_tokens while the GPU runs the
 * step, so the next step usually maps nothing on the critical path.
 * Deferred reclamation: a freed slot keeps its pages, and alloc_slot hands
 * out the freed slot with the most pages first; freed slots' pages are
 * reclaimed when the budget left falls under reclaim_below_bytes, or when a
 * step needs them.
 *
 * Physical memory is counted in page groups: one page in each of the
 * 2 * num_layers tensors. The CUDA backend uses the device's primary context
 * (the CUDA runtime's and PyTorch's), so the pointers work in the engine's
 * kernels on that device.
 *
 * Thread-safety: all functions on one kvp_vcache are safe to call from
 * several threads (an internal lock serialises them), except destroy.
 */
typedef struct kvp_vcache kvp_vcache;

typedef enum kvp_vmem_backend {
  KVP_VMEM_CUDA = 0, /* CUDA virtual memory management on `device` */
  KVP_VMEM_HOST = 1  /* host memory (PROT_NONE reservation, memfd pages; Linux): the
                        same semantics on the CPU, for tests and tools. Pages
                        mapped side by side share one kernel mapping; the
                        backend uses at most half of the mappings
                        vm.max_map_count leaves free and answers
                        OUT_OF_MEMORY past that */
} kvp_vmem_backend;

typedef struct kvp_vcache_config {
  size_t struct_size;          /* sizeof(kvp_vcache_config) */
  int32_t backend;             /* kvp_vmem_backend; default KVP_VMEM_CUDA */
  int32_t device;              /* CUDA device ordinal; default 0 */
  int32_t num_layers;          /* layers on this device, in [1, 4096]; no default */
  int32_t num_kv_heads;        /* KV heads on this device, in [1, 4096]; no default */
  int32_t head_dim;            /* in [1, 4096]; no default */
  int32_t dtype_bytes;         /* bytes per element: 1, 2, 4 or 8; 0 = 2 */
  int32_t max_batch;           /* request slots, in [1, 65536]; no default */
  int32_t max_context;         /* tokens per slot, in [1, 2^30]; no default */
  int64_t page_size;           /* physical page bytes, a multiple of the backend's
                                  granularity (2 MiB for CUDA, the OS page for host);
                                  0 (default) = the granularity */
  int64_t budget_bytes;        /* most physical memory the cache holds; at least one
                                  page per tensor (2 * num_layers * page_size); capped
                                  at 2^26 pages in all (stats report the budget in
                                  force); no default */
  int64_t reclaim_below_bytes; /* reclaim freed slots' pages when the budget left falls
                                  under this; 0 (default) = budget_bytes / 8;
                                  negative = only when a step needs them */
  int32_t lookahead_tokens;    /* tokens mapped ahead of each slot's context by the
                                  background thread; 0 = default (16) */
  int32_t no_background;       /* 0 (default): map ahead on a background thread;
                                  nonzero: step maps everything itself */
} kvp_vcache_config;

#define KVP_VCACHE_CONFIG_INIT KVP_STRUCT_INIT(kvp_vcache_config)

/* A snapshot of a cache's state and counters. */
typedef struct kvp_vcache_stats {
  size_t struct_size;         /* set by the caller: sizeof(kvp_vcache_stats) */
  int64_t page_size;          /* bytes of one physical page */
  int64_t budget_bytes;       /* the budget, rounded down to whole page groups */
  int64_t tensor_bytes;       /* virtual size of each K or V tensor */
  int64_t mapped_bytes;       /* mapped into slots (active and freed) */
  int64_t held_bytes;         /* physical memory held: mapped, idle or in flight */
  int32_t active_slots;       /* allocated slots */
  int32_t reusable_slots;       /* freed slots still holding pages */
  int64_t steps;              /* successful kvp_vcache_step calls */
  int64_t map_calls;          /* pages mapped */
  int64_t unmap_calls;        /* pages unmapped */
  int64_t create_calls;       /* pages created */
  int64_t release_calls;      /* pages released */
  int64_t out_of_memory;      /* steps refused with KVP_ERR_OUT_OF_MEMORY */
  int64_t step_map_ns;        /* time steps spent mapping (on the critical path) */
  int64_t step_wait_ns;       /* time steps waited for the background on their slots */
  int64_t background_map_ns;  /* time the background thread spent mapping and unmapping */
  int64_t background_errors;  /* failed background jobs (step redoes them) */
} kvp_vcache_stats;

#define KVP_VCACHE_STATS_INIT KVP_STRUCT_INIT(kvp_vcache_stats)

#ifndef KVPLUG_NO_PROTOTYPES

/* Creates a cache: reserves 2 * num_layers virtual tensors, maps nothing.
 * Errors: NULL_POINTER, STRUCT_SIZE, INVALID_ARGUMENT (a field out of range,
 * a budget under one page group, more than 2^47 bytes per tensor),
 * NO_DEVICE (no driver or no such device), UNSUPPORTED (the device lacks
 * virtual memory management; the host backend off Linux), OUT_OF_MEMORY
 * (the address space cannot hold the reservations), CUDA. */
kvp_status kvp_vcache_create(const kvp_vcache_config *cfg, kvp_vcache **out);

/* Unmaps and releases all memory and frees the reservations; every pointer
 * from the cache becomes invalid. The GPU must be done with them. NULL is
 * a no-op. No other thread may use the handle during or after the call. */
void kvp_vcache_destroy(kvp_vcache *c);

/* The base addresses of layer's K and V tensors (CUdeviceptr for the CUDA
 * backend, host addresses for the host one). Constant for the cache's life.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (layer outside [0, num_layers)). */
kvp_status kvp_vcache_layer_ptrs(kvp_vcache *c, int32_t layer, uint64_t *k_ptr, uint64_t *v_ptr);

/* Writes the strides of every tensor's four dimensions, in elements:
 * strides[0] between slots (the padded per-slot region), strides[1] =
 * num_kv_heads * head_dim between tokens, strides[2] = head_dim, strides[3]
 * = 1. Errors: NULL_POINTER. */
kvp_status kvp_vcache_strides(kvp_vcache *c, int64_t strides[4]);

/* Allocates a request slot, preferring the freed slot that holds the most
 * pages. Errors: NULL_POINTER, OUT_OF_MEMORY (all max_batch slots in use). */
kvp_status kvp_vcache_alloc_slot(kvp_vcache *c, int32_t *slot);

/* Frees a slot; its pages stay mapped for reuse until reclaimed.
 * Errors: INVALID_ARGUMENT (out of range), NOT_FOUND (not allocated). */
kvp_status kvp_vcache_free_slot(kvp_vcache *c, int32_t slot);

/* Ensures tokens [0, ctx_lens[i]) of slots[i] are mapped in every layer's K
 * and V, for i < n, and starts background mapping ahead. Call it once per
 * step before the step's first kernel. When nothing needs mapping it costs
 * one comparison per slot. All or none: OUT_OF_MEMORY (the budget cannot
 * cover the batch even after reclaiming freed slots, the device is out of
 * memory, or the host backend's share of vm.max_map_count is used up) maps
 * nothing; the engine preempts a request and retries. A failed driver call
 * (CUDA) also unmaps what the call mapped (freed slots' pages it reclaimed
 * stay reclaimed); only if that unmapping fails too do slots grown before it
 * keep their pages. n = 0 is a no-op.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n outside [0, 2^20], a slot out of
 * range or listed twice, a length outside [0, max_context]), NOT_FOUND (a
 * slot not allocated), OUT_OF_MEMORY, CUDA. */
kvp_status kvp_vcache_step(kvp_vcache *c, const int32_t *slots, const int32_t *ctx_lens, int32_t n);

/* Unmaps every freed slot's pages and releases all idle pages to the
 * driver (to give memory back to the engine); waits for background work.
 * Errors: CUDA. */
kvp_status kvp_vcache_trim(kvp_vcache *c);

/* Fills *out with the cache's statistics.
 * Errors: NULL_POINTER, STRUCT_SIZE (out->struct_size < sizeof(size_t) + 8). */
kvp_status kvp_vcache_stats_get(kvp_vcache *c, kvp_vcache_stats *out);

#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: virtual-contiguous KV cache (end) ==== */

/* ==== section: standalone host store (begin) ==== */
/*
 * A standalone host store: the host tier's slot pool (the same
 * bookkeeping as a manager's host tier: fixed-size slots, each holding one
 * block under a 64-bit key, an LRU over resident blocks, pins for copies in
 * flight) without a kvp_manager, for an engine that keeps its own GPU block
 * manager and asks for host slots by key: vLLM's OffloadingManager
 * (kvplug.vllm) and SGLang's HiCache storage backend (kvplug.sglang). The
 * caller derives the keys (a hash of the engine's block hash; equal keys
 * mean equal blocks) and performs the copies itself.
 *
 * A key's slot is in one of three states (kvp_host_store_state):
 *   absent   (KVP_HOST_KEY_ABSENT)   no slot holds it;
 *   pending  (KVP_HOST_KEY_PENDING)  reserved by kvp_host_store_reserve: the
 *            copy into the slot is in flight; the slot is pinned and not
 *            readable; kvp_host_store_complete commits it (or gives it back);
 *   resident (KVP_HOST_KEY_RESIDENT) readable; evictable (least recently
 *            used first) while no pin is held on it.
 *
 * Ordering rules for the engine's copies, as for the manager's host tier:
 *   1. Write a slot only between the reserve that handed it out and the
 *      complete that ends it; complete only after the copy has finished.
 *   2. Read a slot only while holding a pin on it (kvp_host_store_pin ...
 *      kvp_host_store_unpin): a pinned slot is never evicted or reused.
 *
 * Bad input in the engine's terms: reserve skips keys the store holds
 * already (slot -1, counted in skipped_present) and refuses a batch the free
 * and evictable slots cannot cover as a whole (KVP_ERR_OUT_OF_BLOCKS,
 * nothing changed, counted in refused_full); pin reports slot -1 for a key
 * that is not resident (a miss); complete and unpin of a key they find
 * nothing to do for (never stored, or dropped by kvp_host_store_reset)
 * count it in stale and go on.
 *
 * Memory: with slot_bytes > 0 the library allocates num_slots slots of
 * slot_bytes (plain, unpinned host memory, zeroed), slot s at
 * base + s * slot_bytes (kvp_host_store_memory), freed by destroy;
 * kvp_host_store_write and kvp_host_store_read copy between it and the
 * caller's buffers. With slot_bytes 0 the store is bookkeeping only (the
 * engine's workers own the memory and index it by slot number).
 *
 * Threads: all functions on one store may be called from any thread; they
 * serialise on the store's lock. The caller's arrays must not change during
 * a call. Keys arrays hold n uint64 keys, n in [1, KVP_MAX_BATCH].
 */
typedef struct kvp_host_store kvp_host_store;

typedef struct kvp_host_store_config {
  size_t struct_size;  /* sizeof(kvp_host_store_config) */
  int32_t num_slots;   /* slots, in [1, 2^30]; no default (0) */
  int32_t reserved;    /* must be 0 */
  int64_t slot_bytes;  /* bytes of one slot, >= 0; 0 = no memory (bookkeeping
                          only); num_slots * slot_bytes <= 2^46 */
} kvp_host_store_config;

#define KVP_HOST_STORE_CONFIG_INIT KVP_STRUCT_INIT(kvp_host_store_config)

/* kvp_host_store_state's answers. */
#define KVP_HOST_KEY_ABSENT 0
#define KVP_HOST_KEY_PENDING 1
#define KVP_HOST_KEY_RESIDENT 2

/* Counters (since creation) and gauges of a store. */
typedef struct kvp_host_store_stats {
  size_t struct_size;      /* set by the caller: sizeof(kvp_host_store_stats) */
  int64_t reserves;        /* slots handed out by reserve */
  int64_t commits;         /* of which completed */
  int64_t aborts;          /* of which given back (failed copies) */
  int64_t refused_full;    /* keys of reserve batches refused: no room */
  int64_t skipped_present; /* keys reserve skipped: held already, or repeated */
  int64_t evictions;       /* resident blocks evicted to make room */
  int64_t hits;            /* keys found resident by lookup_prefix and pin */
  int64_t misses;          /* keys they did not find */
  int64_t stale;           /* keys complete or unpin found nothing to do for */
  int64_t resets;          /* kvp_host_store_reset calls */
  int32_t num_slots;       /* capacity */
  int32_t resident;        /* slots holding a committed block */
  int32_t pending;         /* slots reserved, their copy in flight */
  int32_t pinned;          /* slots with a pin (pending ones included) */
} kvp_host_store_stats;

#define KVP_HOST_STORE_STATS_INIT KVP_STRUCT_INIT(kvp_host_store_stats)

#ifndef KVPLUG_NO_PROTOTYPES
/* Creates a store. Errors: NULL_POINTER, STRUCT_SIZE, INVALID_ARGUMENT
 * (num_slots or slot_bytes out of range, reserved not 0), OUT_OF_MEMORY. */
kvp_status kvp_host_store_create(const kvp_host_store_config *cfg, kvp_host_store **out);

/* Destroys a store and frees its memory (no device copy may use it any
 * more). A kvp_host_store_write or _read running on another thread
 * finishes first; one that starts after it answers INVALID_HANDLE. NULL is
 * a no-op. */
void kvp_host_store_destroy(kvp_host_store *s);

/* For each of n keys: states[i] receives its state (KVP_HOST_KEY_*) and,
 * when slots is not NULL, slots[i] its slot (-1 when absent). Touches
 * nothing and counts nothing. Errors: NULL_POINTER (keys, states),
 * INVALID_ARGUMENT (n). */
kvp_status kvp_host_store_state(kvp_host_store *s, int32_t n, const uint64_t *keys,
                                int32_t *states, int32_t *slots);

/* *matched receives the number of keys, from the first, that are resident
 * (a prompt's prefix); they are marked recently used, the first most
 * recently. Pins nothing. Errors: NULL_POINTER, INVALID_ARGUMENT (n). */
kvp_status kvp_host_store_lookup_prefix(kvp_host_store *s, int32_t n, const uint64_t *keys,
                                        int32_t *matched);

/* Reserves a slot for each key the store does not hold: slots[i] receives
 * key i's slot, or -1 for a key held already (pending or resident) or
 * repeated in the batch. Room is made by evicting least recently used
 * unpinned resident blocks that are not keys of the batch; their keys are
 * written to evicted[0, *num_evicted) in eviction order (evicted has room
 * for n keys). All or none: OUT_OF_BLOCKS when the batch does not fit, with
 * nothing changed. Errors: NULL_POINTER, INVALID_ARGUMENT (n),
 * OUT_OF_BLOCKS. */
kvp_status kvp_host_store_reserve(kvp_host_store *s, int32_t n, const uint64_t *keys,
                                  int32_t *slots, uint64_t *evicted, int32_t *num_evicted);

/* Ends the copies into the pending keys of keys: committed (failed 0; the
 * block becomes resident, most recently used) or given back (failed
 * nonzero). Keys that are not pending count in stale. *num_completed (may
 * be NULL) receives how many were pending. Errors: NULL_POINTER (keys),
 * INVALID_ARGUMENT (n). */
kvp_status kvp_host_store_complete(kvp_host_store *s, int32_t n, const uint64_t *keys,
                                   int32_t failed, int32_t *num_completed);

/* Pins the slot of each resident key for a copy out of it: slots[i]
 * receives it, or -1 for a key that is not resident (a miss). Does not
 * touch the LRU. *num_pinned (may be NULL) receives how many it pinned;
 * each needs one kvp_host_store_unpin. Errors: NULL_POINTER (keys, slots),
 * INVALID_ARGUMENT (n). */
kvp_status kvp_host_store_pin(kvp_host_store *s, int32_t n, const uint64_t *keys,
                              int32_t *slots, int32_t *num_pinned);

/* Drops one pin of each pinned key; keys without a pin count in stale.
 * *num_unpinned (may be NULL) receives how many it unpinned.
 * Errors: NULL_POINTER (keys), INVALID_ARGUMENT (n). */
kvp_status kvp_host_store_unpin(kvp_host_store *s, int32_t n, const uint64_t *keys,
                                int32_t *num_unpinned);

/* Marks the resident keys of keys recently used, the first most recently;
 * other keys are ignored. Errors: NULL_POINTER, INVALID_ARGUMENT (n). */
kvp_status kvp_host_store_touch(kvp_host_store *s, int32_t n, const uint64_t *keys);

/* Drops every block, pending and pinned ones included (the caller
 * guarantees no device copy still uses them; a kvp_host_store_write or
 * _read running on another thread finishes first): later completes, pins
 * and unpins of the dropped keys are stale or misses. *num_dropped (may be
 * NULL) receives how many slots it freed. */
kvp_status kvp_host_store_reset(kvp_host_store *s, int32_t *num_dropped);

/* Fills *out with the store's statistics. Errors: NULL_POINTER,
 * STRUCT_SIZE. */
kvp_status kvp_host_store_stats_get(kvp_host_store *s, kvp_host_store_stats *out);

/* The store's memory: *base (NULL without memory), *slot_bytes and
 * *num_slots; outputs may be NULL. Valid until destroy. */
kvp_status kvp_host_store_memory(kvp_host_store *s, void **base, int64_t *slot_bytes,
                                 int32_t *num_slots);

/* Copies into the store: for each i of n, slot slots[i] (which must be
 * pending: reserved and not completed) receives the concatenation of
 * segments [i * segs, (i + 1) * segs) of ptrs (lengths in lens), which
 * must total slot_bytes. Checked in full before anything is copied.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n, segs outside [1, 4096] or
 * n * segs above KVP_MAX_BATCH, a length < 0, lengths not totalling
 * slot_bytes, a slot out of range), NOT_FOUND (a slot not pending),
 * UNSUPPORTED (a store without memory). */
kvp_status kvp_host_store_write(kvp_host_store *s, int32_t n, const int32_t *slots, int32_t segs,
                                const void *const *ptrs, const int64_t *lens);

/* Copies out of the store, the converse of kvp_host_store_write: slot
 * slots[i] (which must be resident; hold a pin on it) is split across its
 * segments. Errors: as kvp_host_store_write, NOT_FOUND for a slot that is
 * not resident. */
kvp_status kvp_host_store_read(kvp_host_store *s, int32_t n, const int32_t *slots, int32_t segs,
                               void *const *ptrs, const int64_t *lens);
#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: standalone host store (end) ==== */

/* ==== section: standalone shared store (begin) ==== */
/*
 * A standalone client of the shared tier (a Valkey or Redis server that
 * instances share; the format of its values is core/kvtier/valkey's: a
 * header with the key, a layout fingerprint and a checksum, then the
 * payload), without a kvp_manager, for kvplug.sglang's HiCache storage
 * backend. A key is 16 bytes (a 128-bit hash of the block's identity, as the
 * manager's shared tier keys blocks by their 128-bit chained hash): keys
 * arrays hold n keys of 16 bytes each.
 *
 * Faults never fail a call: a server that is down, slow or restarting
 * turns the call into misses (get, exists) or stores skipped (put), counted
 * in timeouts or errors, within op_timeout_ms; after a failure the server
 * is skipped, without touching the network, for a backoff window that
 * doubles up to max_backoff_ms (each call so skipped counted in skipped).
 * Lookups (get, exists) and stores (put) each have a window of their own,
 * so a server that is down costs one failed round trip on each.
 * A value that fails its checks (short, foreign, corrupt, another layout's)
 * is a miss counted in corrupt. create does not connect: a server that is
 * down at start-up only makes the first calls misses.
 *
 * AUTH, TLS and the MAC work as for the manager's shared tier (see "Shared
 * KV tier", Security), configured by the fields after reserved, which
 * mirror kvp_manager_config's shared_tier_username ... shared_tier_tls; their
 * faults are counted in auth_failures, tls_failures and mac_failures.
 *
 * Threads: calls on one store may come from any thread. Gets and exists
 * share one connection per server, one round trip at a time; puts have
 * their own, so that a read never waits behind a put's pipeline.
 */
typedef struct kvp_shared_store kvp_shared_store;

typedef struct kvp_shared_store_config {
  size_t struct_size;       /* sizeof(kvp_shared_store_config) */
  const char *address;      /* "host:port" of the server; required */
  const char *key_space;    /* 1-64 characters of [A-Za-z0-9_.-]: keys are
                               kvplug:<key_space>:<key as 32 hex digits>;
                               required */
  uint64_t fingerprint;     /* the model and KV layout's fingerprint: values
                               stored under another are misses */
  int64_t block_bytes;      /* payload bytes of every block; 0 = any */
  int32_t dial_timeout_ms;  /* 0 = 100 */
  int32_t op_timeout_ms;    /* bound on a whole call; 0 = 250 */
  int32_t ttl_ms;           /* expiry of stored blocks; 0 = none */
  int32_t backoff_ms;       /* first skip window after a failure; 0 = 1000 */
  int32_t max_backoff_ms;   /* longest skip window; 0 = 30000 */
  int32_t reserved;         /* must be 0 */
  /* Security (as kvp_manager_config's shared_tier_* fields of the same
   * names; all NULL and 0 = none). No field holds a secret. */
  const char *username;        /* ACL user; NULL = the default user; needs
                                  a password */
  const char *password_env;    /* environment variable holding the AUTH
                                  password */
  const char *password_file;   /* file holding it */
  const char *tls_ca_file;     /* PEM CAs; NULL = the system's roots;
                                  needs tls */
  const char *tls_cert_file;   /* PEM client certificate, with
                                  tls_key_file; needs tls */
  const char *tls_key_file;    /* its PEM key */
  const char *tls_server_name; /* NULL = the host of address; needs tls */
  const char *mac_keys_env;    /* environment variable holding the MAC
                                  keys (one or two, hex); NULL = no MAC */
  const char *mac_keys_file;   /* file holding them */
  int32_t tls;                 /* 1: TLS, the server verified; 0 = plaintext */
  int32_t reserved2;           /* must be 0 */
} kvp_shared_store_config;

#define KVP_SHARED_STORE_CONFIG_INIT KVP_STRUCT_INIT(kvp_shared_store_config)

/* Counters of a shared store: hits, misses and corrupt count keys (every
 * key of a get or exists is one of them); stores counts blocks stored;
 * timeouts, errors and skipped count calls; bytes are values' bytes. */
typedef struct kvp_shared_store_stats {
  size_t struct_size;  /* set by the caller: sizeof(kvp_shared_store_stats) */
  int64_t hits;
  int64_t misses;
  int64_t stores;
  int64_t corrupt;
  int64_t timeouts;
  int64_t errors;
  int64_t skipped;
  int64_t bytes_read;
  int64_t bytes_written;
  int32_t available;   /* 1: no skip window now, on either path */
  int32_t reserved;    /* 0 */
  int64_t auth_failures; /* of errors: AUTH or commands refused for it */
  int64_t tls_failures;  /* of errors: TLS handshakes or verifications */
  int64_t mac_failures;  /* of corrupt: values whose MAC did not verify */
  /* Cluster mode (since 0.3; "Shared KV tier", Cluster): */
  int64_t redirects;     /* MOVED and ASK replies followed */
  int64_t map_reads;     /* slot maps read (at start, after redirects and
                            failed nodes) */
  int32_t cluster;       /* 1: the server is a cluster */
  int32_t primaries;     /* the cluster's primaries in the last map; 0
                            for one server */
} kvp_shared_store_stats;

#define KVP_SHARED_STORE_STATS_INIT KVP_STRUCT_INIT(kvp_shared_store_stats)

#ifndef KVPLUG_NO_PROTOTYPES
/* Creates a client (no connection yet). Errors: NULL_POINTER (cfg, out,
 * address, key_space), STRUCT_SIZE, INVALID_ARGUMENT (a string too long or
 * with other characters, a negative size or time, reserved or reserved2
 * not 0; the security fields' errors, as kvp_manager_create's for the
 * shared tier's: no message holds a secret). */
kvp_status kvp_shared_store_create(const kvp_shared_store_config *cfg, kvp_shared_store **out);

/* Destroys a client and closes its connection. NULL is a no-op. */
void kvp_shared_store_destroy(kvp_shared_store *s);

/* found[i] receives 1 when the server holds key i (by key only; a corrupt
 * value is found by get), else 0; one round trip. Errors: NULL_POINTER,
 * INVALID_ARGUMENT (n). */
kvp_status kvp_shared_store_exists(kvp_shared_store *s, int32_t n, const uint8_t *keys,
                                   int32_t *found);

/* Stores n blocks in one round trip: key i's payload is the concatenation
 * of segments [i * segs, (i + 1) * segs) of ptrs (lengths in lens).
 * *num_stored (may be NULL) receives how many the server accepted.
 * Errors: NULL_POINTER, INVALID_ARGUMENT (n, segs outside [1, 4096] or
 * n * segs above KVP_MAX_BATCH, a length < 0). */
kvp_status kvp_shared_store_put(kvp_shared_store *s, int32_t n, const uint8_t *keys, int32_t segs,
                                const void *const *ptrs, const int64_t *lens, int32_t *num_stored);

/* Fetches n blocks in one round trip into the caller's segments (as put
 * lays them out): found[i] is 1 when key i's payload was found, checked,
 * of exactly the segments' total length, and copied; 0 leaves its segments
 * untouched. Errors: as kvp_shared_store_put. */
kvp_status kvp_shared_store_get(kvp_shared_store *s, int32_t n, const uint8_t *keys, int32_t segs,
                                void *const *ptrs, const int64_t *lens, int32_t *found);

/* Fills *out with the client's counters. Errors: NULL_POINTER,
 * STRUCT_SIZE. */
kvp_status kvp_shared_store_stats_get(kvp_shared_store *s, kvp_shared_store_stats *out);
#endif /* KVPLUG_NO_PROTOTYPES */
/* ==== section: standalone shared store (end) ==== */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVPLUG_H */
