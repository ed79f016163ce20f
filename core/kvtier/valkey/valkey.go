// Package valkey is the shared KV tier: prefix blocks stored in a Valkey or
// Redis server under their chained block hash, so that an instance can
// load a block another instance computed.
//
// # Keys and values
//
// A block is one string key, kvplug:<namespace>:<hash as 32 hex digits>,
// the whole 128-bit chained hash (core/prefix.Hash, in its canonical byte
// order), whose value is a 48-byte header followed by the payload (the
// block's K/V bytes, in whatever layout the caller uses):
//
//	offset  size  field
//	0       4     magic "KVPB"
//	4       2     format version (2), little-endian like every number
//	6       2     flags, 0
//	8       16    the block's chained hash (the key's, repeated)
//	24      8     layout fingerprint, supplied by the caller: a hash of
//	              the model and KV layout (layers, heads, head size,
//	              dtype, block size), so that instances of different
//	              models or layouts never read each other's blocks
//	32      8     payload length
//	40      8     xxh3-64 of the payload
//
// The key holds all 128 bits of the hash, not a 64-bit digest of it: the
// tier is shared by every instance and outlives them, so it sees far more
// blocks than one instance's host tier, and two prefixes whose hashes
// agree in 64 bits must not read as each other's K/V. A value is checked
// against the whole hash too (a key renamed or copied by hand is a miss).
//
// A read checks every field; a value that fails any check (short, foreign,
// truncated, bit-flipped, another layout's) is a miss, counted in Corrupt,
// never an error. Instances of different models should also use different
// namespaces: equal token prefixes give equal chained hashes, and the
// fingerprint only keeps one model from reading the other's block, not from
// overwriting it.
//
// # Memory
//
// The tier never deletes or counts keys: the server's memory is bounded by
// its own maxmemory and maxmemory-policy settings (allkeys-lru or
// allkeys-lfu for a server dedicated to the tier; volatile-lru with a TTL
// on the blocks (Config.TTL) for a shared one). With noeviction a full
// server refuses SETs; each refused store counts in Errors and the tier
// goes on.
//
// # Faults
//
// No call returns an error or blocks past Config.OpTimeout (plus the time
// to encode or check the batch): a server that is down, slow or restarting
// turns the call into misses (Get, Exists) or skipped stores (Put), counted
// in Timeouts or Errors. After such a failure the call's path is skipped,
// without touching the network, for a backoff window (Config.Backoff,
// doubling on each consecutive failure up to Config.MaxBackoff; each call
// skipped so is counted in Skipped), so a serving step never waits on a
// dead server again and again; the first call after the window tries the
// server again and a success closes the path's breaker. An error reply to
// one command (a full noeviction server refusing a SET) counts in Errors
// without opening a breaker.
//
// The two paths, lookups and reads (Exists, Lookup, Get, GetInto,
// GetSegments, ReadInto) and stores (Put, StoreExists), have a breaker
// each, as they have a connection each (below): a store that times out (a
// pipeline of large values to a server that is slow but alive) does not
// turn the serving path's lookups into misses, and a lookup that succeeds
// does not close the breaker of stores that keep failing (nor reset their
// backoff). A server that is down costs at most one failed call per path
// per window (besides calls already in flight when it failed). Available
// is true when neither path is in a skip window.
//
// A Tier is safe for concurrent use. Its lookups and reads share one
// connection per server, one round trip at a time on each; its stores
// (Put, StoreExists) have their own, so that a reader never waits behind a
// store's pipeline.
//
// # Cluster
//
// Config.Addr may name any node of a Valkey or Redis Cluster: the first
// call asks it for the slot map (CLUSTER SHARDS, or CLUSTER SLOTS on
// servers without it; a server with cluster support disabled, or one that
// refuses both commands, is one server as above). In cluster mode each
// block's key goes to the primary serving its slot (CRC16 of the key mod
// 16384; a block's key has no hash tag, so the blocks spread over every
// slot); a call's commands are pipelined per node, the nodes in parallel,
// within the one OpTimeout. A MOVED reply updates the slot, is followed
// once and asks for the map to be read again; an ASK reply (a slot being
// migrated) is followed once after ASKING. A node that fails (down, slow,
// refusing AUTH or TLS) makes its keys misses and its stores dropped,
// counted once per call (Timeouts or Errors; Skipped while the node is
// skipped for the Backoff window, doubling to MaxBackoff), without opening
// the tier's breakers: the other nodes keep serving. Errors ask for the map
// to be read again in the background, at most every 100 ms (the Backoff
// if shorter) while they go on, backing off to 2 s, so that a failover's
// promoted replica is found. AUTH, TLS and the MAC apply to every node's
// connection; with TLS each node is verified for TLS.ServerName when set,
// else for its own host as the map names it. Stats counts the redirects
// followed and the maps read.
//
// # Security
//
// Three settings, each off by default, for a server that others can
// reach:
//
//   - AUTH (Config.Username, Config.Password): every new connection sends
//     AUTH [username] password before its first command (an ACL user, or
//     the default user's requirepass). The password is read from an
//     environment variable or a file (Secret), at New to check it and
//     again on every connect, so a rotated file is picked up by the next
//     connection. A refusal fails the call like a down server (counted in
//     Errors and AuthFailures, logged, the path's breaker opened); a
//     command the user may not run (NOPERM) or a server that wants AUTH
//     the tier did not send (NOAUTH) counts in Errors and AuthFailures
//     without opening it. No error message or log line holds the password.
//   - TLS (Config.TLS): every connection does a TLS handshake verifying
//     the server's certificate against a CA file or the system's roots,
//     for Config.TLS.ServerName or the address's host, with an optional
//     client certificate. A handshake or verification failure fails the
//     call like a down server (counted in Errors and TLSFailures, logged,
//     the path's breaker opened); the tier never falls back to plaintext.
//   - A MAC (Config.MACKeys): each value carries a keyed BLAKE3 tag of the
//     namespace, its header and its payload, under a key that instances
//     share and the server never sees, so a client that can write to the
//     server but lacks the key cannot make a value that any instance
//     serves as K/V. A value whose tag does not verify (no tag, another
//     key, a value altered, truncated or moved to another key) is a miss,
//     counted in Corrupt and MACFailures. Two keys may be given: the first
//     signs new values, both verify, so keys rotate without a flag day
//     (every instance to "old,new", then to "new,old", then to "new").
//     The MAC proves who wrote a value, not that it is recent: a client
//     without the key can still delete values or put back an older value
//     of the same block, which is the same K/V.
package valkey

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvplug/kvplug/internal/kverr"
	"github.com/kvplug/kvplug/internal/logx"
	"github.com/kvplug/kvplug/internal/resp"
	"github.com/zeebo/xxh3"
	"go.uber.org/zap"
)

