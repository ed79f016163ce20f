package resp

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// windowServer answers SET with +OK and GET k with the bulk "v:k", one
// command at a time, 10 ms after the previous reply, recording how many
// commands it had received and not yet answered at most, and the SETs'
// values.
type windowServer struct {
	ln      net.Listener
	mu      sync.Mutex
	maxOpen int
	sets    map[string]string
}

func newWindowServer(t *testing.T) *windowServer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &windowServer{ln: ln, sets: map[string]string{}}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go s.serve(c)
		}
	}()
	return s
}

func (s *windowServer) serve(c net.Conn) {
	defer c.Close()
	cmds := make(chan []any, 1024)
	go func() {
		defer close(cmds)
		r := bufio.NewReader(c)
		for {
			v, err := ReadReply(r)
			if err != nil {
				return
			}
			a, _ := v.([]any)
			cmds <- a
		}
	}()
	for cmd := range cmds {
		time.Sleep(10 * time.Millisecond)
		s.mu.Lock()
		s.maxOpen = max(s.maxOpen, 1+len(cmds))
		var reply string
		switch name := strings.ToUpper(string(cmd[0].([]byte))); name {
		case "CLUSTER":
			reply = "-ERR This instance has cluster support disabled\r\n"
		case "SET":
			s.sets[string(cmd[1].([]byte))] = string(cmd[2].([]byte))
			reply = "+OK\r\n"
		case "GET":
			v := "v:" + string(cmd[1].([]byte))
			reply = fmt.Sprintf("$%d\r\n%s\r\n", len(v), v)
		default:
			reply = "-ERR unknown\r\n"
		}
		s.mu.Unlock()
		if _, err := io.WriteString(c, reply); err != nil {
			return
		}
	}
}

// Call writes commands given in pieces, keeps at most Window of them
// unanswered, and reads bulk replies through Bulk (with the command's
// index), other replies as Do does.
func TestCallWindowPiecesBulk(t *testing.T) {
	s := newWindowServer(t)
	c := NewCluster(s.ln.Addr().String(), ClusterOptions{Options: Options{DialTimeout: time.Second, OpTimeout: 10 * time.Second}})
	defer c.Close()
	const n = 12
	call := &Call{Window: 3}
	for i := range n {
		key := fmt.Appendf(nil, "k%d", i)
		if i%2 == 0 {
			val := fmt.Sprintf("value %d", i)
			head := append(AppendBulk(AppendArray(nil, 3), 3), "SET\r\n"...)
			head = append(append(AppendBulk(head, len(key)), key...), '\r', '\n')
			head = AppendBulk(head, len(val))
			call.Cmds = append(call.Cmds, [][]byte{head, []byte(val[:3]), []byte(val[3:]), []byte("\r\n")})
		} else {
			call.Cmds = append(call.Cmds, [][]byte{AppendCommand(nil, []byte("GET"), key)})
		}
		call.Keys = append(call.Keys, key)
	}
	call.Bulk = func(i, n int, r *bufio.Reader) (any, error) {
		b := make([]byte, n)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, err
		}
		return fmt.Sprintf("bulk %d %s", i, b), nil
	}
	out, err := c.Call(call)
	if err != nil {
		t.Fatal(err)
	}
	for i, x := range out {
		want := any("OK")
		if i%2 == 1 {
			want = fmt.Sprintf("bulk %d v:k%d", i, i)
		} else if got := s.sets[fmt.Sprintf("k%d", i)]; got != fmt.Sprintf("value %d", i) {
			t.Fatalf("SET %d stored %q", i, got)
		}
		if x != want {
			t.Fatalf("reply %d: %#v, want %#v", i, x, want)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.maxOpen > 3 || s.maxOpen < 2 {
		t.Fatalf("at most %d commands unanswered at the server, window 3", s.maxOpen)
	}
}

// A bulk reply read through Bulk must be followed by CRLF; an error from
// Bulk fails the call and drops the connection.
func TestReadReplyBulk(t *testing.T) {
	read := func(b []byte) func(int, int, *bufio.Reader) (any, error) {
		return func(i, n int, r *bufio.Reader) (any, error) {
			_, err := io.ReadFull(r, b[:n])
			return i, err
		}
	}
	buf := make([]byte, 16)
	for in, want := range map[string]any{"$3\r\nabc\r\n": 7, "$-1\r\n": nil, "+OK\r\n": "OK", ":5\r\n": int64(5), "*1\r\n$1\r\nz\r\n": []any{[]byte("z")}} {
		got, err := readReplyBulk(bufio.NewReader(strings.NewReader(in)), 7, read(buf))
		if err != nil || fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%q: %#v %v", in, got, err)
		}
	}
	for _, in := range []string{"$3\r\nabcd\r\n", "$3\r\nab", "$3\r\nabc", "$x\r\n", "$99999999999\r\n", ""} {
		if _, err := readReplyBulk(bufio.NewReader(strings.NewReader(in)), 0, read(buf)); err == nil {
			t.Errorf("%q: no error", in)
		}
	}
}

// FuzzReadReplyBulk: a reply read through Bulk is the reply ReadReply
// reads, a bulk string being Bulk's bytes, and a bulk not followed by CRLF
// an error.
func FuzzReadReplyBulk(f *testing.F) {
	for _, s := range []string{"$3\r\nabc\r\n", "$-1\r\n", "+OK\r\n", "-ERR x\r\n", ":12\r\n", "*2\r\n$1\r\na\r\n:1\r\n", "$3\r\nabcXY", "$0\r\n\r\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		want, werr := ReadReply(bufio.NewReader(bytes.NewReader(in)))
		got, gerr := readReplyBulk(bufio.NewReader(bytes.NewReader(in)), 0, func(_, n int, r *bufio.Reader) (any, error) {
			b := make([]byte, n)
			_, err := io.ReadFull(r, b)
			return b, err
		})
		if gerr != nil {
			// Stricter than ReadReply only about the CRLF after a bulk.
			if werr == nil {
				b, ok := want.([]byte)
				if !ok || bytes.HasPrefix(in[bytes.IndexByte(in, '\n')+1+len(b):], []byte("\r\n")) {
					t.Fatalf("%q: readReplyBulk %v, ReadReply %#v", in, gerr, want)
				}
			}
			return
		}
		if werr != nil || fmt.Sprintf("%#v", got) != fmt.Sprintf("%#v", want) {
			t.Fatalf("%q: readReplyBulk %#v, ReadReply %#v %v", in, got, want, werr)
		}
	})
}
