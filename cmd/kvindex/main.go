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
//	    [-cpu-weight 0.75 -shared-weight 0.25]
//
//	curl -d '{"tokens": [1, 2, 3, ...]}' http://127.0.0.1:8090/v1/score
//	{"scores": [{"instance": "e0", "tokens": 160, "blocks": 10, "gpu_tokens": 64,
//	             "cpu_tokens": 96, "shared_tokens": 0, "score": 136, "stale": false}, ...],
//	 "best": "e0", "weights": {"cpu": 0.75, "shared": 0.25}}
//
// gpu_tokens is the prompt's longest prefix on the instance's GPU,
// cpu_tokens how far its host tier continues it, shared_tokens how far the
// shared tier continues that; tokens is their sum, and score counts GPU
// tokens at 1 and the others at the weights (see package core/kvindex,
// "Media"). best is the instance with the highest score.
//
// An instance is NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT[,TOPIC]]. See package
// core/kvindex for the API and the recovery rules.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kvplug/kvplug/core/kvindex"
)

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
		return errors.New("want NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT[,TOPIC]]")
	}
	parts := strings.SplitN(rest, ",", 3)
	ic := kvindex.InstanceConfig{Name: name, Endpoint: parts[0]}
	if len(parts) > 1 {
		ic.ReplayEndpoint = parts[1]
	}
	if len(parts) > 2 {
		ic.Topic = parts[2]
	}
	*f = append(*f, ic)
	return nil
}

func main() {
	var insts instanceFlags
	listen := flag.String("listen", "127.0.0.1:8090", "HTTP address")
	bs := flag.Int("block-size", 16, "tokens per block of the engines")
	valkey := flag.String("valkey", "", "Valkey/Redis address (host:port); empty: in-memory index")
	prefixKey := flag.String("valkey-prefix", "kvindex", "key prefix in Valkey/Redis")
	cpuWeight := flag.Float64("cpu-weight", kvindex.DefaultCPUWeight, "what a token on an instance's CPU (host) tier counts for in a score, against 1 on its GPU; in [0, 1]")
	sharedWeight := flag.Float64("shared-weight", kvindex.DefaultSharedWeight, "what a token on the shared tier counts for; in [0, 1]")
	flag.Var(&insts, "instance", "an engine: NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT[,TOPIC]] (repeat)")
	flag.Parse()
	if len(insts) == 0 {
		fmt.Fprintln(os.Stderr, "kvindex: give at least one -instance")
		flag.Usage()
		os.Exit(2)
	}
	var be kvindex.Backend = kvindex.NewMemory()
	if *valkey != "" {
		v, err := kvindex.NewValkey(*valkey, *prefixKey, 2*time.Second)
		if err != nil {
			fmt.Fprintf(os.Stderr, "kvindex: valkey %s: %v\n", *valkey, err)
			os.Exit(1)
		}
		be = v
	}
	x, err := kvindex.New(kvindex.Config{Instances: insts, BlockSize: *bs, Backend: be,
		CPUWeight: flagWeight(*cpuWeight), SharedWeight: flagWeight(*sharedWeight)})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	srv := &http.Server{Addr: *listen, Handler: x.Handler(), ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	fmt.Fprintf(os.Stderr, "kvindex: %d instances, serving on http://%s\n", len(insts), *listen)
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintln(os.Stderr, "kvindex:", err)
		os.Exit(1)
	}
	x.Close()
	_ = be.Close()
}