// Value format.
const (
	HeaderBytes = 48
	Magic       = "KVPB"
	Version     = 2
)

// Hash is a block's 128-bit chained hash (the bytes of core/prefix.Hash).
type Hash = [16]byte

// Defaults of Config's zero fields.
const (
	DefaultDialTimeout = 100 * time.Millisecond
	DefaultOpTimeout   = 250 * time.Millisecond
	DefaultBackoff     = time.Second
	DefaultMaxBackoff  = 30 * time.Second
)

// Config configures a Tier.
type Config struct {
	Addr        string // host:port of the server
	Namespace   string // 1-64 characters of [A-Za-z0-9_.-]
	Fingerprint uint64 // the model and KV layout's fingerprint (see the package comment)
	BlockBytes  int    // payload bytes of every block; 0: any length

	DialTimeout time.Duration // bound on a connection attempt; 0: DefaultDialTimeout
	OpTimeout   time.Duration // bound on a whole call (wait, dial, round trip); 0: DefaultOpTimeout
	TTL         time.Duration // expiry set on stored blocks (whole milliseconds); 0: none
	Backoff     time.Duration // first skip window after a failure; 0: DefaultBackoff
	MaxBackoff  time.Duration // longest skip window; 0: DefaultMaxBackoff

	// Security (see "Security" in the package comment); all off when zero.
	Username string // ACL user sent with AUTH; "": the default user (AUTH password); needs Password
	Password Secret // the password sent with AUTH on every connect; zero: no AUTH
	TLS      *TLS   // TLS on every connection; nil: plaintext
	MACKeys  Secret // one or two MAC keys (hex, separated by white space or a comma); zero: no MAC
}

// Stats are the tier's counters. Hits, Misses and Corrupt count blocks
// (every block of a Get or Exists is exactly one of them: a failed or
// skipped call's blocks are misses, but for those GetInto, GetSegments
// and ReadInto read whole before it failed); Stores counts blocks stored; Timeouts,
// Errors and Skipped count calls (Errors also counts commands refused by
// the server); the bytes are values' bytes, header included.
type Stats struct {
	Hits, Misses, Stores, Corrupt int64
	Timeouts, Errors, Skipped     int64
	BytesRead, BytesWritten       int64
	Available                     bool // neither path's breaker is open (false while lookups or stores are in a skip window)

	// Of Errors, the calls that failed on authentication (AUTH refused,
	// the password not readable, a command refused with NOPERM or
	// NOAUTH) and on TLS (handshake or verification); of Corrupt, the
	// values whose MAC did not verify (with Config.MACKeys).
	AuthFailures, TLSFailures, MACFailures int64

	// Cluster mode (see "Cluster" in the package comment): whether the
	// server runs as a cluster, its primaries, the MOVED and ASK replies
	// followed and the slot maps read (discovery included).
	Cluster             bool
	Primaries           int
	Redirects, MapReads int64
}

