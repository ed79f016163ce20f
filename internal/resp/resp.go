// Package resp is a minimal RESP2 client
// (https://redis.io/docs/reference/protocol-spec/) for the few commands the
// library sends to Valkey or Redis (the cluster index's backend, the shared
// KV tier), pipelined: a client library would be a dependency for a handful
// of commands.
//
// A Client holds one connection, dialled lazily and redialled after any
// failure. Every call is bounded in time as a whole: waiting for the
// connection (a concurrent call holding it), dialling and the round trip
// all fit within the operation timeout, so a dead or slow server costs a
// caller at most that long. Every reply is read with its lengths bounded,
// and any transport error closes the connection so the next call starts
// clean (a reply half read would desynchronise the stream). A Client is
// safe for concurrent use; calls are serialised on its one connection.
//
// Large values (Cluster.Call): a command may be written in pieces, its
// value sent from where it lies; the commands may be kept a window ahead
// of the replies read; and bulk replies may be read by the caller,
// straight into its own memory, instead of into fresh buffers.
//
// A client made with Options may speak TLS (Options.TLS: the handshake,
// and the verification of the server's certificate, on every new
// connection; a failure is a TLSError and the connection is closed, never
// used in plaintext) and authenticate (Options.Auth: AUTH on every new
// connection, before its first command; a refusal is an AuthError, whose
// message never holds the password).
package resp

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync/atomic"
	"time"
)

// Error is an error reply (-ERR ...), returned in the place of the command
// that drew it.
type Error string

func (e Error) Error() string { return "redis: " + string(e) }

// ErrBusy is returned when the connection stayed held by other calls for
// the whole operation timeout. It is a timeout (IsTimeout).
var ErrBusy = errors.New("redis: connection busy past the operation timeout")

// ErrClosed is returned by every call after Close.
var ErrClosed = errors.New("redis: client closed")

// ErrMalformed is a reply that breaks the protocol or its bounds.
var ErrMalformed = errors.New("redis: malformed reply")

// AuthError is a connection's AUTH refused by the server (wrong password,
// unknown or disabled user), or its credentials not readable. Its message
// never holds the password: the server's reply is quoted with any copy of
// the password in it replaced.
type AuthError struct{ msg string }

func (e *AuthError) Error() string { return "redis: authentication failed: " + e.msg }

// TLSError is a TLS handshake that failed: the server's certificate not
// verified (unknown authority, expired, another name), no TLS on the
// server's side, or the server refusing the client's certificate.
type TLSError struct{ Err error }

func (e *TLSError) Error() string { return "redis: TLS handshake failed: " + e.Err.Error() }

func (e *TLSError) Unwrap() error { return e.Err }

// IsAuth reports whether err is an AuthError.
func IsAuth(err error) bool {
	var a *AuthError
	return errors.As(err, &a)
}

// IsTLS reports whether err is a TLSError.
func IsTLS(err error) bool {
	var t *TLSError
	return errors.As(err, &t)
}

// Options configure a client made with NewClientOptions.
type Options struct {
	DialTimeout time.Duration // bound on the TCP connect
	OpTimeout   time.Duration // bound on a whole call: wait, connect, TLS handshake, AUTH, round trip
	// TLS, when not nil, is the configuration of every connection's TLS
	// handshake (its ServerName and roots included); nil: plaintext.
	TLS *tls.Config
	// Auth, when not nil, gives the credentials of a new connection: it is
	// called on each connect (so a rotated password file is read again),
	// and a non-empty password is sent as AUTH [username] password. An
	// error from it fails the connect as an AuthError whose message is
	// the error's (it must not hold the password).
	Auth func() (username string, password []byte, err error)
}

// Bounds of a reply.
const (
	maxBulk  = 512 << 20
	maxArray = 1 << 24
)

