package attn

import (
	"math"
	"testing"
)

// A scale of 0 is the default 1/sqrt(head_dim) in core, for every caller.
func TestSoftmaxScaleDefault(t *testing.T) {
	for _, d := range []int{64, 128, 256} {
		want := float32(1 / math.Sqrt(float64(d)))
		if got := SoftmaxScale(0, d); got != want {
			t.Errorf("head_dim %d: default scale %g, want %g", d, got, want)
		}
		if got := SoftmaxScale(0.5, d); got != 0.5 {
			t.Errorf("head_dim %d: an explicit scale became %g", d, got)
		}
	}
}
