package main

import (
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// A failed assertion in the core (a step documented as unable to fail, or
// an invariant broken in a -race build) panics with an Internal error; at
// the ABI the export's guard answers KVP_ERR_INTERNAL with its message,
// and the process goes on.
func TestACorePanicIsInternalAtTheABI(t *testing.T) {
	lockThread(t)
	cause := kverr.Errorf(kverr.InvalidArgument, "unlock: block 3 has no lock left")
	st := hookGuarded(func() {
		panic(kverr.Wrap(kverr.Internal, cause, "kvmanager: a sequence's cached blocks are not locked"))
	})
	if st != int(kverr.Internal) {
		t.Fatalf("status %s, want KVP_ERR_INTERNAL", statusName(st))
	}
	msg := lastError()
	for _, want := range []string{"internal error (please report)", "cached blocks are not locked", "block 3 has no lock left"} {
		if !strings.Contains(msg, want) {
			t.Fatalf("message %q lacks %q", msg, want)
		}
	}
	if st := hookGuarded(func() {}); st != 0 {
		t.Fatalf("a call that does not panic: %s", statusName(st))
	}
	// The library still answers.
	h := newManager(t, 4, 4)
	defer hookManagerDestroy(h)
	expect(t, "add after a recovered panic", hookManagerAdd(h, 1, 4), kverr.OK)
}
