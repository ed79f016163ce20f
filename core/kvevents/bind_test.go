package kvevents

import (
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The PUB socket binds unless told to connect: an endpoint naming a host
// and port is served there, as a subscriber (kvindex) expects.
func TestBindModes(t *testing.T) {
	for _, c := range []struct {
		ep    string
		mode  int
		binds bool
	}{
		{"tcp://127.0.0.1:5557", BindDefault, true},
		{"tcp://127.0.0.1:5557", BindListen, true},
		{"tcp://127.0.0.1:5557", BindConnect, false},
		{"tcp://127.0.0.1:5557", BindVLLM, false},
		{"tcp://*:5557", BindVLLM, true},
		{"tcp://[::]:5557", BindVLLM, true},
		{"ipc:///tmp/x", BindVLLM, true},
		{"tcp://*:5557", BindConnect, false},
	} {
		if got := Binds(c.ep, c.mode); got != c.binds {
			t.Errorf("Binds(%s, %d) = %v", c.ep, c.mode, got)
		}
	}
	// The zero Config binds a host:port endpoint, and a subscriber
	// connecting to it gets the batches.
	src := newIndexSource(t, 8, 2)
	p, err := Start(src, Config{Endpoint: "tcp://127.0.0.1:0", FlushInterval: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	if !p.Binds() || p.PubAddr() == nil {
		t.Fatalf("the default mode did not bind: %v", p.PubAddr())
	}
	s := subscribe(t, p, "")
	src.insert(t, seqTokens(0, 2), nil)
	waitStored(t, p, s)

	// BindConnect dials a subscriber that binds.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	p2 := startPub(t, newIndexSource(t, 8, 2), Config{Endpoint: "tcp://" + ln.Addr().String(), Bind: BindConnect})
	if p2.Binds() || p2.PubAddr() != nil {
		t.Fatal("connect mode bound")
	}
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
	c, err := ln.Accept()
	if err != nil {
		t.Fatalf("the publisher never connected: %v", err)
	}
	c.Close()
}

// A subscriber that finds nothing bound says where it connects and what
// it waits for.
func TestDialSubRefusedNamesTheEndpoint(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := "tcp://" + ln.Addr().String()
	ln.Close() // nothing is bound there now
	_, err = DialSub(addr, "", time.Second)
	var de *DialError
	if !errors.As(err, &de) || de.Endpoint != addr || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("err %v (%T)", err, err)
	}
	for _, want := range []string{"SUB connecting to " + addr, "the publisher must bind this endpoint"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
	if err := CheckEndpoint("bogus://x"); err == nil || !strings.Contains(err.Error(), "only tcp://HOST:PORT") {
		t.Errorf("bogus://x: %v", err)
	}
	for _, bad := range []string{"tcp://h:99999", "tcp://h:x", "tcp://h", "ipc://"} {
		if CheckEndpoint(bad) == nil {
			t.Errorf("%s accepted", bad)
		}
	}
	for _, ok := range []string{"tcp://*:5557", "tcp://10.0.0.1:0", "tcp://[::1]:5557", "ipc:///run/kv.sock"} {
		if err := CheckEndpoint(ok); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
}

// A PING on an idle subscription is answered with a PONG; the replay
// endpoint answers a probe while the publisher runs and not after.
func TestHeartbeatAndReplayProbe(t *testing.T) {
	src := newIndexSource(t, 8, 2)
	p := startPub(t, src, Config{ReplayEndpoint: "tcp://127.0.0.1:0"})
	s := subscribe(t, p, "")
	// Batch 0, the start snapshot, may or may not have reached s: read
	// whatever comes until the PONG has been counted.
	if err := s.Ping(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.Pongs() == 0 {
		_ = s.SetDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := s.Recv(); err != nil && !isTimeout(err) {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatal("no PONG in 10 s")
		}
	}
	rep := ep(p.ReplayAddr())
	if err := ProbeReplay(rep, 5*time.Second); err != nil {
		t.Fatalf("probe of a live publisher: %v", err)
	}
	if got := p.Stats().ReplayBatches; got != 0 {
		t.Fatalf("a probe replayed %d batches", got)
	}
	p.Close()
	if err := ProbeReplay(rep, time.Second); err == nil {
		t.Fatal("a probe of a closed publisher succeeded")
	}
	_ = s.SetDeadline(time.Now().Add(10 * time.Second))
	for {
		if _, err := s.Recv(); err != nil {
			if isTimeout(err) {
				t.Fatal("the subscription outlived the publisher")
			}
			break
		}
	}
}