// Tier is a client of the shared tier. See the package comment.
type Tier struct {
	cfg Config
	// c carries lookups and reads (Exists, Get, ReadInto: a serving step
	// waits for them); st carries stores (Put, StoreExists: a background
	// writer's). Each holds one connection per server, one round trip at a
	// time, so with one connection a lookup would wait behind a store's
	// whole pipeline (16 blocks of 2 MiB: about 12 ms on one server).
	c, st  *resp.Cluster
	prefix string

	mac    []*macKey // nil: no MAC; [0] signs
	flags  uint16    // the flags of this tier's values
	header int       // bytes before the payload: HeaderBytes, plus MACBytes with a MAC

	// The breakers of c's calls (lookups and reads) and st's (stores):
	// one path's failures never skip, close or reset the other's.
	lookupsBr, storesBr breaker

	mu      sync.Mutex
	lastLog [numLogKinds]time.Time // of the last line logged, by kind

	hits, misses, stores, corrupt atomic.Int64
	timeouts, errs, skipped       atomic.Int64
	bytesRead, bytesWritten       atomic.Int64
	authFails, tlsFails, macFails atomic.Int64
}

// New returns a tier for cfg. It does not connect: the first call does, so
// a server that is down at start-up only makes the first calls misses.
func New(cfg Config) (*Tier, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.OpTimeout == 0 {
		cfg.OpTimeout = DefaultOpTimeout
	}
	if cfg.Backoff == 0 {
		cfg.Backoff = DefaultBackoff
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	cfg.MaxBackoff = max(cfg.MaxBackoff, cfg.Backoff)
	opts, err := ConnOptions(cfg.Addr, cfg.Username, cfg.Password, cfg.TLS, cfg.DialTimeout, cfg.OpTimeout)
	if err != nil {
		return nil, err
	}
	co := resp.ClusterOptions{
		Options:         opts,
		FixedServerName: cfg.TLS != nil && cfg.TLS.ServerName != "",
		NodeBackoff:     cfg.Backoff,
		MaxNodeBackoff:  cfg.MaxBackoff,
		RefreshMin:      min(cfg.Backoff, 100*time.Millisecond),
	}
	t := &Tier{
		cfg:    cfg,
		c:      resp.NewCluster(cfg.Addr, co),
		st:     resp.NewCluster(cfg.Addr, co), // dials on the first store: a reader never opens it
		prefix: "kvplug:" + cfg.Namespace + ":",
		header: HeaderBytes,
	}
	t.lookupsBr = breaker{path: "lookups", effect: "misses", first: cfg.Backoff, longest: cfg.MaxBackoff}
	t.storesBr = breaker{path: "stores", effect: "stores dropped", first: cfg.Backoff, longest: cfg.MaxBackoff}
	if !cfg.MACKeys.IsZero() {
		text, err := cfg.MACKeys.read("MAC keys")
		if err != nil {
			return nil, err
		}
		t.mac, err = parseMACKeys(text)
		clear(text)
		if err != nil {
			return nil, err
		}
		t.flags, t.header = FlagMAC, HeaderBytes+MACBytes
	}
	return t, nil
}

// Check returns the error New would return for cfg, without a tier.
func (cfg Config) Check() error {
	if cfg.Addr == "" {
		return kverr.Errorf(kverr.InvalidArgument, "valkey tier: no address")
	}
	if n := len(cfg.Namespace); n == 0 || n > 64 {
		return kverr.Errorf(kverr.InvalidArgument, "valkey tier: namespace of %d characters (1-64)", n)
	}
	for _, r := range cfg.Namespace {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '.' || r == '-') {
			return kverr.Errorf(kverr.InvalidArgument, "valkey tier: namespace %q: only [A-Za-z0-9_.-]", cfg.Namespace)
		}
	}
	if cfg.BlockBytes < 0 || cfg.DialTimeout < 0 || cfg.OpTimeout < 0 || cfg.TTL < 0 || cfg.Backoff < 0 || cfg.MaxBackoff < 0 {
		return kverr.Errorf(kverr.InvalidArgument,
			"valkey tier: a negative size or duration: block bytes %d, dial timeout %v, operation timeout %v, TTL %v, backoff %v, max backoff %v",
			cfg.BlockBytes, cfg.DialTimeout, cfg.OpTimeout, cfg.TTL, cfg.Backoff, cfg.MaxBackoff)
	}
	if cfg.TTL > 0 && cfg.TTL < time.Millisecond {
		return kverr.Errorf(kverr.InvalidArgument, "valkey tier: TTL %v under a millisecond", cfg.TTL)
	}
	if len(cfg.Username) > 256 || strings.ContainsAny(cfg.Username, " \t\r\n\x00") {
		return kverr.Errorf(kverr.InvalidArgument, "valkey tier: a username of at most 256 bytes without white space or NUL")
	}
	if cfg.Username != "" && cfg.Password.IsZero() {
		return kverr.Errorf(kverr.InvalidArgument, "valkey tier: a username (%q) needs a password", cfg.Username)
	}
	if err := cfg.Password.check("password"); err != nil {
		return err
	}
	if err := cfg.MACKeys.check("MAC keys"); err != nil {
		return err
	}
	if cfg.TLS != nil && (cfg.TLS.CertFile == "") != (cfg.TLS.KeyFile == "") {
		return kverr.Errorf(kverr.InvalidArgument, "valkey tier: a TLS client certificate needs both its certificate and its key file")
	}
	return nil
}

