package resp

import (
	"bufio"
	"errors"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestReadReply(t *testing.T) {
	good := map[string]any{
		"+OK\r\n":                  "OK",
		"-ERR x\r\n":               Error("ERR x"),
		":42\r\n":                  int64(42),
		"$3\r\nabc\r\n":            []byte("abc"),
		"$-1\r\n":                  nil,
		"*2\r\n:1\r\n$1\r\nz\r\n":  []any{int64(1), []byte("z")},
		"*-1\r\n":                  nil,
		"*1\r\n*1\r\n*1\r\n:7\r\n": []any{[]any{[]any{int64(7)}}},
	}
	for in, want := range good {
		got, err := ReadReply(bufio.NewReader(strings.NewReader(in)))
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("%q: %#v %v", in, got, err)
		}
	}
	for _, in := range []string{"?x\r\n", ":x\r\n", "$99999999999\r\n", "$-2\r\n", "*-2\r\n", "+OK\n", "$3\r\nab", "*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n"} {
		if _, err := ReadReply(bufio.NewReader(strings.NewReader(in))); err == nil {
			t.Errorf("%q: no error", in)
		}
	}
}

// A server that never answers: Do returns a timeout within the bound, and
// a second caller queued behind the first gets ErrBusy, also a timeout.
func TestDoBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	c := NewClientTimeouts(ln.Addr().String(), time.Second, 100*time.Millisecond)
	defer c.Close()
	errs := make(chan error, 2)
	start := time.Now()
	for range 2 {
		go func() {
			_, err := c.Do([][][]byte{{[]byte("PING")}})
			errs <- err
		}()
	}
	var busy int
	for range 2 {
		err := <-errs
		if !IsTimeout(err) {
			t.Fatalf("not a timeout: %v", err)
		}
		if errors.Is(err, ErrBusy) {
			busy++
		}
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("took %v", d)
	}
	if busy == 0 {
		t.Log("both calls reached the server (no ErrBusy this run)")
	}
}

// After Close every call fails with ErrClosed and dials nothing; Reset
// only drops the connection, and the next call dials again.
func TestCloseIsFinalResetIsNot(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 256)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
					if _, err := c.Write([]byte("+PONG\r\n")); err != nil {
						return
					}
				}
			}()
		}
	}()
	c := NewClient(ln.Addr().String(), time.Second)
	ping := [][][]byte{{[]byte("PING")}}
	if _, err := c.Do(ping); err != nil {
		t.Fatal(err)
	}
	c.Reset()
	if _, err := c.Do(ping); err != nil || c.DialCount() != 2 {
		t.Fatalf("after Reset: %v, %d dials", err, c.DialCount())
	}
	c.Close()
	if _, err := c.Do(ping); !errors.Is(err, ErrClosed) || c.DialCount() != 2 {
		t.Fatalf("after Close: %v, %d dials", err, c.DialCount())
	}
}

func TestSlot(t *testing.T) {
	for key, want := range map[string]int{
		"foo": 12182, "bar": 5061, "hello": 866, "123456789": 12739,
		"{user1000}.following": Slot([]byte("user1000")), "foo{}{bar}": Slot([]byte("foo{}{bar}")),
		"foo{{bar}}zap": Slot([]byte("{bar")), "foo{bar}{zap}": Slot([]byte("bar")),
	} {
		if got := Slot([]byte(key)); got != want {
			t.Errorf("Slot(%q) = %d, want %d", key, got, want)
		}
	}
}
