package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"sync/atomic"
	"syscall"
	"time"
)

// Message is one published batch as a subscriber receives it.
type Message struct {
	Topic   string
	Seq     int64
	Payload []byte
}

// MaxPayload bounds a received batch (a publisher's batches are far
// smaller: MaxBatchEvents events), so a broken or hostile publisher cannot
// make a subscriber allocate without bound.
const MaxPayload = 256 << 20

// SubConn is a SUB connection to one publisher. It connects: the
// publisher's PUB socket must bind the endpoint (kvplug's publisher does by
// default).
type SubConn struct {
	z     *zconn
	pongs atomic.Int64
}

// DialError is DialSub's error when nothing accepted the connection: it
// names the endpoint and says what the subscriber waits for.
type DialError struct {
	Endpoint string
	Err      error
}

func (e *DialError) Error() string {
	hint := ""
	if errors.Is(e.Err, syscall.ECONNREFUSED) || errors.Is(e.Err, syscall.ENOENT) {
		// The usual cause: a publisher that connects (kvplug's in connect
		// mode, vLLM's for a host other than "*") or none yet.
		hint = " (nothing is bound there: the publisher must bind this endpoint; kvplug's binds by default, " +
			"vLLM's only a wildcard tcp://*:PORT or ipc:// endpoint)"
	}
	return fmt.Sprintf("kvevents: SUB connecting to %s: %v%s", e.Endpoint, e.Err, hint)
}

func (e *DialError) Unwrap() error { return e.Err }

// DialSub connects a SUB socket to a publisher's bound endpoint and
// subscribes to topic (a prefix; "" is every topic). A failed connection
// is a *DialError.
func DialSub(ep, topic string, timeout time.Duration) (*SubConn, error) {
	e, err := parseEndpoint(ep)
	if err != nil {
		return nil, err
	}
	c, err := net.DialTimeout(e.network, e.addr, timeout)
	if err != nil {
		return nil, &DialError{Endpoint: ep, Err: err}
	}
	z, err := handshake(c, "SUB", false)
	if err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("kvevents: SUB handshake with %s: %w", ep, err)
	}
	// ZMTP 3.0 subscription: a message of 0x01 and the topic prefix.
	if _, err := c.Write(appendMessage(nil, append([]byte{1}, topic...))); err != nil {
		_ = c.Close()
		return nil, err
	}
	return &SubConn{z: z}, nil
}

// SetDeadline sets the deadline of the next reads.
func (s *SubConn) SetDeadline(t time.Time) error { return s.z.c.SetReadDeadline(t) }

// Recv returns the next batch message. PONGs that arrive on the way are
// counted (Pongs).
func (s *SubConn) Recv() (Message, error) {
	fr, err := s.z.readMessage(MaxPayload, 3, func(name string, _ []byte) {
		if name == "PONG" {
			s.pongs.Add(1)
		}
	})
	if err != nil {
		return Message{}, err
	}
	return parseMessage(fr)
}

// Ping sends a ZMTP heartbeat (PING) to the publisher, which answers PONG
// (kvplug's publisher and libzmq's do) whether or not it has batches to
// send: a later Recv counts the answer (Pongs), so a subscriber can tell an
// idle publisher from a silent connection.
func (s *SubConn) Ping() error {
	// PING: a TTL (2 bytes, tenths of a second; 0: none, so the publisher
	// sets no timer of its own), then a context the PONG echoes. A peer
	// that stops reading cannot block the caller for long.
	_ = s.z.c.SetWriteDeadline(time.Now().Add(handshakeTimeout))
	return s.z.writeCommand("PING", []byte{0, 0, 'k', 'v'})
}

// Pongs returns how many PONGs Recv has read.
func (s *SubConn) Pongs() int64 { return s.pongs.Load() }

// Close closes the connection.
func (s *SubConn) Close() error { return s.z.c.Close() }

// parseMessage checks the three frames of a batch message.
func parseMessage(fr [][]byte) (Message, error) {
	if len(fr) != 3 {
		return Message{}, fmt.Errorf("kvevents: a message of %d frames, 3 expected (topic, sequence, payload)", len(fr))
	}
	if len(fr[1]) != 8 {
		return Message{}, fmt.Errorf("kvevents: a sequence frame of %d bytes, 8 expected", len(fr[1]))
	}
	return Message{Topic: string(fr[0]), Seq: int64(binary.BigEndian.Uint64(fr[1])), Payload: fr[2]}, nil
}

// maxReplayBytes bounds what one Replay call accepts.
const maxReplayBytes = 1 << 30

// Replay asks a publisher's ROUTER endpoint for every batch it holds from
// sequence number start on and returns them in order (possibly starting
// after start, when the oldest wanted ones are gone, or empty).
func Replay(ep string, start int64, timeout time.Duration) ([]Message, error) {
	z, err := dialDealer(ep, timeout)
	if err != nil {
		return nil, err
	}
	defer z.c.Close()
	_ = z.c.SetDeadline(time.Now().Add(timeout))
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], uint64(start))
	if _, err := z.c.Write(appendMessage(nil, nil, req[:])); err != nil {
		return nil, err
	}
	var out []Message
	total := 0
	for {
		fr, err := z.readMessage(MaxPayload, 5, nil)
		if err != nil {
			return nil, err
		}
		// [delimiter, topic, seq, payload]; older publishers send no topic.
		if len(fr) > 0 && len(fr[0]) == 0 {
			fr = fr[1:]
		}
		if len(fr) == 2 {
			fr = append([][]byte{nil}, fr...)
		}
		m, err := parseMessage(fr)
		if err != nil {
			return nil, err
		}
		if m.Seq == EndSeq {
			return out, nil
		}
		total += len(m.Payload)
		if total > maxReplayBytes {
			return nil, fmt.Errorf("kvevents: replay of more than %d bytes", maxReplayBytes)
		}
		out = append(out, m)
	}
}

// ProbeReplay checks that a publisher's ROUTER endpoint answers: it asks
// for the batches from the last possible sequence number on, which no
// publisher holds, so the answer is the end of replay alone. vLLM's
// publishers answer it as kvplug's do.
func ProbeReplay(ep string, timeout time.Duration) error {
	_, err := Replay(ep, math.MaxInt64, timeout)
	return err
}

// RequestSnapshot asks a kvplug publisher's ROUTER endpoint for a snapshot
// (SnapshotSeq): it then publishes AllBlocksCleared and every cached block
// on its PUB socket. Publishers grant one a second.
func RequestSnapshot(ep string, timeout time.Duration) error {
	_, err := Replay(ep, SnapshotSeq, timeout)
	return err
}

func dialDealer(ep string, timeout time.Duration) (*zconn, error) {
	e, err := parseEndpoint(ep)
	if err != nil {
		return nil, err
	}
	c, err := net.DialTimeout(e.network, e.addr, timeout)
	if err != nil {
		return nil, err
	}
	z, err := handshake(c, "DEALER", false)
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	return z, nil
}
