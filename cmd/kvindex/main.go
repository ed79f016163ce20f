// Command kvindex is a cluster prefix index for KV-aware routing: it
// subscribes to the KV event streams of engine instances (kvplug's
// publisher, in vLLM's wire format), keeps which instance caches which
// block on which medium (GPU, CPU: a host tier, SHARED: a tier instances
// share) in memory or in Valkey/Redis, and answers over HTTP/JSON, for a
// prompt's tokens and keys, each instance's longest cached prefix per
// medium and a score that ranks them:
//
//	kvindex -listen 127.0.0.1:8090 -block-size 16 \
//	    -instance e0=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 \
//	    -instance e1=tcp://10.0.0.2:5557,tcp://10.0.0.2:5558 \
//	    [-valkey 127.0.0.1:6379 -valkey-prefix kvindex] \
//	    [-cpu-weight 0.75 -shared-weight 0.25] \
//	    [-idle-timeout 5s -timeout 2s -log-level info]
//
//	curl -d '{"tokens": [1, 2, 3, ...]}' http://127.0.0.1:8090/v1/score
//	{"scores": [{"instance": "e0", "tokens": 160, "blocks": 10, "gpu_tokens": 64,
//	             "cpu_tokens": 96, "shared_tokens": 0, "score": 136, "stale": false,
//	             "state": "fresh"}, ...],
//	 "best": "e0", "weights": {"cpu": 0.75, "shared": 0.25}}
//
// gpu_tokens is the prompt's longest prefix on the instance's GPU,
// cpu_tokens how far its host tier continues it, shared_tokens how far the
// shared tier continues that; tokens is their sum, and score counts GPU
// tokens at 1 and the others at the weights (see package core/kvindex,
// "Media"). best is the instance with the highest score among the fresh
// ones.
//
// An instance is NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT[,TOPIC[,ENGINE]]]. kvindex
// connects to both endpoints: the engine's publisher binds them (kvplug's
// does by default). ENGINE is kvplug (the default), or vllm or sglang for
// those engines' own publishers, whose block hashes kvindex translates
// into its own and which send no snapshots (package core/kvindex,
// "Engines"), e.g. -instance v0=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558,,vllm. Each instance is fresh (routed), stale (connected,
// waiting for a snapshot) or down (its publisher exited, refuses the
// connection, or went silent: no batch for -idle-timeout and no answer to
// a heartbeat or on its replay endpoint); a stale or down instance is
// scored as absent until it is fresh again (package core/kvindex,
// "Liveness").
//
// Endpoints, besides POST /v1/score and GET /v1/instances (every
// instance's status):
//
//	GET /healthz   liveness: 200 while the process serves
//	GET /readyz    readiness: 200 when at least one instance is fresh, 503
//	               otherwise; the JSON body lists every instance's state
//	GET /metrics   Prometheus text format: events, resyncs, instances by
//	               state, index size, scoring latency
//
// kvindex logs to stderr: each instance's connection, resyncs, and its
// changes of state, with what it waits for. It prints "serving" once its
// listener is up. Bad flags exit with status 2, a failure to start (the
// listen address in use, Valkey unreachable) with 1.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvindex"
	"github.com/kvplug/kvplug/core/kvtier/valkey"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/logx"
)

// libVersion is kvplug's version, the header's KVP_VERSION_* (a test
// checks that they agree).
const libVersion = "0.7.0"

// version overrides libVersion in -version's answer when set at link time
// (-ldflags "-X main.version=...").
var version string

// versionString is -version's answer: the version, the commit it was
// built from when the build knows it, and the Go release.
func versionString() string {
	v := version
	if v == "" {
		v = libVersion
	}
	s := "kvindex " + v
	if bi, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", ""
		for _, kv := range bi.Settings {
			switch kv.Key {
			case "vcs.revision":
				rev = kv.Value
			case "vcs.modified":
				if kv.Value == "true" {
					dirty = ", modified"
				}
			}
		}
		if rev != "" {
			s += fmt.Sprintf(" (commit %.12s%s)", rev, dirty)
		}
		s += " " + bi.GoVersion
	}
	return s
}

