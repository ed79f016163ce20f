package testseed

import (
	"testing"
)

func TestSeedFromEnv(t *testing.T) {
	t.Setenv(Env, "12345678901234567890")
	if s := Seed(t); s != 12345678901234567890 {
		t.Fatalf("Seed = %d, want the environment's", s)
	}
	t.Setenv(Env, "0x10")
	if s := Seed(t); s != 16 {
		t.Fatalf("Seed = %d, want 16", s)
	}
}

func TestSeedFresh(t *testing.T) {
	t.Setenv(Env, "")
	// Two fresh draws of 64 bits agree with probability 2^-64.
	if a, b := Seed(t), Seed(t); a == b {
		t.Fatalf("two fresh seeds are both %d", a)
	}
}

// A seed that does not parse fails the test rather than being replaced
// by a fresh one (the run would not replay what was asked).
func TestSeedBadEnv(t *testing.T) {
	t.Setenv(Env, "not-a-number")
	ft := &fatalRecorder{TB: t}
	func() {
		defer func() { _ = recover() }()
		Seed(ft)
	}()
	if !ft.fatal {
		t.Fatal("a malformed seed was accepted")
	}
}

type fatalRecorder struct {
	testing.TB
	fatal bool
}

func (f *fatalRecorder) Fatalf(string, ...any) { f.fatal = true; panic("fatal") }
func (f *fatalRecorder) Logf(string, ...any)   {}
func (f *fatalRecorder) Helper()               {}