// Client is a pipelining RESP2 client on one connection.
type Client struct {
	addr        string
	dialTimeout time.Duration
	opTimeout   time.Duration
	tls         *tls.Config
	auth        func() (string, []byte, error)

	sem    chan struct{} // the connection's lock, taken with a deadline
	closed bool          // under sem: Close ran, no call dials again
	conn   net.Conn
	r      *bufio.Reader
	w      []byte
	dials  atomic.Int64 // connections made: a redial may meet a restarted server
}

// NewClient returns a client for addr (host:port) whose dial and whole
// operations are each bounded by timeout. It does not connect yet.
func NewClient(addr string, timeout time.Duration) *Client {
	return NewClientTimeouts(addr, timeout, timeout)
}

// NewClientTimeouts returns a client whose dial is bounded by dial and each
// call as a whole (waiting for the connection, dial, round trip) by op.
func NewClientTimeouts(addr string, dial, op time.Duration) *Client {
	return &Client{addr: addr, dialTimeout: dial, opTimeout: op, sem: make(chan struct{}, 1)}
}

// NewClientOptions returns a client for addr with o's timeouts, TLS and
// credentials. It does not connect yet.
func NewClientOptions(addr string, o Options) *Client {
	c := NewClientTimeouts(addr, o.DialTimeout, o.OpTimeout)
	if o.TLS != nil {
		c.tls = o.TLS.Clone()
	}
	c.auth = o.Auth
	return c
}

// Close closes the connection, once the call holding it (if any) is done;
// every later call fails with ErrClosed, dialling nothing.
func (c *Client) Close() {
	c.sem <- struct{}{}
	c.closed = true
	c.drop()
	<-c.sem
}

// Reset drops the connection, once the call holding it (if any) is done;
// the next call dials again (a new connection reads the credentials anew).
func (c *Client) Reset() {
	c.sem <- struct{}{}
	c.drop()
	<-c.sem
}

func (c *Client) drop() {
	if c.conn != nil {
		_ = c.conn.Close()
		c.conn = nil
	}
}

// DialCount returns how many connections the client has made.
func (c *Client) DialCount() int64 { return c.dials.Load() }

// Do sends cmds in one pipeline and returns their replies, in order:
// string (simple string), Error, int64, []byte (bulk; nil for a null bulk)
// or []any (array). An error reply of one command is returned as an Error
// in its place; a transport error or timeout fails the whole call.
func (c *Client) Do(cmds [][][]byte) ([]any, error) {
	return c.DoDeadline(cmds, time.Now().Add(c.opTimeout))
}

// DoDeadline is Do bounded by deadline instead of the operation timeout.
func (c *Client) DoDeadline(cmds [][][]byte, deadline time.Time) ([]any, error) {
	if err := c.acquire(deadline); err != nil {
		return nil, err
	}
	defer func() { <-c.sem }()
	w := c.w[:0]
	for _, args := range cmds {
		w = AppendCommand(w, args...)
	}
	c.w = w[:0]
	if len(w) > 1<<20 {
		c.w = nil // do not keep a large buffer around
	}
	return c.roundTrip(w, len(cmds), deadline)
}

// DoEncoded is Do for a pipeline the caller encoded itself (AppendCommand,
// or AppendArray and AppendBulk for large values written in place): buf
// holds n commands.
func (c *Client) DoEncoded(buf []byte, n int) ([]any, error) {
	deadline := time.Now().Add(c.opTimeout)
	if err := c.acquire(deadline); err != nil {
		return nil, err
	}
	defer func() { <-c.sem }()
	return c.roundTrip(buf, n, deadline)
}

// Bulk reads a bulk string reply in the caller's place (Call.Bulk): i is
// the command's index in the call, n the string's length. It must read
// exactly n bytes from r (the CRLF after them is the client's) and
// returns the value put in the command's place; an error fails the call
// as a transport error does (the connection is dropped). In cluster mode
// it is called for several nodes' replies at once.
type Bulk func(i, n int, r *bufio.Reader) (any, error)

