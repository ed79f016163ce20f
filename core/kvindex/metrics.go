package kvindex

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvplug/kvplug/core/prefix"
)

// latencyBuckets are the upper bounds, in seconds, of the scoring latency
// histogram: a query hashes the prompt and asks the backend (memory:
// microseconds; Valkey: a round trip).
var latencyBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}

// latency is a histogram of Query's durations and a count of its errors.
type latency struct {
	buckets [15]atomic.Int64 // per bucket (the last: +Inf), not cumulative
	sumNs   atomic.Int64
	errors  atomic.Int64
}

// since records a query that started at start; *err says whether it
// failed.
func (l *latency) since(start time.Time, err *error) {
	d := time.Since(start)
	s := d.Seconds()
	i := 0
	for i < len(latencyBuckets) && s > latencyBuckets[i] {
		i++
	}
	l.buckets[i].Add(1)
	l.sumNs.Add(int64(d))
	if *err != nil {
		l.errors.Add(1)
	}
}

// Sizer is a Backend that can say how many block keys it holds per
// instance and medium (the index's size, for metrics).
type Sizer interface {
	Sizes(insts []string) ([][prefix.NumMedia]int, error)
}

// mediumNames are the media's names as metrics label them.
var mediumNames = [prefix.NumMedia]string{"gpu", "cpu", "shared"}

// escapeLabel escapes a label value for the Prometheus text format.
var escapeLabel = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace

