package logx

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"
)

func TestSilentByDefaultAndRouted(t *testing.T) {
	if L().Core().Enabled(zap.ErrorLevel) {
		t.Fatal("logger enabled with no sink")
	}
	var mu sync.Mutex
	var got []string
	var levels []Level
	SetSink(func(l Level, msg string) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, msg)
		levels = append(levels, l)
	}, Info)
	defer SetSink(nil, Off)

	L().Debug("hidden")
	L().Info("pool created", zap.Int("blocks", 7))
	L().With(zap.String("part", "prefix")).Warn("evicting")
	if len(got) != 2 {
		t.Fatalf("got %d entries, want 2: %q", len(got), got)
	}
	if !strings.Contains(got[0], "pool created") || !strings.Contains(got[0], `"blocks": 7`) {
		t.Errorf("entry 0 = %q", got[0])
	}
	if levels[0] != Info || levels[1] != Warn {
		t.Errorf("levels = %v", levels)
	}
	if !strings.Contains(got[1], "prefix") {
		t.Errorf("entry 1 lost its field: %q", got[1])
	}
	SetLevel(Error)
	L().Warn("now hidden")
	if len(got) != 2 {
		t.Errorf("warn delivered at level Error")
	}
}

func TestLinesHaveNoLineEnding(t *testing.T) {
	var mu sync.Mutex
	var got []string
	SetSink(func(l Level, msg string) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, msg)
	}, Debug)
	defer SetSink(nil, Off)
	L().Info("one")
	L().Error("two", zap.Int("n", 2))
	if len(got) != 2 {
		t.Fatalf("got %d lines: %q", len(got), got)
	}
	for _, m := range got {
		if strings.HasSuffix(m, "\n") || strings.HasSuffix(m, "\r") || m == "" {
			t.Errorf("line %q ends in a line ending or is empty", m)
		}
	}
}

func TestInCallbackOnlyInsideTheSink(t *testing.T) {
	if InCallback() {
		t.Fatal("InCallback outside any sink")
	}
	var inside, nested []bool
	var other atomic.Bool
	release := make(chan struct{})
	started := make(chan struct{})
	SetSink(func(l Level, msg string) {
		inside = append(inside, InCallback())
		if msg == "outer" {
			L().Warn("inner") // a sink that logs: still inside after the inner line
			nested = append(nested, InCallback())
			close(started)
			<-release
		}
	}, Debug)
	defer SetSink(nil, Off)
	done := make(chan struct{})
	go func() {
		defer close(done)
		L().Info("outer")
	}()
	<-started
	// Another goroutine, while a sink runs elsewhere, is not inside it.
	other.Store(InCallback())
	close(release)
	<-done
	if other.Load() {
		t.Error("a goroutine outside the sink saw InCallback while another ran it")
	}
	if len(inside) != 2 || !inside[0] || !inside[1] || len(nested) != 1 || !nested[0] {
		t.Errorf("inside the sink: %v, after a nested line: %v", inside, nested)
	}
	if InCallback() || delivering.Load() != 0 {
		t.Error("InCallback after the sink returned")
	}
}