type instanceFlags []kvindex.InstanceConfig

// flagWeight turns a weight flag into Config's form, where 0 takes the
// default and a negative weight counts nothing.
func flagWeight(w float64) float64 {
	if w == 0 {
		return -1
	}
	return w
}

func (f *instanceFlags) String() string { return fmt.Sprint(len(*f), " instances") }

func (f *instanceFlags) Set(s string) error {
	name, rest, ok := strings.Cut(s, "=")
	if !ok || name == "" || rest == "" {
		return errors.New("want NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT[,TOPIC[,ENGINE]]]")
	}
	parts := strings.SplitN(rest, ",", 4)
	ic := kvindex.InstanceConfig{Name: name, Endpoint: parts[0]}
	if err := kvevents.CheckEndpoint(ic.Endpoint); err != nil {
		return err
	}
	if len(parts) > 1 && parts[1] != "" {
		ic.ReplayEndpoint = parts[1]
		if err := kvevents.CheckEndpoint(ic.ReplayEndpoint); err != nil {
			return fmt.Errorf("replay %v", err)
		}
	}
	if len(parts) > 2 {
		ic.Topic = parts[2]
	}
	if len(parts) > 3 {
		ic.Engine = parts[3]
		if err := kvindex.CheckEngine(ic.Engine); err != nil {
			return err
		}
	}
	for _, o := range *f {
		if o.Name == name {
			return fmt.Errorf("instance %q given twice", name)
		}
	}
	*f = append(*f, ic)
	return nil
}

// logLevels are -log-level's values.
var logLevels = map[string]logx.Level{"debug": logx.Debug, "info": logx.Info, "warn": logx.Warn, "error": logx.Error, "off": logx.Off}

var levelNames = [...]string{logx.Debug: "DEBUG", logx.Info: "INFO", logx.Warn: "WARN", logx.Error: "ERROR"}

// lockedWriter serialises the lines of concurrent loggers.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) printf(format string, a ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(l.w, format, a...)
}

// options are the command's flags.
type options struct {
	insts                   instanceFlags
	listen, valkey          *string
	prefixKey, logLevel     *string
	bs                      *int
	cpuWeight, sharedWeight *float64
	idle, timeout           *time.Duration
	showVersion             *bool
	// The Valkey connection's security (the shared tier's: a password from
	// an environment variable or a file, never a flag's value).
	vUser, vPassEnv, vPassFile            *string
	vTLSCA, vTLSCert, vTLSKey, vTLSServer *string
	vTLS                                  *bool
}