// CheckFiles returns the error New would return for cfg's secrets and TLS
// files (Check's errors first): it reads them and keeps nothing.
func (cfg Config) CheckFiles() error {
	if err := cfg.Check(); err != nil {
		return err
	}
	if cfg.TLS != nil {
		if _, err := cfg.TLS.config(cfg.Addr); err != nil {
			return err
		}
	}
	if !cfg.Password.IsZero() {
		pw, err := cfg.Password.read("password")
		if err != nil {
			return err
		}
		clear(pw)
	}
	if !cfg.MACKeys.IsZero() {
		text, err := cfg.MACKeys.read("MAC keys")
		if err != nil {
			return err
		}
		_, err = parseMACKeys(text)
		clear(text)
		return err
	}
	return nil
}

// ConnOptions returns the connection options of a client of the server at
// addr with this security: TLS (nil: plaintext), AUTH as username (""
// for the default user) with the password (zero: no AUTH). The password
// is read now, so that a missing or empty one is refused at once, and
// again on every connect (a rotated password file is followed). For the
// tier and for other clients of the same servers (cmd/kvindex).
func ConnOptions(addr, username string, password Secret, tlsCfg *TLS, dial, op time.Duration) (resp.Options, error) {
	opts := resp.Options{DialTimeout: dial, OpTimeout: op}
	if tlsCfg != nil {
		tc, err := tlsCfg.config(addr)
		if err != nil {
			return opts, err
		}
		opts.TLS = tc
	}
	if !password.IsZero() {
		pw, err := password.read("password")
		if err != nil {
			return opts, err
		}
		clear(pw)
		opts.Auth = func() (string, []byte, error) {
			pw, err := password.read("password")
			return username, pw, err
		}
	}
	return opts, nil
}

// Close closes the connection, once a call in flight is done with it; every
// later call is a miss or a dropped store at once, counted in Skipped, with
// nothing dialled or sent. Close is for the end of the tier's life.
func (t *Tier) Close() error {
	t.c.Close()
	t.st.Close()
	return nil
}

// Key returns a block's key.
func (t *Tier) Key(hash Hash) string { return string(t.key(nil, hash)) }

func (t *Tier) key(dst []byte, hash Hash) []byte {
	return hex.AppendEncode(append(dst, t.prefix...), hash[:])
}

// Encode returns the value stored for a block by a tier without a MAC:
// header and payload (EncodeMAC: with one).
func Encode(hash Hash, fingerprint uint64, payload []byte) []byte {
	return append(appendHeader(make([]byte, 0, HeaderBytes+len(payload)), hash, fingerprint, 0, payload), payload...)
}

func appendHeader(v []byte, hash Hash, fingerprint uint64, flags uint16, payload []byte) []byte {
	v = append(v, Magic...)
	v = binary.LittleEndian.AppendUint16(v, Version)
	v = binary.LittleEndian.AppendUint16(v, flags)
	v = append(v, hash[:]...)
	v = binary.LittleEndian.AppendUint64(v, fingerprint)
	v = binary.LittleEndian.AppendUint64(v, uint64(len(payload)))
	return binary.LittleEndian.AppendUint64(v, xxh3.Hash(payload))
}

// decode checks a value and returns its payload, or false. A tier with a
// MAC counts in MACFailures the values that fail for want of a valid tag
// (no tag, another key's, a tag that does not verify); the caller counts
// every failure in Corrupt.
func (t *Tier) decode(hash Hash, v []byte) ([]byte, bool) {
	if !t.checkHeader(hash, v, len(v), v) {
		return nil, false
	}
	p := v[t.header:]
	if xxh3.Hash(p) != binary.LittleEndian.Uint64(v[40:]) {
		return nil, false
	}
	if t.mac != nil && !t.verifyMAC(v) {
		t.macFailed("a value whose MAC does not verify")
		return nil, false
	}
	return p, true
}

// macFailed counts and logs (at most once a minute) a value refused for
// its MAC.
func (t *Tier) macFailed(what string) {
	t.macFails.Add(1)
	if t.logDue(logMAC) {
		logx.L().Warn("shared tier: "+what+" read from the server (a writer without this tier's MAC keys, or an altered value): a miss",
			zap.String("addr", t.cfg.Addr), zap.String("namespace", t.cfg.Namespace), zap.Int64("mac_failures", t.macFails.Load()))
	}
}

