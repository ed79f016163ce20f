package logx

import (
	"strings"
	"sync"
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