// WriteMetrics writes the index's metrics in the Prometheus text
// exposition format (version 0.0.4), as GET /metrics serves them.
func (x *Index) WriteMetrics(w io.Writer) error {
	bw := bufio.NewWriter(w)
	st := x.Status()
	header := func(name, typ, help string) {
		fmt.Fprintf(bw, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	perInstance := []struct {
		name, help string
		v          func(s *InstanceStatus) int64
	}{
		{"kvindex_batches_total", "Event batches applied, per instance.", func(s *InstanceStatus) int64 { return s.Batches }},
		{"kvindex_events_total", "KV events received and applied, per instance.", func(s *InstanceStatus) int64 { return s.Events }},
		{"kvindex_gaps_total", "Gaps in an instance's sequence numbers.", func(s *InstanceStatus) int64 { return s.Gaps }},
		{"kvindex_replayed_batches_total", "Batches filled in from an instance's replay endpoint.", func(s *InstanceStatus) int64 { return s.Replayed }},
		{"kvindex_resyncs_total", "Times an instance's set was cleared and rebuilt from a snapshot.", func(s *InstanceStatus) int64 { return s.Resyncs }},
		{"kvindex_snapshot_requests_total", "Snapshots asked of an instance's replay endpoint.", func(s *InstanceStatus) int64 { return s.Snapshots }},
		{"kvindex_bad_batches_total", "Batches that did not decode, or whose sequence number cannot be followed.", func(s *InstanceStatus) int64 { return s.BadBatches }},
		{"kvindex_backend_errors_total", "Failed writes of an instance's events to the backend.", func(s *InstanceStatus) int64 { return s.BackendErrors }},
		{"kvindex_unknown_medium_events_total", "Events of a medium the index does not know, ignored.", func(s *InstanceStatus) int64 { return s.UnknownMedium }},
		{"kvindex_disconnects_total", "Times an instance went down (connection closed or silent).", func(s *InstanceStatus) int64 { return s.Disconnects }},
		{"kvindex_heartbeats_total", "Heartbeats (ZMTP PING) sent to a silent instance.", func(s *InstanceStatus) int64 { return s.Heartbeats }},
		{"kvindex_untranslated_blocks_total", "Stored blocks of a vLLM or SGLang instance the index could not rehash (not indexed).", func(s *InstanceStatus) int64 { return s.Untranslated }},
		{"kvindex_joined_mid_stream_total", "(Re)starts of a vLLM or SGLang instance whose earlier batches could not be replayed.", func(s *InstanceStatus) int64 { return s.JoinedMidStream }},
		{"kvindex_foreign_hash_events_total", "Events of an engine's own hashes from an instance configured as kvplug's, ignored.", func(s *InstanceStatus) int64 { return s.ForeignHashEvents }},
	}
	for _, m := range perInstance {
		header(m.name, "counter", m.help)
		for i := range st {
			fmt.Fprintf(bw, "%s{instance=\"%s\"} %d\n", m.name, escapeLabel(st[i].Name), m.v(&st[i]))
		}
	}
	header("kvindex_instance_state", "gauge", "1 for an instance's current state (fresh: routed; stale: waiting for a snapshot; down: not connected).")
	count := map[State]int{}
	for i := range st {
		count[st[i].State]++
		for _, s := range States {
			v := 0
			if st[i].State == s {
				v = 1
			}
			fmt.Fprintf(bw, "kvindex_instance_state{instance=\"%s\",state=\"%s\"} %d\n", escapeLabel(st[i].Name), s, v)
		}
	}
	header("kvindex_instances", "gauge", "Instances by state.")
	for _, s := range States {
		fmt.Fprintf(bw, "kvindex_instances{state=\"%s\"} %d\n", s, count[s])
	}
	header("kvindex_instance_last_heard_timestamp_seconds", "gauge", "When an instance last sent a batch or answered a heartbeat (Unix time; 0: never).")
	for i := range st {
		ts := 0.0
		if !st[i].LastHeard.IsZero() {
			ts = float64(st[i].LastHeard.UnixNano()) / 1e9
		}
		fmt.Fprintf(bw, "kvindex_instance_last_heard_timestamp_seconds{instance=\"%s\"} %s\n", escapeLabel(st[i].Name), formatFloat(ts))
	}
	header("kvindex_block_updates_total", "counter", "Block keys added or removed, over all instances.")
	fmt.Fprintf(bw, "kvindex_block_updates_total %d\n", x.updates.Load())
	if sz, ok := x.be.(Sizer); ok {
		names := make([]string, len(x.insts))
		for i, in := range x.insts {
			names[i] = in.cfg.Name
		}
		n, err := sz.Sizes(names)
		up := 1
		if err != nil {
			up = 0
		}
		header("kvindex_backend_up", "gauge", "1 when the backend answered the last size query.")
		fmt.Fprintf(bw, "kvindex_backend_up %d\n", up)
		if err == nil {
			header("kvindex_index_blocks", "gauge", "Block keys the index holds, per instance and medium.")
			for i, name := range names {
				for md := range prefix.NumMedia {
					fmt.Fprintf(bw, "kvindex_index_blocks{instance=\"%s\",medium=\"%s\"} %d\n", escapeLabel(name), mediumNames[md], n[i][md])
				}
			}
		}
	}
	q := &x.queries
	header("kvindex_score_duration_seconds", "histogram", "Time to score a prompt against every instance (hashing and backend lookup).")
	var cum int64
	for i, le := range latencyBuckets {
		cum += q.buckets[i].Load()
		fmt.Fprintf(bw, "kvindex_score_duration_seconds_bucket{le=\"%s\"} %d\n", formatFloat(le), cum)
	}
	cum += q.buckets[len(latencyBuckets)].Load()
	fmt.Fprintf(bw, "kvindex_score_duration_seconds_bucket{le=\"+Inf\"} %d\n", cum)
	fmt.Fprintf(bw, "kvindex_score_duration_seconds_sum %s\n", formatFloat(float64(q.sumNs.Load())/1e9))
	fmt.Fprintf(bw, "kvindex_score_duration_seconds_count %d\n", cum)
	header("kvindex_score_errors_total", "counter", "Scoring requests that failed (a backend error, a bad prompt).")
	fmt.Fprintf(bw, "kvindex_score_errors_total %d\n", q.errors.Load())
	return bw.Flush()
}

func formatFloat(v float64) string {
	if math.IsInf(v, 1) {
		return "+Inf"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}