// foreignLayout logs (at most once a minute) a value of this block under
// this namespace written with another layout's fingerprint: instances of
// different layouts (block size or bytes) share the namespace. They never
// read each other's blocks, and since a store skips a key that exists, a
// block the other layout stored first is never stored for this one: this
// instance recomputes it every time, silently but for this line.
func (t *Tier) foreignLayout(fp uint64) {
	if t.logDue(logForeignLayout) {
		logx.L().Warn("shared tier: a block's value carries another layout's fingerprint: instances of different layouts share this namespace, "+
			"never read each other's blocks and cannot store over them; give each layout its own namespace",
			zap.String("addr", t.cfg.Addr), zap.String("namespace", t.cfg.Namespace),
			zap.String("fingerprint", fmt.Sprintf("%#x", fp)), zap.String("ours", fmt.Sprintf("%#x", t.cfg.Fingerprint)))
	}
}

// The kinds of line a tier logs, each at most once a minute on its own
// clock, so that a frequent one (a foreign layout's value on every lookup)
// does not hide a rare one (a refused command).
type logKind int

const (
	logRefused       logKind = iota // NOPERM, NOAUTH, WRONGPASS
	logMAC                          // a value refused for its MAC
	logNodeFailed                   // a cluster node failed
	logForeignLayout                // a value with another layout's fingerprint
	numLogKinds
)

// logPending reports whether a line of kind k would be logged now,
// without taking its turn: a check that costs more than the line (a MAC
// over a whole value) runs only then.
func (t *Tier) logPending(k logKind) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	last := t.lastLog[k]
	return last.IsZero() || time.Since(last) >= time.Minute
}

// logDue reports whether a line of kind k may be logged now: at most one
// a minute of each kind, so a misconfigured fleet does not flood the
// host's log.
func (t *Tier) logDue(k logKind) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	if last := t.lastLog[k]; !last.IsZero() && now.Sub(last) < time.Minute {
		return false
	}
	t.lastLog[k] = now
	return true
}

// refused counts an error reply: in Errors, and, for a refusal of
// authentication or permission (NOAUTH, NOPERM, WRONGPASS), in
// AuthFailures once per call (logged at most once a minute). It reports
// whether it was such a refusal.
func (t *Tier) refused(e resp.Error, counted bool) bool {
	t.errs.Add(1)
	code, _, _ := strings.Cut(string(e), " ")
	switch code {
	case "NOAUTH", "NOPERM", "WRONGPASS":
	default:
		return false
	}
	if !counted {
		t.authFails.Add(1)
		if t.logDue(logRefused) {
			logx.L().Error("shared tier: the server refused a command: check the tier's user and its ACL (it needs GET, SET, EXISTS)",
				zap.String("addr", t.cfg.Addr), zap.String("user", t.cfg.Username), zap.String("reply", string(e)))
		}
	}
	return true
}

// breaker is one path's circuit breaker (see "Faults" in the package
// comment): after a failure the path is skipped, without touching the
// network, for a window of first, doubling on each consecutive failure
// up to longest; the first call after the window goes through, and a
// success closes the breaker.
type breaker struct {
	path    string        // "lookups" or "stores", as the log says
	effect  string        // what a skipped call comes to, as the log says
	first   time.Duration // Config.Backoff
	longest time.Duration // Config.MaxBackoff

	mu        sync.Mutex
	skipUntil time.Time     // the end of the skip window; zero: closed
	backoff   time.Duration // the window's length; 0: no failure since the last success
}

// allows reports whether a call may go through now: no skip window.
func (b *breaker) allows() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.skipUntil.IsZero() || !time.Now().Before(b.skipUntil)
}

// succeeded closes the breaker and reports whether it had failed since
// the last success (a recovery).
func (b *breaker) succeeded() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	recovered := b.backoff != 0
	b.skipUntil, b.backoff = time.Time{}, 0
	return recovered
}

// failed opens the breaker for the next window and reports whether this is
// the first failure since the last success, and the window's length.
func (b *breaker) failed() (first bool, window time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	first = b.backoff == 0
	if first {
		b.backoff = b.first
	} else {
		b.backoff = min(2*b.backoff, b.longest)
	}
	b.skipUntil = time.Now().Add(b.backoff)
	return first, b.backoff
}

// breakerOf returns the breaker of c's calls: t.st's stores, or t.c's
// lookups and reads.
func (t *Tier) breakerOf(c *resp.Cluster) *breaker {
	if c == t.st {
		return &t.storesBr
	}
	return &t.lookupsBr
}

// open reports whether b lets a call through; a call it stops is counted
// in Skipped.
func (t *Tier) open(b *breaker) bool {
	if b.allows() {
		return true
	}
	t.skipped.Add(1)
	return false
}

