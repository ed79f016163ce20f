package kvmanager

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// recovered runs f and returns the error it panicked with (nil if none).
func recovered(t *testing.T, f func()) (err error) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			e, ok := r.(error)
			if !ok {
				t.Fatalf("panicked with %T %v, want an error", r, r)
			}
			err = e
		}
	}()
	f()
	return nil
}

// wantInternalPanic asserts that err is a panic's Internal error whose
// message holds every fragment, and that the manager is not left locked.
func wantInternalPanic(t *testing.T, m *Manager, err error, fragments ...string) {
	t.Helper()
	if err == nil {
		t.Fatal("no panic")
	}
	if kverr.CodeOf(err) != kverr.Internal {
		t.Fatalf("panicked with code %s, want Internal: %v", kverr.CodeOf(err), err)
	}
	for _, f := range fragments {
		if !strings.Contains(err.Error(), f) {
			t.Fatalf("panic message %q lacks %q", err, f)
		}
	}
	done := make(chan struct{})
	go func() { m.Stats(); close(done) }()
	<-done // a lock left held would hang here, and the test would time out
}

func TestAssertOKPanicsWithAnInternalError(t *testing.T) {
	if err := recovered(t, func() { assertOK(nil, "nothing") }); err != nil {
		t.Fatalf("assertOK(nil) panicked: %v", err)
	}
	cause := kverr.Errorf(kverr.OutOfBlocks, "allocate: 3 blocks needed, 2 free")
	err := recovered(t, func() { assertOK(cause, "add: allocating blocks made free") })
	if kverr.CodeOf(err) != kverr.Internal || !errors.Is(err, cause) ||
		!strings.Contains(err.Error(), "add: allocating blocks made free") || !strings.Contains(err.Error(), "2 free") {
		t.Fatalf("assertOK's panic %v: want Internal, naming the assumption and wrapping the cause", err)
	}
}

// An infallible step that fails (here: the cache lost a lock behind the
// manager's back, so Remove's unlock of the sequence's cached blocks
// fails) panics with the assumption it broke, whatever the build, and
// releases the manager's lock.
func TestABrokenAssumptionPanicsNamingIt(t *testing.T) {
	m := newCached(t, 16, 4, false)
	admit(t, m, 1, []int32{0, 1, 2, 3, 4, 5, 6, 7, 8}, nil) // two full blocks, cached and locked
	blk := m.seqs.get(1).blocks[0]
	m.mu.Lock()
	if err := m.cache.Unlock([]int32{blk}); err != nil {
		t.Fatal(err)
	}
	m.mu.Unlock()
	err := recovered(t, func() { _ = m.Remove([]int64{1}) })
	wantInternalPanic(t, m, err, "a sequence's cached blocks are not locked", "no lock left")
}

// In a -race build every call that may change a manager ends with
// CheckInvariants: a broken invariant panics at the first such call after
// it broke, not at the test's next explicit check. The two counts kept by
// convention, the pool's references and the prefix index's locks, are
// the case in point.
func TestEveryCallChecksTheInvariantsInRaceBuilds(t *testing.T) {
	if !checkEveryCall {
		t.Skip("the per-call check is compiled only into -race builds")
	}
	m := newCached(t, 16, 4, false)
	admit(t, m, 1, []int32{0, 1, 2, 3, 4, 5, 6, 7, 8}, nil)
	blk := m.seqs.get(1).blocks[0]
	m.mu.Lock()
	if err := m.cache.Lock([]int32{blk}); err != nil { // a lock with no reference
		t.Fatal(err)
	}
	m.mu.Unlock()
	// An argument refused before the manager is locked touches nothing and
	// is not checked; a call refused under the lock (sequence 1 is live) is
	// checked like a successful one.
	err := recovered(t, func() { _ = m.Add(2, 0) })
	if err != nil {
		t.Fatalf("an argument error checked before the lock panicked: %v", err)
	}
	err = recovered(t, func() { _ = m.Add(1, 4) })
	wantInternalPanic(t, m, err, "invariant broken by the last call", "2 locks and 1 references")

	// The pool's own counts are checked the same way.
	m2 := newMgr(t, 8, 4)
	wantCode(t, "add", m2.Add(1, 5), kverr.OK)
	m2.mu.Lock()
	if err := m2.pool.Incref(m2.seqs.get(1).blocks[:1]); err != nil {
		t.Fatal(err)
	}
	m2.mu.Unlock()
	err = recovered(t, func() { _ = m2.Grow([]int64{1}, []int32{1}) })
	wantInternalPanic(t, m2, err, "has ref 2, held by 1 sequence references")
}