// Call is a pipeline for Cluster.Call.
type Call struct {
	// Cmds[i] is command i's bytes in one or more pieces written in
	// order (AppendCommand's, or AppendArray and AppendBulk headers with
	// each large value a piece of its own, sent from where it lies
	// without a copy).
	Cmds [][][]byte
	// Keys[i] is command i's key, by which cluster mode routes it.
	Keys [][]byte
	// Window is the most commands written on a connection whose replies
	// are not read yet (0: all are written first). Large replies flow
	// faster in a window of a few megabytes: a server handed a whole
	// batch of them at once copies them all into its output buffers
	// before the client reads much of them.
	Window int
	// Bulk, when not nil, reads every bulk string reply instead of Do's
	// fresh []byte (a null bulk is still nil).
	Bulk Bulk
}

// call takes the connection by deadline and runs pipeline on it.
func (c *Client) call(slots [][][]byte, idx []int, window int, bulk Bulk, deadline time.Time) ([]any, error) {
	if err := c.acquire(deadline); err != nil {
		return nil, err
	}
	defer func() { <-c.sem }()
	return c.pipeline(slots, idx, window, bulk, deadline)
}

// pipeline runs one pipeline on the connection (which must be acquired):
// slots[k] are the pieces of the command whose reply is the k-th, at most
// window of them (0: all) written ahead of the replies read; bulk, when
// not nil, reads the bulk replies of slot k as command idx[k]'s (idx nil:
// k; a negative idx: not through bulk).
func (c *Client) pipeline(slots [][][]byte, idx []int, window int, bulk Bulk, deadline time.Time) ([]any, error) {
	_ = c.conn.SetDeadline(deadline)
	n := len(slots)
	if window <= 0 || window > n {
		window = n
	}
	sent := 0
	var nb net.Buffers
	write := func(upto int) error {
		nb = nb[:0]
		for ; sent < upto; sent++ {
			nb = append(nb, slots[sent]...)
		}
		w := nb // WriteTo consumes its receiver
		_, err := w.WriteTo(c.conn)
		return err
	}
	if err := write(window); err != nil {
		c.drop()
		return nil, c.tlsAlert(err)
	}
	out := make([]any, n)
	for k := range out {
		i := k
		if idx != nil {
			i = idx[k]
		}
		var v any
		var err error
		if bulk != nil && i >= 0 {
			v, err = readReplyBulk(c.r, i, bulk)
		} else {
			v, err = ReadReply(c.r)
		}
		if err != nil {
			c.drop()
			return nil, c.tlsAlert(err)
		}
		out[k] = v
		// Top the window up once half of it has been read.
		if sent < n && sent-(k+1) <= window/2 {
			if err := write(min(n, k+1+window)); err != nil {
				c.drop()
				return nil, c.tlsAlert(err)
			}
		}
	}
	return out, nil
}

// acquire takes the connection, dialling it if needed, by deadline.
func (c *Client) acquire(deadline time.Time) error {
	t := time.NewTimer(time.Until(deadline))
	select {
	case c.sem <- struct{}{}:
		t.Stop()
	case <-t.C:
		return ErrBusy
	}
	if c.closed {
		<-c.sem
		return ErrClosed
	}
	if c.conn == nil {
		dt := min(c.dialTimeout, time.Until(deadline))
		if dt <= 0 {
			<-c.sem
			return ErrBusy
		}
		conn, err := c.dial(dt, deadline)
		if err != nil {
			<-c.sem
			return err
		}
		c.conn, c.r = conn, bufio.NewReaderSize(conn, 64<<10)
		c.dials.Add(1)
	}
	return nil
}