// result records a call's transport outcome in b and the counters. The
// first failure after a success is logged (an authentication or TLS
// failure as an error, others as a warning), and so is the recovery, each
// once per path.
func (t *Tier) result(b *breaker, err error) {
	if err == nil {
		if b.succeeded() {
			logx.L().Info("shared tier: the server answers the tier's "+b.path+" again",
				zap.String("addr", t.cfg.Addr), zap.String("path", b.path))
		}
		return
	}
	kind := "unreachable"
	if resp.IsTimeout(err) {
		t.timeouts.Add(1)
		kind = "timed out"
	} else {
		t.errs.Add(1)
		switch {
		case resp.IsAuth(err):
			t.authFails.Add(1)
			kind = "authentication failed"
		case resp.IsTLS(err):
			t.tlsFails.Add(1)
			kind = "TLS failed"
		}
	}
	first, window := b.failed()
	if !first {
		return
	}
	// err's text holds no secret: resp's AuthError leaves the password
	// out, and the rest are the network's and crypto/tls's.
	fields := []zap.Field{zap.String("addr", t.cfg.Addr), zap.String("namespace", t.cfg.Namespace),
		zap.String("path", b.path), zap.Duration("skipped_for", window), zap.Error(err)}
	if kind == "authentication failed" || kind == "TLS failed" {
		logx.L().Error("shared tier: "+kind+" on the tier's "+b.path+": they are skipped ("+b.effect+") until they succeed", fields...)
	} else {
		logx.L().Warn("shared tier: server "+kind+" on the tier's "+b.path+": they are skipped ("+b.effect+") until it answers", fields...)
	}
}

// do runs one pipeline on c through c's breaker; nil replies mean the
// call was skipped or failed (already counted).
func (t *Tier) do(c *resp.Cluster, cmds [][][]byte) []any {
	if len(cmds) == 0 || !t.open(t.breakerOf(c)) {
		return nil
	}
	r, err := c.Do(cmds)
	if !t.callDone(c, err) {
		return nil
	}
	t.nodeFailures(r)
	return r
}

// nodeFailures counts, once per call, the commands a cluster could not run
// for their node's failure: in Timeouts or Errors (and AuthFailures or
// TLSFailures) for a node that failed now, in Skipped for one skipped
// after a failure. The breaker stays closed: the other nodes serve.
func (t *Tier) nodeFailures(r []any) {
	var failed, skipped error
	for _, x := range r {
		if e, ok := x.(*resp.NodeError); ok {
			if errors.Is(e, resp.ErrNodeDown) {
				skipped = e
			} else if failed == nil {
				failed = e
			}
		}
	}
	if skipped != nil {
		t.skipped.Add(1)
	}
	if failed == nil {
		return
	}
	switch {
	case resp.IsTimeout(failed):
		t.timeouts.Add(1)
	case resp.IsAuth(failed):
		t.errs.Add(1)
		t.authFails.Add(1)
	case resp.IsTLS(failed):
		t.errs.Add(1)
		t.tlsFails.Add(1)
	default:
		t.errs.Add(1)
	}
	if t.logDue(logNodeFailed) {
		logx.L().Warn("shared tier: a cluster node failed: its keys are misses, stores to it dropped, until it answers or the slot map names another",
			zap.String("addr", t.cfg.Addr), zap.String("namespace", t.cfg.Namespace), zap.Error(failed))
	}
}

// Get fetches blocks: out[i] is hashes[i]'s payload, or nil for a miss
// (absent, corrupt, or the call skipped or failed). One round trip.
func (t *Tier) Get(hashes []Hash) [][]byte {
	out := make([][]byte, len(hashes))
	t.get(hashes, func(i int, p []byte) bool { out[i] = p; return true })
	return out
}

// GetInto fetches blocks into the caller's buffers (host-tier slots):
// found[i] reports whether hashes[i]'s payload was copied into dst[i],
// which must be exactly as long as the payload (a value of another length
// is a miss, counted corrupt). dst[i] is untouched on a miss. Each value
// is read into a scratch buffer, checked there and copied (ReadInto reads
// it into dst[i] itself), as it arrives: a call that fails midway (a
// timeout, say) keeps the values read whole before it failed, found. The
// GETs are pipelined in a window of a few megabytes (getWindowBytes).
func (t *Tier) GetInto(hashes []Hash, dst [][]byte) []bool {
	return t.getSegments(hashes, oneSegment(dst), false)
}

// ReadInto is GetInto reading each payload straight into dst[i], with no
// copy: on a miss (a value that fails a check, a call that fails midway)
// dst[i] holds unspecified bytes, which the caller must not use (the
// shared tier's host slots, given back on a miss).
func (t *Tier) ReadInto(hashes []Hash, dst [][]byte) []bool {
	return t.getSegments(hashes, oneSegment(dst), true)
}

func oneSegment(dst [][]byte) [][][]byte {
	segs := make([][][]byte, len(dst)) // each buffer its block's one segment
	for i := range dst {
		segs[i] = dst[i : i+1 : i+1]
	}
	return segs
}

// GetSegments is GetInto for payloads held in pieces (a block whose K and
// V, or layers, lie apart): dst[i] are hashes[i]'s segments, which the
// payload fills in order. A value that is not exactly as long as its
// segments together is a miss, counted corrupt, as in GetInto; dst[i] is
// untouched on a miss.
func (t *Tier) GetSegments(hashes []Hash, dst [][][]byte) []bool {
	return t.getSegments(hashes, dst, false)
}

