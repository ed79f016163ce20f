package kvevents

// A minimal ZMTP 3.0 (https://rfc.zeromq.org/spec/23/) with the NULL
// mechanism: the greeting, the READY handshake and message framing, enough
// for PUB, SUB, ROUTER and DEALER peers to talk to libzmq (pyzmq, vLLM's
// consumers) and to each other.
//
// Why not a ZMQ library: libzmq (through cgo) would make libkvplug.so depend
// on another shared library, and the pure-Go implementation
// (github.com/go-zeromq/zmq4) allocates a frame's buffer from the length its
// peer announces before reading it (a hostile or broken peer can make the
// engine process allocate 2^63 bytes), sends PUB messages to subscribers one
// after another from one goroutine (one stalled subscriber stalls all) and
// drops over its high-water mark without a count, and routes ROUTER replies
// by the peer's announced identity, which is empty for every anonymous
// libzmq DEALER. The publisher needs the opposite of each: bounded reads, a
// queue per subscriber with counted drops, replies on the connection that
// asked. The wire protocol itself is small; this file is all of it that
// kvplug uses, and every read is bounded.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// Frame flags (ZMTP 3.0, section "Framing").
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

// handshakeTimeout bounds the greeting and READY exchange, so a peer that
// connects and says nothing costs a goroutine for a few seconds only.
const handshakeTimeout = 5 * time.Second

// maxCommandSize bounds a command frame (READY with its properties, PING,
// SUBSCRIBE); real ones are tens of bytes.
const maxCommandSize = 4096

var errProtocol = errors.New("zmtp: protocol error")

// greeting returns our 64-byte ZMTP 3.0 greeting with the NULL mechanism.
func greeting(asServer bool) []byte {
	g := make([]byte, 64)
	g[0], g[9] = 0xFF, 0x7F // signature: 0xFF, 8 bytes of padding, 0x7F
	g[10], g[11] = 3, 0     // version 3.0: libzmq 4.x peers then speak 3.0
	copy(g[12:32], "NULL")
	if asServer {
		g[32] = 1
	}
	return g
}

// zconn is one ZMTP connection after its handshake.
type zconn struct {
	c        net.Conn
	r        *bufio.Reader
	fs       frameState // the frame being read
	msg      [][]byte   // the frames read so far of the message being read
	peerType string     // the peer's Socket-Type
	peerID   []byte     // the peer's Identity property (may be empty)
}

// compatible lists the socket types each of ours may talk to (ZMTP 3.0's
// table, restricted to what kvplug uses).
var compatible = map[string][]string{
	"PUB":    {"SUB", "XSUB"},
	"SUB":    {"PUB", "XPUB"},
	"ROUTER": {"DEALER", "REQ", "ROUTER"},
	"DEALER": {"ROUTER", "REP", "DEALER"},
}

// handshake runs the greeting and the NULL mechanism's READY exchange on c
// as a socket of type ours, and checks the peer's type.
func handshake(c net.Conn, ours string, asServer bool) (*zconn, error) {
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(greeting(asServer)); err != nil {
		return nil, err
	}
	z := &zconn{c: c, r: bufio.NewReaderSize(c, 64<<10)}
	var g [64]byte
	if _, err := io.ReadFull(z.r, g[:]); err != nil {
		return nil, fmt.Errorf("zmtp: reading the greeting: %w", err)
	}
	if g[0] != 0xFF || g[9] != 0x7F {
		return nil, fmt.Errorf("%w: not a ZMTP peer", errProtocol)
	}
	if g[10] < 3 {
		return nil, fmt.Errorf("%w: peer speaks ZMTP %d.%d, 3.0 or later is needed", errProtocol, g[10], g[11])
	}
	if mech := string(bytes.TrimRight(g[12:32], "\x00")); mech != "NULL" {
		return nil, fmt.Errorf("%w: peer asks for security mechanism %q; only NULL is supported", errProtocol, mech)
	}
	props := [][2]string{{"Socket-Type", ours}}
	if ours == "DEALER" {
		props = append(props, [2]string{"Identity", ""})
	}
	if err := z.writeCommand("READY", readyBody(props)); err != nil {
		return nil, err
	}
	name, body, err := z.readCommand()
	if err != nil {
		return nil, err
	}
	if name == "ERROR" {
		return nil, fmt.Errorf("%w: peer refused the connection: %q", errProtocol, body)
	}
	if name != "READY" {
		return nil, fmt.Errorf("%w: expected READY, got %q", errProtocol, name)
	}
	p, err := parseProps(body)
	if err != nil {
		return nil, err
	}
	z.peerType = strings.ToUpper(p["socket-type"])
	z.peerID = []byte(p["identity"])
	ok := false
	for _, t := range compatible[ours] {
		ok = ok || t == z.peerType
	}
	if !ok {
		return nil, fmt.Errorf("%w: a %s socket cannot talk to a %q peer", errProtocol, ours, z.peerType)
	}
	return z, nil
}