// dial connects (within dt), then does the TLS handshake and AUTH where
// configured (by deadline). A connection that fails either is closed:
// nothing is ever sent on it in plaintext instead.
func (c *Client) dial(dt time.Duration, deadline time.Time) (net.Conn, error) {
	conn, err := net.DialTimeout("tcp", c.addr, dt)
	if err != nil {
		return nil, err
	}
	_ = conn.SetDeadline(deadline)
	if c.tls != nil {
		tc := tls.Client(conn, c.tls)
		if err := tc.Handshake(); err != nil {
			_ = conn.Close()
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return nil, err // a server too slow to answer: a timeout, as for any round trip
			}
			return nil, &TLSError{Err: err}
		}
		conn = tc
	}
	// The connection's first exchange: AUTH, or with TLS and no AUTH a
	// PING. Under TLS 1.3 a server that refuses the client's certificate
	// (none, or one it does not trust) says so only after the client's
	// side of the handshake has completed: by an alert or by closing the
	// connection, met by this first write or read. So a failure of this
	// exchange on a TLS connection, other than a timeout or a refused
	// AUTH, is the TLS session's, reported here rather than as a failure
	// of the caller's first command.
	switch {
	case c.auth != nil:
		err = authenticate(conn, c.auth)
	case c.tls != nil:
		err = ping(conn)
	}
	if err != nil {
		_ = conn.Close()
		if c.tls != nil && !IsAuth(err) && !IsTimeout(err) {
			err = &TLSError{Err: err}
		}
		return nil, err
	}
	return conn, nil
}

// ping sends PING on a new connection and reads its reply: any reply, an
// error included (NOAUTH from a server that wants AUTH the client does
// not send: its commands will say so).
func ping(conn net.Conn) error {
	if _, err := conn.Write(AppendCommand(nil, []byte("PING"))); err != nil {
		return err
	}
	r := bufio.NewReaderSize(conn, 512)
	if _, err := ReadReply(r); err != nil {
		return err
	}
	if r.Buffered() > 0 {
		return fmt.Errorf("%w: bytes after the reply to PING", ErrMalformed)
	}
	return nil
}

// tlsAlert returns err as a TLSError when it is a TLS alert from the
// server: under TLS 1.3 a server that refuses the client's certificate
// (none, or one it does not trust) says so after the client's side of the
// handshake has completed, on the connection's first read.
func (c *Client) tlsAlert(err error) error {
	var oe *net.OpError
	if c.tls != nil && errors.As(err, &oe) && oe.Op == "remote error" {
		return &TLSError{Err: err}
	}
	return err
}

// authenticate sends AUTH on a new connection and reads its reply.
func authenticate(conn net.Conn, auth func() (string, []byte, error)) error {
	user, pw, err := auth()
	if err != nil {
		return &AuthError{msg: err.Error()}
	}
	defer clear(pw) // a fresh copy from auth: not kept past the connect
	if len(pw) == 0 {
		return nil
	}
	var w []byte
	if user != "" {
		w = AppendCommand(nil, []byte("AUTH"), []byte(user), pw)
	} else {
		w = AppendCommand(nil, []byte("AUTH"), pw)
	}
	_, err = conn.Write(w)
	clear(w)
	if err != nil {
		return err
	}
	// A reader of the connection's own: AUTH's reply is the only bytes
	// before the first command's, and it is read whole.
	r := bufio.NewReaderSize(conn, 512)
	v, err := ReadReply(r)
	if err != nil {
		return err
	}
	if r.Buffered() > 0 {
		return fmt.Errorf("%w: bytes after the reply to AUTH", ErrMalformed)
	}
	switch v := v.(type) {
	case string:
		if v == "OK" {
			return nil
		}
	case Error:
		msg := []byte(v)
		if bytes.Contains(msg, pw) {
			msg = bytes.ReplaceAll(msg, pw, []byte("[password]"))
		}
		if user != "" {
			return &AuthError{msg: fmt.Sprintf("user %q: %s", user, msg)}
		}
		return &AuthError{msg: string(msg)}
	}
	return fmt.Errorf("%w: an unexpected reply to AUTH", ErrMalformed)
}

func (c *Client) roundTrip(w []byte, n int, deadline time.Time) ([]any, error) {
	_ = c.conn.SetDeadline(deadline)
	if _, err := c.conn.Write(w); err != nil {
		c.drop()
		return nil, c.tlsAlert(err)
	}
	return c.readReplies(n)
}

func (c *Client) readReplies(n int) ([]any, error) {
	out := make([]any, n)
	for i := range out {
		v, err := ReadReply(c.r)
		if err != nil {
			c.drop()
			return nil, c.tlsAlert(err)
		}
		out[i] = v
	}
	return out, nil
}

