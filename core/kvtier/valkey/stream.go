package valkey

import (
	"bufio"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"io"
	"strconv"
	"sync"

	"github.com/kvplug/kvplug/internal/resp"
	"github.com/zeebo/blake3"
	"github.com/zeebo/xxh3"
)

// Reading values as they arrive. GetInto, GetSegments and ReadInto read
// each GET reply off the connection themselves (resp.Call's Bulk): the
// header into a small array, checked before the payload is read, then the
// payload into the caller's memory (ReadInto) or into a scratch buffer
// reused from call to call (GetInto, GetSegments, which leave the
// caller's memory untouched on a miss), its checksum and MAC computed
// over each piece as it lands, while it is in the cache. Nothing is
// allocated per value. A value that fails a check is read to its end (or
// skipped, when its header already fails) and is a miss, as in decode.
//
// The GETs are pipelined in a window of getWindowBytes (resp.Call's
// Window): a server handed a whole batch of large values at once copies
// them all into its output buffers first, at half the speed it serves
// them from a window (2 MiB values on a local Redis 7: 1.4 against 2.6
// GB/s).

// getWindowBytes is the value bytes a GET pipeline keeps requested and not
// yet read: its window is this over a value's size, at least one value.
const getWindowBytes = 8 << 20

// readChunk is the most payload bytes read from the connection at once,
// so that each piece is still in the cache when the checksum (and the
// MAC) read it.
const readChunk = 256 << 10

// scratches holds the buffers GetInto and GetSegments read payloads
// into (*[]byte), reused across calls.
var scratches sync.Pool

// getSegments reads hashes[i]'s payload into dst[i]'s segments, in one
// pipeline, and reports which were found and checked. With direct the
// payload is read straight into the segments, which hold unspecified
// bytes on a miss; without it the segments are written only on a hit.
func (t *Tier) getSegments(hashes []Hash, dst [][][]byte, direct bool) []bool {
	found := make([]bool, len(hashes))
	if len(hashes) == 0 {
		return found
	}
	if len(dst) < len(hashes) {
		t.misses.Add(int64(len(hashes)))
		return found
	}
	if !t.open(&t.lookupsBr) {
		t.misses.Add(int64(len(hashes)))
		return found
	}
	// The commands, encoded in one buffer of their exact size.
	keyLen := len(t.prefix) + 2*len(Hash{})
	cmdLen := len("*2\r\n$3\r\nGET\r\n$\r\n") + len(strconv.Itoa(keyLen)) + keyLen + 2
	buf := make([]byte, 0, len(hashes)*cmdLen)
	cmds := make([][][]byte, len(hashes))
	pieces := make([][]byte, len(hashes))
	keys := make([][]byte, len(hashes))
	largest := 0
	for i, h := range hashes {
		start := len(buf)
		buf = append(resp.AppendBulk(resp.AppendArray(buf, 2), 3), "GET\r\n"...)
		buf = resp.AppendBulk(buf, keyLen)
		k := len(buf)
		buf = append(t.key(buf, h), '\r', '\n')
		pieces[i] = buf[start:len(buf):len(buf)]
		cmds[i] = pieces[i : i+1 : i+1]
		keys[i] = buf[k : k+keyLen : k+keyLen]
		largest = max(largest, segmentsLen(dst[i]))
	}
	// What each value's read found, set as it is read: a call that fails
	// midway (a timeout, a connection lost, a cluster node lost) keeps
	// the values read whole before it failed.
	state := make([]readState, len(hashes))
	r, err := t.c.Call(&resp.Call{
		Cmds:   cmds,
		Keys:   keys,
		Window: max(1, getWindowBytes/(t.header+largest+1)),
		Bulk: func(i, n int, r *bufio.Reader) (any, error) {
			ok, err := t.readValue(hashes[i], n, r, dst[i], direct)
			if err != nil {
				return nil, err
			}
			state[i] = readBad
			if ok {
				state[i] = readOK
			}
			return nil, nil
		},
	})
	if t.callDone(t.c, err) {
		t.nodeFailures(r)
	} else {
		r = nil
	}
	authCounted := false
	for i := range hashes {
		switch state[i] {
		case readOK:
			found[i] = true
			t.hits.Add(1)
			continue
		case readBad:
			t.corrupt.Add(1)
			continue
		}
		if r != nil {
			if e, ok := r[i].(resp.Error); ok {
				// A wrong-type key, a server refusing reads, a user without GET.
				authCounted = t.refused(e, authCounted) || authCounted
			}
		}
		t.misses.Add(1) // absent, refused, or not read: the call or its node failed (counted once)
	}
	return found
}

// readState is what the read of one value of a pipeline found.
type readState uint8

const (
	readNone readState = iota // not read (absent, refused, the call failed first)
	readOK                    // read whole and checked
	readBad                   // read whole, and failed a check
)