// newFlags defines the command's flags (README.md's table lists them).
func newFlags(stderr io.Writer) (*flag.FlagSet, *options) {
	fs := flag.NewFlagSet("kvindex", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := &options{}
	o.listen = fs.String("listen", "127.0.0.1:8090", "HTTP address (host:port; port 0 picks a free one)")
	o.bs = fs.Int("block-size", 16, fmt.Sprintf("tokens per block of the engines, in [1, %d]", prefix.MaxBlockSize))
	o.valkey = fs.String("valkey", "", "Valkey/Redis address (host:port); empty: in-memory index")
	o.prefixKey = fs.String("valkey-prefix", "kvindex", "key prefix in Valkey/Redis")
	o.vUser = fs.String("valkey-user", "", "ACL user for AUTH (needs a password); empty: the default user")
	o.vPassEnv = fs.String("valkey-password-env", "", "the name of an environment variable holding the AUTH password")
	o.vPassFile = fs.String("valkey-password-file", "", "the path of a file holding the AUTH password (one trailing newline dropped)")
	o.vTLS = fs.Bool("valkey-tls", false, "TLS to Valkey/Redis, the server's certificate verified (never plaintext then)")
	o.vTLSCA = fs.String("valkey-tls-ca", "", "PEM file of the CAs the server's certificate must chain to; empty: the system's roots")
	o.vTLSCert = fs.String("valkey-tls-cert", "", "PEM client certificate, for a server that asks for one (with -valkey-tls-key)")
	o.vTLSKey = fs.String("valkey-tls-key", "", "its PEM key")
	o.vTLSServer = fs.String("valkey-tls-server-name", "", "the name the server's certificate must be for; empty: the host of -valkey")
	o.cpuWeight = fs.Float64("cpu-weight", kvindex.DefaultCPUWeight, "what a token on an instance's CPU (host) tier counts for in a score, against 1 on its GPU; in [0, 1]")
	o.sharedWeight = fs.Float64("shared-weight", kvindex.DefaultSharedWeight, "what a token on the shared tier counts for; in [0, 1]")
	o.idle = fs.Duration("idle-timeout", kvindex.DefaultIdleTimeout, "how long an instance may send nothing before kvindex checks it is there (a heartbeat, then its replay endpoint); 0: never")
	o.timeout = fs.Duration("timeout", kvindex.DefaultTimeout, "bound of a connection attempt, a replay, and the wait for a heartbeat's answer")
	o.logLevel = fs.String("log-level", "info", "debug, info, warn, error or off (logs go to stderr)")
	o.showVersion = fs.Bool("version", false, "print the version and exit")
	fs.Var(&o.insts, "instance", "an engine: NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT[,TOPIC[,ENGINE]]] (repeat); its publisher binds the endpoints, kvindex connects")
	return fs, o
}

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, nil))
}

// valkeySecurity checks the -valkey-* security flags and returns them as the
// backend's; msg says what is wrong (a bad flag: exit 2). withServer: -valkey
// is given (the flags need it).
func valkeySecurity(o *options, withServer bool) (sec kvindex.ValkeySecurity, msg string) {
	set := *o.vUser != "" || *o.vPassEnv != "" || *o.vPassFile != "" || *o.vTLS ||
		*o.vTLSCA != "" || *o.vTLSCert != "" || *o.vTLSKey != "" || *o.vTLSServer != ""
	switch {
	case !set:
		return sec, ""
	case !withServer:
		return sec, "the -valkey-user, -valkey-password-* and -valkey-tls* flags need -valkey"
	case *o.vPassEnv != "" && *o.vPassFile != "":
		return sec, "give -valkey-password-env or -valkey-password-file, not both"
	case *o.vUser != "" && *o.vPassEnv == "" && *o.vPassFile == "":
		return sec, "-valkey-user needs -valkey-password-env or -valkey-password-file"
	case !*o.vTLS && (*o.vTLSCA != "" || *o.vTLSCert != "" || *o.vTLSKey != "" || *o.vTLSServer != ""):
		return sec, "the -valkey-tls-* flags need -valkey-tls (a setting is never ignored)"
	case (*o.vTLSCert == "") != (*o.vTLSKey == ""):
		return sec, "-valkey-tls-cert and -valkey-tls-key go together"
	}
	sec.Username = *o.vUser
	sec.Password = valkey.Secret{Env: *o.vPassEnv, File: *o.vPassFile}
	if *o.vTLS {
		sec.TLS = &valkey.TLS{CAFile: *o.vTLSCA, CertFile: *o.vTLSCert, KeyFile: *o.vTLSKey, ServerName: *o.vTLSServer}
	}
	return sec, ""
}

