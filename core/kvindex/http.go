package kvindex

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/kvplug/kvplug/core/prefix"
)

// QueryRequest is the body of POST /v1/score: a prompt's tokens and the
// keys its engine would hash it with (the salt in hex, multimodal content
// hashes as 32 hex digits).
type QueryRequest struct {
	Tokens  []int32 `json:"tokens"`
	Adapter uint64  `json:"adapter,omitempty"`
	Salt    string  `json:"salt,omitempty"`
	MM      []struct {
		Offset int32  `json:"offset"`
		Length int32  `json:"length"`
		Hash   string `json:"hash"`
	} `json:"mm,omitempty"`
}

// QueryResponse is the answer: every instance's score (its prefix per
// medium and the weighted score), the best one, and the weights of the
// tiers below the GPU that the scores used.
type QueryResponse struct {
	Scores  []Score `json:"scores"`
	Best    string  `json:"best"`
	Weights Weights `json:"weights"`
}

// maxRequestBytes bounds a request body (a 1M-token prompt in JSON is
// about 8 MB).
const maxRequestBytes = 64 << 20

// keys converts the request's keys; nil when it has none.
func (r *QueryRequest) keys() (*prefix.Keys, error) {
	if r.Adapter == 0 && r.Salt == "" && len(r.MM) == 0 {
		return nil, nil
	}
	k := &prefix.Keys{Adapter: r.Adapter}
	if r.Salt != "" {
		s, err := hex.DecodeString(r.Salt)
		if err != nil {
			return nil, fmt.Errorf("salt is not hex: %v", err)
		}
		k.Salt = s
	}
	for i, m := range r.MM {
		h, err := prefix.ParseHash(m.Hash)
		if err != nil {
			return nil, fmt.Errorf("mm[%d].hash: %v", i, err)
		}
		k.MM = append(k.MM, prefix.MMItem{Offset: m.Offset, Length: m.Length, Hash: h})
	}
	return k, k.Validate("query")
}

// Handler serves the index over HTTP/JSON:
//
//	POST /v1/score      QueryRequest -> QueryResponse
//	GET  /v1/instances  []InstanceStatus
//	GET  /healthz       liveness: 200 while the process serves
//	GET  /readyz        readiness: 200 when at least one instance is fresh,
//	                    503 otherwise; the body is Readiness (every
//	                    instance's state) either way
//	GET  /metrics       Prometheus text format (WriteMetrics)
func (x *Index) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/score", func(w http.ResponseWriter, r *http.Request) {
		var req QueryRequest
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxRequestBytes))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return
		}
		k, err := req.keys()
		if err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return
		}
		scores, err := x.Query(req.Tokens, k)
		if err != nil {
			http.Error(w, "query failed: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		writeJSON(w, http.StatusOK, QueryResponse{Scores: scores, Best: Best(scores), Weights: x.w})
	})
	mux.HandleFunc("GET /v1/instances", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, x.Status())
	})
	// Liveness: the process serves. Whether engines are reachable is
	// readiness's question; a liveness probe that failed on it would
	// restart a healthy index whenever an engine restarts.
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		rd := x.Readiness()
		code := http.StatusOK
		if !rd.Ready {
			code = http.StatusServiceUnavailable
		}
		writeJSON(w, code, rd)
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_ = x.WriteMetrics(w)
	})
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
