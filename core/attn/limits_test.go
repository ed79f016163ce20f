package attn

import (
	"testing"

	"github.com/kvplug/kvplug/core/limits"
)

// The ABI's attention batch bound fits the decode grid's y dimension, which
// holds one sequence per block row.
func TestAttnBatchFitsTheGrid(t *testing.T) {
	if limits.AttnBatch > maxGridYZ {
		t.Fatalf("limits.AttnBatch %d exceeds the grid's %d", limits.AttnBatch, maxGridYZ)
	}
}
