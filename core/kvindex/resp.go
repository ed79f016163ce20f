package kvindex

// A minimal RESP2 client (https://redis.io/docs/reference/protocol-spec/)
// for the few commands the Valkey/Redis backend sends, pipelined: a client
// library would be a dependency for five commands. Every reply is read
// with its lengths bounded, and any error closes the connection so the
// next call starts clean (a reply half read would desynchronise the
// stream).

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"
)

// respError is an error reply (-ERR ...).
type respError string

func (e respError) Error() string { return "redis: " + string(e) }

// Bounds of a reply.
const (
	maxBulk  = 512 << 20
	maxArray = 1 << 24
)

type redisClient struct {
	addr    string
	timeout time.Duration

	mu    sync.Mutex
	conn  net.Conn
	r     *bufio.Reader
	w     []byte
	dials int64 // connections made: a redial may meet a restarted server
}

func newRedisClient(addr string, timeout time.Duration) *redisClient {
	return &redisClient{addr: addr, timeout: timeout}
}

func (c *redisClient) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.drop()
}

func (c *redisClient) drop() {
	if c.conn != nil {
		_ = c.conn.Close()
		c.conn = nil
	}
}

// do sends cmds in one pipeline and returns their replies, in order. An
// error reply of one command is returned as a respError in its place; a
// transport error fails the whole call.
func (c *redisClient) do(cmds [][][]byte) ([]any, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		conn, err := net.DialTimeout("tcp", c.addr, c.timeout)
		if err != nil {
			return nil, err
		}
		c.conn, c.r = conn, bufio.NewReaderSize(conn, 64<<10)
		c.dials++
	}
	_ = c.conn.SetDeadline(time.Now().Add(c.timeout))
	w := c.w[:0]
	for _, args := range cmds {
		w = append(w, '*')
		w = strconv.AppendInt(w, int64(len(args)), 10)
		w = append(w, '\r', '\n')
		for _, a := range args {
			w = append(w, '$')
			w = strconv.AppendInt(w, int64(len(a)), 10)
			w = append(w, '\r', '\n')
			w = append(w, a...)
			w = append(w, '\r', '\n')
		}
	}
	c.w = w[:0]
	if len(w) > 1<<20 {
		c.w = nil // do not keep a large buffer around
	}
	if _, err := c.conn.Write(w); err != nil {
		c.drop()
		return nil, err
	}
	out := make([]any, len(cmds))
	for i := range out {
		v, err := readReply(c.r, 0)
		if err != nil {
			c.drop()
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

// dialCount returns how many connections the client has made.
func (c *redisClient) dialCount() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dials
}

var errRESP = errors.New("redis: malformed reply")

func readLine(r *bufio.Reader) ([]byte, error) {
	line, err := r.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, fmt.Errorf("%w: a line longer than %d bytes", errRESP, r.Size())
		}
		return nil, err
	}
	if len(line) < 3 || line[len(line)-2] != '\r' {
		return nil, errRESP
	}
	return line[:len(line)-2], nil
}

func readReply(r *bufio.Reader, depth int) (any, error) {
	if depth > 4 {
		return nil, fmt.Errorf("%w: nested too deep", errRESP)
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
		return respError(body), nil
	case ':':
		n, err := strconv.ParseInt(string(body), 10, 64)
		if err != nil {
			return nil, errRESP
		}
		return n, nil
	case '$':
		n, err := strconv.ParseInt(string(body), 10, 64)
		if err != nil || n < -1 || n > maxBulk {
			return nil, errRESP
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
			return nil, errRESP
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
	return nil, fmt.Errorf("%w: type byte %q", errRESP, line[0])
}
