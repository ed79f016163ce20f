package attn

import (
	"reflect"
	"testing"
)

// The cascade parameter struct joins the layout probe of TestParamsLayout.
func init() {
	layoutCases = append(layoutCases, layoutCase{"kvp_cascade_params", reflect.TypeOf(cascadeParams{}), 240})
}

// cascadeSharedBytes follows the header's formula (static_asserted in the
// kernels' translation unit).
func TestCascadeSharedBytes(t *testing.T) {
	for d, want := range map[int]uint32{64: 70144, 128: 104448, 256: 165376} {
		if got := cascadeSharedBytes(d); got != want {
			t.Errorf("h%d: %d, want %d", d, got, want)
		}
	}
}