// callDone records the transport outcome of a call on c in c's breaker
// and the counters, and reports whether it has replies.
func (t *Tier) callDone(c *resp.Cluster, err error) bool {
	if errors.Is(err, resp.ErrClosed) {
		t.skipped.Add(1) // after Close: not the server's failure
		return false
	}
	t.result(t.breakerOf(c), err)
	return err == nil
}

func segmentsLen(segs [][]byte) int {
	n := 0
	for _, s := range segs {
		n += len(s)
	}
	return n
}

// readValue reads a GET's value of n bytes from r and reports whether it
// passed every check decode makes and filled segs exactly. It reads the
// whole value whatever it holds; an error is the connection's.
func (t *Tier) readValue(hash Hash, n int, r *bufio.Reader, segs [][]byte, direct bool) (bool, error) {
	ok, err := t.readChecked(hash, n, r, segs, direct)
	if err == nil {
		t.bytesRead.Add(int64(n))
	}
	return ok, err
}

func (t *Tier) readChecked(hash Hash, n int, r *bufio.Reader, segs [][]byte, direct bool) (bool, error) {
	var hb [HeaderBytes + MACBytes]byte
	head := hb[:min(n, t.header)]
	if _, err := io.ReadFull(r, head); err != nil {
		return false, err
	}
	size := segmentsLen(segs)
	if !t.checkHeader(hash, head, n, nil) || n-t.header != size {
		_, err := r.Discard(n - len(head))
		return false, err
	}
	// The payload, hashed as it lands: in segs, or in a scratch buffer
	// copied to segs once it has passed.
	var mh *blake3.Hasher
	var mk *macKey
	if t.mac != nil {
		if mk = t.macKeyOf(head[HeaderBytes : HeaderBytes+8]); mk != nil {
			mh = mk.pool.Get().(*blake3.Hasher)
			mh.Reset()
			defer mk.pool.Put(mh)
		}
	}
	var xh xxh3.Hasher
	into := segs
	var scratch *[]byte
	if !direct {
		scratch = getScratch(size)
		defer scratches.Put(scratch)
		into = [][]byte{*scratch}
	}
	for _, seg := range into {
		if err := readHashed(r, seg, &xh, mh); err != nil {
			return false, err
		}
	}
	if xh.Sum64() != binary.LittleEndian.Uint64(head[40:]) {
		return false, nil
	}
	if t.mac != nil {
		var tag [32]byte
		if mh == nil || subtle.ConstantTimeCompare(mk.finish(mh, tag[:0], t.cfg.Namespace, head[:HeaderBytes+8]), head[HeaderBytes+8:]) != 1 {
			t.macFailed("a value whose MAC does not verify")
			return false, nil
		}
	}
	if !direct {
		p := *scratch
		for _, d := range segs {
			p = p[copy(d, p):]
		}
	}
	return true, nil
}

// checkHeader checks a value of n bytes whose first bytes (t.header of
// them, or all of a shorter value) are head: all but the payload's
// checksum and MAC. whole is the whole value when the caller has it (nil
// for a streamed read): with a MAC, only a value whose MAC verifies says
// that a writer of another layout shares the namespace (anyone who can
// write to the server could forge the header), and only a whole value can
// be verified.
func (t *Tier) checkHeader(hash Hash, head []byte, n int, whole []byte) bool {
	if len(head) < HeaderBytes || string(head[:4]) != Magic || binary.LittleEndian.Uint16(head[4:]) != Version {
		return false
	}
	if flags := binary.LittleEndian.Uint16(head[6:]); flags != t.flags {
		if t.mac != nil && flags == 0 {
			t.macFailed("a value without a MAC")
		}
		return false
	}
	if Hash(head[8:24]) != hash {
		return false
	}
	if fp := binary.LittleEndian.Uint64(head[24:]); fp != t.cfg.Fingerprint {
		if t.mac == nil || (len(whole) >= t.header && t.logPending(logForeignLayout) && t.verifyMAC(whole)) {
			t.foreignLayout(fp)
		}
		return false
	}
	p := binary.LittleEndian.Uint64(head[32:])
	return n >= t.header && p == uint64(n-t.header) && (t.cfg.BlockBytes <= 0 || p == uint64(t.cfg.BlockBytes))
}

// readHashed fills p from r, readChunk bytes at most at a time, adding
// each piece to xh (and mh when not nil) as it lands.
func readHashed(r *bufio.Reader, p []byte, xh *xxh3.Hasher, mh *blake3.Hasher) error {
	for len(p) > 0 {
		k, err := r.Read(p[:min(len(p), readChunk)])
		if k > 0 {
			_, _ = xh.Write(p[:k])
			if mh != nil {
				_, _ = mh.Write(p[:k])
			}
			p = p[k:]
		}
		if err != nil && len(p) > 0 {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
	}
	return nil
}

// getScratch returns a buffer of size bytes from scratches.
func getScratch(size int) *[]byte {
	if b, ok := scratches.Get().(*[]byte); ok && cap(*b) >= size {
		*b = (*b)[:size]
		return b
	}
	b := make([]byte, size)
	return &b
}
