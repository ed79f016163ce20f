package kvevents

import (
	"bufio"
	"bytes"
	"net"
	"time"
)

// nopConn is a net.Conn that swallows writes (PONG replies of the fuzzed
// reader).
type nopConn struct{}

func (nopConn) Read([]byte) (int, error)         { return 0, net.ErrClosed }
func (nopConn) Write(b []byte) (int, error)      { return len(b), nil }
func (nopConn) Close() error                     { return nil }
func (nopConn) LocalAddr() net.Addr              { return nil }
func (nopConn) RemoteAddr() net.Addr             { return nil }
func (nopConn) SetDeadline(time.Time) error      { return nil }
func (nopConn) SetReadDeadline(time.Time) error  { return nil }
func (nopConn) SetWriteDeadline(time.Time) error { return nil }

func bufioReader(p []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(p)) }