// doKeys sends cmd with the key of each block of hashes, one command a
// block, in one round trip (do) and returns the replies; a skipped or
// failed call returns nil, its blocks counted as misses.
func (t *Tier) doKeys(c *resp.Cluster, cmd string, hashes []Hash) []any {
	cmds := make([][][]byte, len(hashes))
	verb := []byte(cmd)
	for i, h := range hashes {
		cmds[i] = [][]byte{verb, t.key(nil, h)}
	}
	r := t.do(c, cmds)
	if r == nil {
		t.misses.Add(int64(len(hashes)))
	}
	return r
}

func (t *Tier) get(hashes []Hash, take func(int, []byte) bool) {
	if len(hashes) == 0 {
		return
	}
	r := t.doKeys(t.c, "GET", hashes)
	if r == nil {
		return
	}
	authCounted := false
	check := func(i int) {
		v := r[i].([]byte)
		t.bytesRead.Add(int64(len(v)))
		if p, ok := t.decode(hashes[i], v); ok && take(i, p) {
			t.hits.Add(1)
		} else {
			t.corrupt.Add(1)
		}
	}
	var values []int // with a MAC: the values, checked in parallel
	for i, x := range r {
		switch v := x.(type) {
		case []byte:
			if t.mac != nil {
				values = append(values, i)
			} else {
				check(i)
			}
		case resp.Error:
			// A wrong-type key, a server refusing reads, a user without GET.
			authCounted = t.refused(v, authCounted) || authCounted
			t.misses.Add(1)
		case *resp.NodeError:
			t.misses.Add(1) // its node failed: counted once by do
		default:
			t.misses.Add(1) // nil: absent
		}
	}
	parallel(len(values), func(j int) { check(values[j]) })
}

// parallel calls f(0) ... f(n-1), on up to GOMAXPROCS goroutines (at most
// 8): the MAC of a batch's values, whose cost (about 0.4 s a GB on one
// core) would otherwise add to the round trip's.
func parallel(n int, f func(int)) {
	w := min(n, runtime.GOMAXPROCS(0), 8)
	if w <= 1 {
		for i := range n {
			f(i)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range w {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				f(i)
			}
		})
	}
	wg.Wait()
}

// Put stores blocks (hashes[i] with payloads[i]) in one round trip and
// returns how many the server accepted. A payload of the wrong length
// (Config.BlockBytes) is not sent. Nothing is stored when the call is
// skipped or fails. The payloads are written from where they lie (a
// vectored write), not copied; they must not change during the call.
func (t *Tier) Put(hashes []Hash, payloads [][]byte) int {
	n := min(len(hashes), len(payloads))
	if n == 0 || !t.open(&t.storesBr) {
		return 0
	}
	send := make([]int, 0, n)
	for i := range n {
		if t.cfg.BlockBytes > 0 && len(payloads[i]) != t.cfg.BlockBytes {
			t.errs.Add(1)
			continue
		}
		send = append(send, i)
	}
	if len(send) == 0 {
		return 0
	}
	// Each SET is written in three pieces: its command, key and value
	// header, encoded in one buffer; the payload where it lies, not
	// copied; and the tail (CRLF, and the TTL), the same for every SET.
	tail := []byte("\r\n")
	if t.cfg.TTL > 0 {
		ttl := strconv.AppendInt(nil, t.cfg.TTL.Milliseconds(), 10)
		tail = append(resp.AppendBulk(tail, 2), "PX\r\n"...)
		tail = append(append(resp.AppendBulk(tail, len(ttl)), ttl...), '\r', '\n')
	}
	keyLen := len(t.prefix) + 2*len(Hash{})
	buf := make([]byte, 0, len(send)*(64+keyLen+t.header))
	offs := make([]int, len(send)+1) // command j is buf[offs[j]:offs[j+1]]
	koffs := make([]int, len(send))  // its key starts at buf[koffs[j]]
	vlens := make([]int, len(send))
	var zero [HeaderBytes + MACBytes]byte
	for j, i := range send {
		if len(tail) > 2 {
			buf = resp.AppendArray(buf, 5)
		} else {
			buf = resp.AppendArray(buf, 3)
		}
		buf = append(resp.AppendBulk(buf, 3), "SET\r\n"...)
		buf = resp.AppendBulk(buf, keyLen)
		koffs[j] = len(buf)
		buf = append(t.key(buf, hashes[i]), '\r', '\n')
		vlens[j] = t.header + len(payloads[i])
		buf = append(resp.AppendBulk(buf, vlens[j]), zero[:t.header]...) // the value's header, filled below
		offs[j+1] = len(buf)
	}
	cmds := make([][][]byte, len(send))
	pieces := make([][]byte, 3*len(send))
	keys := make([][]byte, len(send))
	for j, i := range send {
		k := koffs[j]
		keys[j] = buf[k : k+keyLen : k+keyLen]
		pieces[3*j], pieces[3*j+1], pieces[3*j+2] = buf[offs[j]:offs[j+1]:offs[j+1]], payloads[i], tail
		cmds[j] = pieces[3*j : 3*j+3 : 3*j+3]
	}
	// The headers (a checksum, with a MAC a keyed hash, of each payload),
	// in parallel.
	parallel(len(send), func(j int) {
		i, h := send[j], offs[j+1]-t.header
		v := appendHeader(buf[h:h:h+t.header], hashes[i], t.cfg.Fingerprint, t.flags, payloads[i])
		if t.mac != nil {
			t.appendMAC(v, payloads[i])
		}
	})
	r, err := t.st.Call(&resp.Call{Cmds: cmds, Keys: keys})
	if !t.callDone(t.st, err) {
		return 0
	}
	t.nodeFailures(r)
	stored, authCounted := 0, false
	for j, x := range r {
		if _, ok := x.(*resp.NodeError); ok {
			continue // its node failed: counted once by nodeFailures
		}
		t.bytesWritten.Add(int64(vlens[j]))
		if s, ok := x.(string); ok && s == "OK" {
			stored++
		} else if e, ok := x.(resp.Error); ok {
			// OOM under maxmemory-policy noeviction; a user without SET.
			authCounted = t.refused(e, authCounted) || authCounted
		} else {
			t.errs.Add(1)
		}
	}
	t.stores.Add(int64(stored))
	return stored
}