// AppendCommand appends one command, an array of bulk strings, to w.
func AppendCommand(w []byte, args ...[]byte) []byte {
	w = AppendArray(w, len(args))
	for _, a := range args {
		w = AppendBulk(w, len(a))
		w = append(w, a...)
		w = append(w, '\r', '\n')
	}
	return w
}

// AppendArray appends the header of a command of n arguments; each
// argument follows as AppendBulk and its bytes and CRLF.
func AppendArray(w []byte, n int) []byte {
	w = append(w, '*')
	w = strconv.AppendInt(w, int64(n), 10)
	return append(w, '\r', '\n')
}

// AppendBulk appends the header of a bulk string of size bytes; the caller
// appends the bytes and then "\r\n".
func AppendBulk(w []byte, size int) []byte {
	w = append(w, '$')
	w = strconv.AppendInt(w, int64(size), 10)
	return append(w, '\r', '\n')
}

// IsTimeout reports whether err is a timeout: a network deadline passed,
// or the connection stayed busy (ErrBusy).
func IsTimeout(err error) bool {
	if errors.Is(err, ErrBusy) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func readLine(r *bufio.Reader) ([]byte, error) {
	line, err := r.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, fmt.Errorf("%w: a line longer than %d bytes", ErrMalformed, r.Size())
		}
		return nil, err
	}
	if len(line) < 3 || line[len(line)-2] != '\r' {
		return nil, ErrMalformed
	}
	return line[:len(line)-2], nil
}

// ReadReply reads one reply (see Do for the types).
func ReadReply(r *bufio.Reader) (any, error) { return readReply(r, 0) }

// readReplyBulk reads one reply of command i, a bulk string through bulk.
func readReplyBulk(r *bufio.Reader, i int, bulk Bulk) (any, error) {
	b, err := r.Peek(1)
	if err != nil {
		return nil, err
	}
	if b[0] != '$' {
		return ReadReply(r)
	}
	line, err := readLine(r)
	if err != nil {
		return nil, err
	}
	n, err := strconv.ParseInt(string(line[1:]), 10, 64)
	if err != nil || n < -1 || n > maxBulk {
		return nil, ErrMalformed
	}
	if n == -1 {
		return nil, nil
	}
	v, err := bulk(i, int(n), r)
	if err != nil {
		return nil, err
	}
	var crlf [2]byte
	if _, err := io.ReadFull(r, crlf[:]); err != nil {
		return nil, err
	}
	if crlf != [2]byte{'\r', '\n'} {
		return nil, fmt.Errorf("%w: a bulk string not followed by CRLF", ErrMalformed)
	}
	return v, nil
}

func readReply(r *bufio.Reader, depth int) (any, error) {
	if depth > 4 {
		return nil, fmt.Errorf("%w: nested too deep", ErrMalformed)
	}
	line, err := readLine(r)
	if err != nil {
		return nil, err
	}
	body := line[1:]
	switch line[0] {
	case '+':
		return string(body), nil
	case '-':
		return Error(body), nil
	case ':':
		n, err := strconv.ParseInt(string(body), 10, 64)
		if err != nil {
			return nil, ErrMalformed
		}
		return n, nil
	case '$':
		n, err := strconv.ParseInt(string(body), 10, 64)
		if err != nil || n < -1 || n > maxBulk {
			return nil, ErrMalformed
		}
		if n == -1 {
			return nil, nil
		}
		b := make([]byte, n+2)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, err
		}
		return b[:n], nil
	case '*':
		n, err := strconv.ParseInt(string(body), 10, 64)
		if err != nil || n < -1 || n > maxArray {
			return nil, ErrMalformed
		}
		if n == -1 {
			return nil, nil
		}
		out := make([]any, n)
		for i := range out {
			if out[i], err = readReply(r, depth+1); err != nil {
				return nil, err
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("%w: type byte %q", ErrMalformed, line[0])
}
