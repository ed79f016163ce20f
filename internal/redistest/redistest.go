// Package redistest starts a throwaway valkey-server or redis-server for
// tests: on a free loopback port, without persistence, in the test's own
// temporary directory, killed at the test's cleanup. A test that needs one
// is skipped only when neither binary is installed (CI installs
// redis-server: .ci/run).
package redistest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/resp"
)

// Server is a running server process.
type Server struct {
	Bin  string
	Port int

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed once the process has exited (its Wait returned)
}

// Find returns the path of valkey-server or redis-server, or skips the test.
func Find(t testing.TB) string {
	for _, b := range []string{"valkey-server", "redis-server"} {
		if p, err := exec.LookPath(b); err == nil {
			return p
		}
	}
	t.Skip("neither valkey-server nor redis-server is installed (Debian: apt-get install valkey-server or redis-server)")
	return ""
}

// FreePort returns a loopback port nothing listens on now.
func FreePort(t testing.TB) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Start starts bin on port (a free one when 0) with extra arguments and
// waits until it answers PING. The process is killed at t's cleanup if it
// is still running.
func Start(t testing.TB, bin string, port int, args ...string) *Server {
	t.Helper()
	return launch(t, bin, port, func(port int) []string {
		return append(plainArgs(t, port), args...)
	}, ping, "")
}

// plainArgs are the arguments of a server on port of 127.0.0.1, without
// persistence, in a directory of its own.
func plainArgs(t testing.TB, port int) []string {
	return []string{"--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", t.TempDir()}
}

// ping is nil once s answers PING over plain TCP.
func ping(s *Server) error {
	c := resp.NewClient(s.Addr(), time.Second)
	defer c.Close()
	_, err := c.Do([][][]byte{{[]byte("PING")}})
	return err
}

// launch starts bin with argv(port) and waits until ready(server) succeeds.
// A free port (port 0) is only free when FreePort looked: another process
// (a test's server started beside this one) may take it before the server
// binds it, and the server then exits. Such a server is started again on
// another port (argv is called anew: a port of its own it names too is
// drawn again), up to three times. hint is added to the failure's message.
func launch(t testing.TB, bin string, port int, argv func(port int) []string, ready func(*Server) error, hint string) *Server {
	t.Helper()
	for attempt := 1; ; attempt++ {
		p := port
		if p == 0 {
			p = FreePort(t)
		}
		s := &Server{Bin: bin, Port: p, exited: make(chan struct{})}
		s.cmd = exec.Command(bin, argv(p)...)
		if err := s.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func(cmd *exec.Cmd, exited chan struct{}) {
			_ = cmd.Wait()
			close(exited)
		}(s.cmd, s.exited)
		t.Cleanup(s.Stop)
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := ready(s)
			if err == nil {
				return s
			}
			gone := false
			select {
			case <-s.exited:
				gone = true
			default:
			}
			if gone && port == 0 && attempt < 3 {
				break // its port was taken: again, on another
			}
			if gone || time.Now().After(deadline) {
				s.Stop()
				t.Fatalf("%s did not start%s: %v", bin, hint, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return fmt.Sprintf("127.0.0.1:%d", s.Port) }

// Running reports whether the server was started and not stopped.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cmd != nil
}

// Stop kills the server and waits for it; it may be called more than once.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.exited
	s.cmd = nil
}

// Serve accepts connections on a free loopback port until t's cleanup,
// which closes the listener and every connection; each connection is
// handle's, on a goroutine of its own, and is closed when handle returns.
// It returns its host:port.
func Serve(t testing.TB, handle func(net.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return ln.Addr().String()
}

// Scripted serves scripted replies (Serve): each connection's commands are
// read in turn; CLUSTER is answered as by a server without cluster
// support, and every other command, its verb in upper case, goes to reply,
// which writes the reply (or none) and returns false to close the
// connection.
func Scripted(t testing.TB, reply func(c net.Conn, verb string) bool) string {
	return Serve(t, func(c net.Conn) {
		r := bufio.NewReader(c)
		for {
			cmd, err := resp.ReadReply(r)
			if err != nil {
				return
			}
			args, _ := cmd.([]any)
			if len(args) == 0 {
				return
			}
			verb, _ := args[0].([]byte)
			if v := strings.ToUpper(string(verb)); v == "CLUSTER" {
				io.WriteString(c, "-ERR This instance has cluster support disabled\r\n")
			} else if !reply(c, v) {
				return
			}
		}
	})
}

// Slow starts a server (Serve) that answers each read of a command with a
// null bulk after delay, or never when delay is 0: a server that is up but
// too slow. It stops at t's cleanup. It returns its host:port.
func Slow(t testing.TB, delay time.Duration) string {
	done := make(chan struct{})
	addr := Serve(t, func(c net.Conn) {
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Read(buf); err != nil {
				return
			}
			if delay == 0 {
				continue
			}
			select {
			case <-time.After(delay):
				c.Write([]byte("$-1\r\n"))
			case <-done:
				return
			}
		}
	})
	t.Cleanup(func() { close(done) }) // before Serve's (cleanups run last first)
	return addr
}