// Exists reports which blocks the server holds (by key only: a corrupt
// value there is found by Get), in one round trip; a skipped or failed
// call reports none. Hits and misses are counted as for Get.
func (t *Tier) Exists(hashes []Hash) []bool {
	held, _ := t.exists(t.c, hashes)
	return held
}

// Lookup is Exists that also reports, per block, whether the server said
// it lacks it (absent[i]: an EXISTS reply of 0), as against a block not
// known either way: its call failed or was skipped, its node failed, or
// the command was refused.
func (t *Tier) Lookup(hashes []Hash) (held, absent []bool) {
	return t.exists(t.c, hashes)
}

// StoreExists is Exists on the stores' connection, for a writer that asks
// before it sends which blocks the server holds already: its question
// waits behind its own stores, not a reader's behind them.
func (t *Tier) StoreExists(hashes []Hash) []bool {
	held, _ := t.exists(t.st, hashes)
	return held
}

func (t *Tier) exists(c *resp.Cluster, hashes []Hash) (held, absent []bool) {
	held, absent = make([]bool, len(hashes)), make([]bool, len(hashes))
	if len(hashes) == 0 {
		return held, absent
	}
	r := t.doKeys(c, "EXISTS", hashes)
	if r == nil {
		return held, absent
	}
	authCounted := false
	for i, x := range r {
		n, ok := x.(int64)
		if ok && n == 1 {
			held[i] = true
			t.hits.Add(1)
			continue
		}
		absent[i] = ok && n == 0
		if e, ok := x.(resp.Error); ok {
			authCounted = t.refused(e, authCounted) || authCounted
		}
		t.misses.Add(1) // absent, refused, or its node failed (counted by do)
	}
	return held, absent
}

// Prefix returns the length of the longest run of hashes, from the first,
// that the server holds (Exists): the blocks admission can count on this
// tier for.
func (t *Tier) Prefix(hashes []Hash) int {
	n := 0
	for _, ok := range t.Exists(hashes) {
		if !ok {
			break
		}
		n++
	}
	return n
}

// Available reports whether neither path's breaker is open: no skip window
// now, of lookups or of stores.
func (t *Tier) Available() bool {
	return t.lookupsBr.allows() && t.storesBr.allows()
}

// Stats returns the counters.
func (t *Tier) Stats() Stats {
	cs, ss := t.c.Stats(), t.st.Stats()
	return Stats{
		Hits: t.hits.Load(), Misses: t.misses.Load(), Stores: t.stores.Load(), Corrupt: t.corrupt.Load(),
		Timeouts: t.timeouts.Load(), Errors: t.errs.Load(), Skipped: t.skipped.Load(),
		BytesRead: t.bytesRead.Load(), BytesWritten: t.bytesWritten.Load(),
		Available:    t.Available(),
		AuthFailures: t.authFails.Load(), TLSFailures: t.tlsFails.Load(), MACFailures: t.macFails.Load(),
		Cluster: cs.Cluster || ss.Cluster, Primaries: max(cs.Nodes, ss.Nodes),
		Redirects: cs.Redirects + ss.Redirects, MapReads: cs.Refreshes + ss.Refreshes,
	}
}

func (s Stats) String() string {
	return fmt.Sprintf("hits %d misses %d stores %d corrupt %d timeouts %d errors %d skipped %d read %d written %d available %v %s",
		s.Hits, s.Misses, s.Stores, s.Corrupt, s.Timeouts, s.Errors, s.Skipped, s.BytesRead, s.BytesWritten, s.Available, s.securityString())
}
