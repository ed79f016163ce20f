package limits

import (
	"os"
	"regexp"
	"strconv"
	"testing"

	"github.com/kvplug/kvplug/internal/kverr"
)

// Every bound here is the header's KVP_MAX_* macro of the same value, and
// the header names no bound this package does not define: a C host and the
// library check the same numbers.
func TestBoundsMatchTheHeader(t *testing.T) {
	src, err := os.ReadFile("../../include/kvplug.h")
	if err != nil {
		t.Fatal(err)
	}
	header := map[string]uint64{}
	for _, m := range regexp.MustCompile(`(?m)^#define (KVP_MAX_\w+) \(?([0-9a-fA-Fx]+)(?:ULL|LL|U)?(?: << (\d+))?\)?`).FindAllSubmatch(src, -1) {
		v, err := strconv.ParseUint(string(m[2]), 0, 64)
		if err != nil {
			t.Fatalf("%s: %v", m[1], err)
		}
		if len(m[3]) > 0 {
			shift, _ := strconv.Atoi(string(m[3]))
			v <<= shift
		}
		header[string(m[1])] = v
	}
	ours := map[string]uint64{
		"KVP_MAX_BATCH":         Batch,
		"KVP_MAX_ATTN_BATCH":    AttnBatch,
		"KVP_MAX_PROMPT_TOKENS": PromptTokens,
		"KVP_MAX_MM_ITEMS":      MMItems,
		"KVP_MAX_SALT_LEN":      SaltLen,
		"KVP_MAX_BYTES":         Bytes,
		"KVP_MAX_TIER_LAYERS":   TierLayers,
		"KVP_MAX_LAYER_GROUPS":  LayerGroups,
	}
	for name, v := range ours {
		if h, ok := header[name]; !ok || h != v {
			t.Errorf("%s is %d here, %d in the header (present: %v)", name, v, h, ok)
		}
	}
	for name := range header {
		if _, ok := ours[name]; !ok {
			t.Errorf("the header's %s has no constant in core/limits", name)
		}
	}
}

func TestChecks(t *testing.T) {
	if err := Range("n", 3, 1, 3); err != nil {
		t.Fatal(err)
	}
	err := Range("kvp_x: n", 4, 1, 3)
	if kverr.CodeOf(err) != kverr.InvalidArgument || err.Error() != "kvp_x: n must be in [1, 3]: got 4" {
		t.Fatalf("Range: %v", err)
	}
	if n, err := ByteCount("workspace_bytes", Bytes); err != nil || n != Bytes {
		t.Fatalf("ByteCount(max): %d %v", n, err)
	}
	_, err = ByteCount("kvp_x: workspace_bytes", Bytes+1)
	if kverr.CodeOf(err) != kverr.InvalidArgument || err.Error() != "kvp_x: workspace_bytes 9223372036854775808 is too large" {
		t.Fatalf("ByteCount(max+1): %v", err)
	}
}
