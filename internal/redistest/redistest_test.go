package redistest

import (
	"fmt"
	"net"
	"testing"
)

// A server whose port another process took before it bound it exits at
// once; launch starts it again on another port rather than failing the
// test (go test runs packages that start servers side by side).
func TestLaunchRetriesAServerWhosePortWasTaken(t *testing.T) {
	bin := Find(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	taken := ln.Addr().(*net.TCPAddr).Port
	starts := 0
	s := launch(t, bin, 0, func(port int) []string {
		starts++
		if starts == 1 {
			port = taken // as if another process took the free port first
		}
		return []string{"--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", t.TempDir()}
	}, ping, "")
	if starts != 2 || s.Port == taken || ping(s) != nil {
		t.Fatalf("started %d times, on port %d (taken: %d), ping %v", starts, s.Port, taken, ping(s))
	}
}