func readyBody(props [][2]string) []byte {
	var b []byte
	for _, p := range props {
		b = append(b, byte(len(p[0])))
		b = append(b, p[0]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(p[1])))
		b = append(b, p[1]...)
	}
	return b
}

// parseProps parses READY's metadata; names are case-insensitive.
func parseProps(b []byte) (map[string]string, error) {
	out := map[string]string{}
	for len(b) > 0 {
		n := int(b[0])
		if 1+n+4 > len(b) {
			return nil, fmt.Errorf("%w: truncated READY property", errProtocol)
		}
		name := strings.ToLower(string(b[1 : 1+n]))
		b = b[1+n:]
		vl := binary.BigEndian.Uint32(b)
		b = b[4:]
		if uint64(vl) > uint64(len(b)) {
			return nil, fmt.Errorf("%w: truncated READY property %q", errProtocol, name)
		}
		out[name] = string(b[:vl])
		b = b[vl:]
	}
	return out, nil
}

// writeCommand sends one command frame.
func (z *zconn) writeCommand(name string, body []byte) error {
	b := make([]byte, 0, 1+len(name)+len(body))
	b = append(b, byte(len(name)))
	b = append(b, name...)
	b = append(b, body...)
	_, err := z.c.Write(appendFrame(nil, b, flagCommand))
	return err
}

// appendFrame appends one frame with flags to dst.
func appendFrame(dst, body []byte, flags byte) []byte {
	if len(body) > 255 {
		dst = append(dst, flags|flagLong)
		dst = binary.BigEndian.AppendUint64(dst, uint64(len(body)))
	} else {
		dst = append(dst, flags, byte(len(body)))
	}
	return append(dst, body...)
}

// appendMessage appends a multipart message (frames in order) to dst.
func appendMessage(dst []byte, frames ...[]byte) []byte {
	for i, f := range frames {
		var fl byte
		if i < len(frames)-1 {
			fl = flagMore
		}
		dst = appendFrame(dst, f, fl)
	}
	return dst
}

// frameState is a frame being read. A read that fails part way (a read
// deadline, used to poll) leaves it here, so the next call goes on where
// this one stopped instead of losing the stream's framing.
type frameState struct {
	hdr  [9]byte
	nh   int // header bytes read
	body []byte
	nb   int  // body bytes read
	big  bool // the header is complete and body allocated
}

// fill reads into b[*n:] until it is full or a read fails.
func (z *zconn) fill(b []byte, n *int) error {
	for *n < len(b) {
		k, err := z.r.Read(b[*n:])
		*n += k
		if err != nil {
			if *n == len(b) {
				return nil
			}
			return err
		}
	}
	return nil
}

// readFrame reads one frame of at most max bytes (commands: maxCommandSize).
// A longer frame is a protocol error and nothing of it is allocated, so a
// peer cannot make this process allocate what it announces. After an
// error other than a timeout the connection must be dropped.
func (z *zconn) readFrame(max int) (body []byte, flags byte, err error) {
	f := &z.fs
	if !f.big {
		if err = z.fill(f.hdr[:2], &f.nh); err != nil {
			return nil, 0, err
		}
		flags = f.hdr[0]
		if flags&^(flagMore|flagLong|flagCommand) != 0 {
			return nil, 0, fmt.Errorf("%w: reserved frame flags %#x", errProtocol, flags)
		}
		size := uint64(f.hdr[1])
		if flags&flagLong != 0 {
			if err = z.fill(f.hdr[:9], &f.nh); err != nil {
				return nil, 0, err
			}
			size = binary.BigEndian.Uint64(f.hdr[1:9])
		}
		limit := uint64(max)
		if flags&flagCommand != 0 {
			limit = maxCommandSize
		}
		if size > limit {
			return nil, 0, fmt.Errorf("%w: a frame of %d bytes, at most %d accepted here", errProtocol, size, limit)
		}
		f.body, f.nb, f.big = make([]byte, size), 0, true
	}
	if err = z.fill(f.body, &f.nb); err != nil {
		return nil, 0, err
	}
	body, flags = f.body, f.hdr[0]
	*f = frameState{}
	return body, flags, nil
}

