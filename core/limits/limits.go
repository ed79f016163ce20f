// Package limits is the bounds of the library's arguments that the C ABI
// names (include/kvplug.h, KVP_MAX_*), each defined once, with the checks
// that apply them. A count is checked against its bound before anything is
// sized by it: a slice over a caller's array, a kernel's grid, a table the
// library allocates. limits_test.go ties every constant to its macro.
package limits

import (
	"math"

	"github.com/kvplug/kvplug/internal/kverr"
)

const (
	// Batch bounds the sequence ids (or slots) of one batched call of the
	// manager or the virtual cache (KVP_MAX_BATCH).
	Batch = 1 << 20
	// AttnBatch bounds the sequences of one attention plan or launch
	// (KVP_MAX_ATTN_BATCH): the decode kernel's grid.y.
	AttnBatch = 65535
	// PromptTokens bounds the tokens of one prompt or sequence
	// (KVP_MAX_PROMPT_TOKENS).
	PromptTokens = 1 << 30
	// MMItems bounds the multimodal items of one prompt
	// (KVP_MAX_MM_ITEMS).
	MMItems = 1 << 20
	// SaltLen bounds a prompt's cache salt in bytes (KVP_MAX_SALT_LEN).
	SaltLen = 1024
	// Bytes bounds a byte count the ABI passes as uint64 (workspace_bytes
	// and the like; KVP_MAX_BYTES): the Go side holds it as int64.
	Bytes = math.MaxInt64
	// TierLayers bounds the layers of a tier copier's KV layout
	// (KVP_MAX_TIER_LAYERS).
	TierLayers = 1024
	// LayerGroups bounds the layer groups of one manager
	// (KVP_MAX_LAYER_GROUPS).
	LayerGroups = 64
)

// The host tier's bounds. The header documents them with the fields they
// bound (kvp_manager_config.host_tier_slots and host_block_bytes,
// kvp_host_store_config, kvp_tier_copier_create) rather than as KVP_MAX_*
// macros; every Go check of them uses these.
const (
	// TierSlots bounds the slots of one host pool (a manager's host tier or
	// a standalone host store), and so the host blocks one prefix index
	// announces.
	TierSlots = 1 << 30
	// TierBytes bounds one host pool's memory, slots x slot bytes, and so
	// any one region of it (a segment of a host store's copy).
	TierBytes = 1 << 46
	// SharedBlockBytes bounds one block's bytes in a standalone shared
	// store (kvp_shared_store_config.block_bytes).
	SharedBlockBytes = 1 << 40
)

// Range refuses v outside [lo, hi] with InvalidArgument, naming it what.
func Range(what string, v, lo, hi int) error {
	if v < lo || v > hi {
		return kverr.Errorf(kverr.InvalidArgument, "%s must be in [%d, %d]: got %d", what, lo, hi, v)
	}
	return nil
}

// ByteCount converts a byte count from the ABI's uint64 to the int64 the
// Go side holds, refusing one above Bytes with InvalidArgument.
func ByteCount(what string, n uint64) (int64, error) {
	if n > Bytes {
		return 0, kverr.Errorf(kverr.InvalidArgument, "%s %d is too large", what, n)
	}
	return int64(n), nil
}
