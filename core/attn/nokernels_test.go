package attn

import (
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// A build without the fatbin answers every launch with UNSUPPORTED and a
// message saying how to build the kernels, before it looks for a device, and
// still answers bad arguments as such.
func TestNoKernelsBuild(t *testing.T) {
	saved := kernelsBuilt
	kernelsBuilt = func() bool { return false }
	defer func() { kernelsBuilt = saved }()

	w := testKVWriteArgs()
	d := testDecodeArgs()
	m := testMergeArgs()
	m.V[0], m.S[0], m.V[1], m.S[1], m.Out = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000

	calls := map[string]func() error{
		"kv_write":     func() error { return KVWrite(&w, 0) },
		"paged_decode": func() error { return PagedDecode(&d, 0) },
		"merge_states": func() error { return MergeStates(&m, 0) },
		"attn_prepare": Prepare,
	}
	for name, call := range calls {
		err := call()
		if !kverr.Is(err, kverr.Unsupported) {
			t.Errorf("%s: got %v, want UNSUPPORTED", name, err)
			continue
		}
		msg := err.Error()
		for _, want := range []string{name + ":", "built without its CUDA kernels", "make"} {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: message %q lacks %q", name, msg, want)
			}
		}
	}
	if KernelsBuilt() {
		t.Error("KernelsBuilt with the kernels taken away")
	}

	bad := w
	bad.Value = 0
	if err := KVWrite(&bad, 0); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("null value without kernels: %v, want NULL_POINTER first", err)
	}
}