// readCommand reads one command frame and splits it into name and body.
func (z *zconn) readCommand() (string, []byte, error) {
	b, fl, err := z.readFrame(0)
	if err != nil {
		return "", nil, err
	}
	if fl&flagCommand == 0 || fl&flagMore != 0 {
		return "", nil, fmt.Errorf("%w: expected a command frame", errProtocol)
	}
	if len(b) < 1 || int(b[0]) > len(b)-1 {
		return "", nil, fmt.Errorf("%w: malformed command", errProtocol)
	}
	return string(b[1 : 1+b[0]]), b[1+b[0]:], nil
}

// readMessage reads the next message: its frames, each at most maxFrame
// bytes, at most maxFrames of them. Commands met on the way are answered
// (PING) or handed to onCommand (SUBSCRIBE, CANCEL); nil ignores them.
func (z *zconn) readMessage(maxFrame, maxFrames int, onCommand func(name string, body []byte)) ([][]byte, error) {
	for {
		b, fl, err := z.readFrame(maxFrame)
		if err != nil {
			return nil, err
		}
		frames := z.msg
		if fl&flagCommand != 0 {
			if len(frames) > 0 || fl&flagMore != 0 || len(b) < 1 || int(b[0]) > len(b)-1 {
				return nil, fmt.Errorf("%w: malformed command", errProtocol)
			}
			name, body := string(b[1:1+b[0]]), b[1+b[0]:]
			switch name {
			case "PING":
				// PING: TTL (2 bytes), then a context to echo in PONG.
				ctx := []byte{}
				if len(body) > 2 {
					ctx = body[2:]
				}
				if err := z.writeCommand("PONG", ctx); err != nil {
					return nil, err
				}
			default:
				if onCommand != nil {
					onCommand(name, body)
				}
			}
			continue
		}
		if len(frames) == maxFrames {
			return nil, fmt.Errorf("%w: a message of more than %d frames", errProtocol, maxFrames)
		}
		z.msg = append(frames, b)
		if fl&flagMore == 0 {
			frames, z.msg = z.msg, nil
			return frames, nil
		}
	}
}

// endpoint is a parsed ZMQ endpoint: tcp://host:port or ipc:///path.
type endpoint struct {
	network, addr string
}

// String returns the endpoint in ZMQ's form.
func (e endpoint) String() string {
	if e.network == "unix" {
		return "ipc://" + e.addr
	}
	return "tcp://" + e.addr
}

// CheckEndpoint returns an error when s is not an endpoint this package
// can use: tcp://HOST:PORT (HOST "*" is every interface) or ipc:///PATH.
func CheckEndpoint(s string) error {
	_, err := parseEndpoint(s)
	return err
}

// parseEndpoint parses a ZMQ endpoint. tcp://*:port means every interface.
func parseEndpoint(s string) (endpoint, error) {
	switch {
	case strings.HasPrefix(s, "tcp://"):
		a := strings.TrimPrefix(s, "tcp://")
		if strings.HasPrefix(a, "*:") {
			a = a[1:]
		}
		_, port, err := net.SplitHostPort(a)
		if err != nil {
			return endpoint{}, fmt.Errorf("endpoint %q: %v", s, err)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
			return endpoint{}, fmt.Errorf("endpoint %q: port %q is not a number in [0, 65535]", s, port)
		}
		return endpoint{"tcp", a}, nil
	case strings.HasPrefix(s, "ipc://"):
		p := strings.TrimPrefix(s, "ipc://")
		if p == "" {
			return endpoint{}, fmt.Errorf("endpoint %q: empty path", s)
		}
		return endpoint{"unix", p}, nil
	}
	return endpoint{}, fmt.Errorf("endpoint %q: only tcp://HOST:PORT and ipc:///PATH endpoints are supported", s)
}

// vllmBinds is vLLM's rule for its PUB endpoint: bind when the endpoint
// has a wildcard host or is ipc/inproc, connect otherwise ("bind stable,
// connect volatile"), so a configuration written for vLLM means the same
// here.
func vllmBinds(s string) bool {
	return strings.Contains(s, "*") || strings.Contains(s, "::") ||
		strings.HasPrefix(s, "ipc://") || strings.HasPrefix(s, "inproc://")
}