// run is the command. It returns the exit status: 0 after a clean
// shutdown (SIGINT, SIGTERM, or ctx done), 1 when it cannot start, 2 for
// bad flags. serving, when not nil, is called with the listener's address
// once the server accepts connections.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, serving func(addr string)) int {
	fs, o := newFlags(stderr)
	insts, listen, bs, valkey, prefixKey := &o.insts, o.listen, o.bs, o.valkey, o.prefixKey
	cpuWeight, sharedWeight, idle, timeout, logLevel, showVersion := o.cpuWeight, o.sharedWeight, o.idle, o.timeout, o.logLevel, o.showVersion
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2 // the flag package said why, with the usage
	}
	if *showVersion {
		fmt.Fprintln(stdout, versionString())
		return 0
	}
	bad := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "kvindex: "+format+"\n", a...)
		fmt.Fprintln(stderr, "kvindex: run kvindex -help for the flags")
		return 2
	}
	level, okLevel := logLevels[*logLevel]
	switch {
	case fs.NArg() > 0:
		return bad("unexpected argument %q (flags only)", fs.Arg(0))
	case len(*insts) == 0:
		return bad("give at least one -instance NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT[,TOPIC[,ENGINE]]]")
	case *bs < 1 || *bs > prefix.MaxBlockSize:
		return bad("-block-size %d: must be in [1, %d], the engines' tokens per block", *bs, prefix.MaxBlockSize)
	case *cpuWeight < 0 || *cpuWeight > 1 || *cpuWeight != *cpuWeight:
		return bad("-cpu-weight %v: must be in [0, 1]", *cpuWeight)
	case *sharedWeight < 0 || *sharedWeight > 1 || *sharedWeight != *sharedWeight:
		return bad("-shared-weight %v: must be in [0, 1]", *sharedWeight)
	case *idle < 0:
		return bad("-idle-timeout %v: must be >= 0 (0: never)", *idle)
	case *timeout <= 0:
		return bad("-timeout %v: must be > 0", *timeout)
	case !okLevel:
		return bad("-log-level %q: must be debug, info, warn, error or off", *logLevel)
	}
	if _, _, err := net.SplitHostPort(*listen); err != nil {
		return bad("-listen %q: %v (want host:port)", *listen, err)
	}
	if *valkey != "" {
		if _, _, err := net.SplitHostPort(*valkey); err != nil {
			return bad("-valkey %q: %v (want host:port)", *valkey, err)
		}
	}
	sec, msg := valkeySecurity(o, *valkey != "")
	if msg != "" {
		return bad("%s", msg)
	}
	cfgIdle := *idle
	if cfgIdle == 0 {
		cfgIdle = -1 // Config's "never"
	}

	out := &lockedWriter{w: stderr}
	logx.SetSink(func(l logx.Level, msg string) {
		name := "?"
		if int(l) < len(levelNames) {
			name = levelNames[l]
		}
		out.printf("%s %-5s %s\n", time.Now().UTC().Format("2006-01-02T15:04:05.000Z"), name, msg)
	}, level)
	defer logx.SetSink(nil, logx.Off)

	var be kvindex.Backend = kvindex.NewMemory()
	if *valkey != "" {
		v, err := kvindex.NewValkeySecure(*valkey, *prefixKey, *timeout, sec)
		if err != nil {
			out.printf("kvindex: valkey %s: %v\n", *valkey, err)
			return 1
		}
		be = v
	}
	defer be.Close()
	x, err := kvindex.New(kvindex.Config{Instances: *insts, BlockSize: *bs, Backend: be, Timeout: *timeout, IdleTimeout: cfgIdle,
		CPUWeight: flagWeight(*cpuWeight), SharedWeight: flagWeight(*sharedWeight)})
	if err != nil {
		return bad("%v", strings.TrimPrefix(err.Error(), "kvindex: "))
	}
	defer x.Close()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		out.printf("kvindex: %v\n", err)
		return 1
	}
	srv := &http.Server{Handler: x.Handler(), ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	addr := ln.Addr().String()
	out.printf("kvindex: serving on http://%s, %d instance(s) (POST /v1/score; GET /v1/instances, /healthz, /readyz, /metrics); %s\n",
		addr, len(*insts), versionString())
	if serving != nil {
		serving(addr)
	}
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		out.printf("kvindex: %v\n", err)
		return 1
	}
	<-done
	out.printf("kvindex: stopped\n")
	return 0
}
