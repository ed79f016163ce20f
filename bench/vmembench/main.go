// Command vmembench measures the virtual-contiguous KV cache (core/vmem):
//
//   - the driver's cost per page: create, map, set access, unmap, release;
//   - Step at steady state (nothing to map) for 64 slots;
//   - a decode loop (each slot's context grows by one token a step, with
//     slots staggered so page boundaries fall on different steps) with
//     background mapping off and on, reporting Step's time on the critical
//     path at ordinary steps and at steps where a slot crosses a page
//     boundary (the spike background mapping is meant to hide).
//
// The GPU's share of an iteration is simulated by sleeping -gpu-ms: the
// background mapper runs during it, as it would during the step's kernels.
//
//	go build -o .device/vmembench ./bench/vmembench && .device/vmembench -backend cuda
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvplug/kvplug/core/vmem"
)

var (
	backend  = flag.String("backend", "cuda", "cuda or host")
	device   = flag.Int("device", 0, "CUDA device ordinal")
	layers   = flag.Int("layers", 32, "layers (Llama-3-8B: 32)")
	kvHeads  = flag.Int("kv-heads", 8, "KV heads")
	headDim  = flag.Int("head-dim", 128, "head dim")
	dtype    = flag.Int("dtype-bytes", 2, "bytes per element")
	batches  = flag.String("batches", "4,16,64", "batch sizes")
	steps    = flag.Int("steps", 0, "decode steps per run (0: one page of tokens + 64)")
	gpuMs    = flag.Float64("gpu-ms", 2, "simulated GPU time per iteration, ms")
	look     = flag.Int("lookahead", 0, "lookahead tokens (0: default)")
	pageIter = flag.Int("page-iters", 256, "pages for the per-page driver timing")
	out      = flag.String("json", "", "write results as JSON to this file")
)

type runResult struct {
	Batch      int     `json:"batch"`
	Background bool    `json:"background"`
	Steps      int     `json:"steps"`
	Boundary   int     `json:"boundary_steps"`
	MedianUs   float64 `json:"step_median_us"`
	P99Us      float64 `json:"step_p99_us"`
	MaxPlainUs float64 `json:"step_max_plain_us"`
	BndMedUs   float64 `json:"boundary_median_us"`
	BndMaxUs   float64 `json:"boundary_max_us"`
	StepMapMs  float64 `json:"step_map_ms"`
	StepWaitMs float64 `json:"step_wait_ms"`
	BgMapMs    float64 `json:"background_map_ms"`
	MapCalls   int64   `json:"map_calls"`
}

type report struct {
	Backend     string             `json:"backend"`
	Model       string             `json:"model"`
	PageSize    int                `json:"page_size"`
	TokensPage  int                `json:"tokens_per_page"`
	GPUMs       float64            `json:"gpu_ms"`
	PageCostUs  map[string]float64 `json:"page_cost_us"`
	SteadyNs    float64            `json:"steady_step_ns_64_slots"`
	SteadyP99Ns float64            `json:"steady_step_p99_ns_64_slots"`
	Runs        []runResult        `json:"runs"`
}

func main() {
	flag.Parse()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "vmembench:", err)
		os.Exit(1)
	}
}

func newDriver() (vmem.Driver, error) {
	if *backend == "host" {
		return vmem.NewHost(0)
	}
	return vmem.NewCUDA(*device)
}

func run() error {
	drv, err := newDriver()
	if err != nil {
		return err
	}
	defer drv.Close()
	page := drv.Granularity()
	tokenBytes := *kvHeads * *headDim * *dtype
	tpp := page / tokenBytes
	rep := report{Backend: *backend, PageSize: page, TokensPage: tpp, GPUMs: *gpuMs,
		Model: fmt.Sprintf("%d layers x %d kv heads x %d dim x %d B", *layers, *kvHeads, *headDim, *dtype)}
	if rep.PageCostUs, err = pageCost(drv, page, *pageIter); err != nil {
		return err
	}
	if rep.SteadyNs, rep.SteadyP99Ns, err = steady(drv); err != nil {
		return err
	}
	for _, f := range strings.Split(*batches, ",") {
		b, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return fmt.Errorf("-batches: %v", err)
		}
		for _, bg := range []bool{false, true} {
			r, err := decode(drv, b, bg, tpp)
			if err != nil {
				return err
			}
			rep.Runs = append(rep.Runs, r)
		}
	}
	printReport(rep)
	if *out != "" {
		data, _ := json.MarshalIndent(rep, "", "  ")
		return os.WriteFile(*out, data, 0o644)
	}
	return nil
}

// pageCost times each driver operation over n pages.
func pageCost(drv vmem.Driver, page, n int) (map[string]float64, error) {
	base, err := drv.Reserve(n * page)
	if err != nil {
		return nil, err
	}
	defer drv.FreeReservation(base, n*page)
	pages := make([]vmem.Page, n)
	var tCreate, tMap, tAccess, tUnmap, tRelease time.Duration
	for i := range pages {
		t := time.Now()
		p, err := drv.CreatePage(page)
		tCreate += time.Since(t)
		if err != nil {
			return nil, err
		}
		pages[i] = p
	}
	for i, p := range pages {
		a := base + uintptr(i*page)
		t := time.Now()
		if err := drv.Map(a, page, p); err != nil {
			return nil, err
		}
		tMap += time.Since(t)
		t = time.Now()
		if err := drv.SetAccess(a, page); err != nil {
			return nil, err
		}
		tAccess += time.Since(t)
	}
	for i := range pages {
		t := time.Now()
		if err := drv.Unmap(base+uintptr(i*page), page); err != nil {
			return nil, err
		}
		tUnmap += time.Since(t)
	}
	for _, p := range pages {
		t := time.Now()
		if err := drv.ReleasePage(p); err != nil {
			return nil, err
		}
		tRelease += time.Since(t)
	}
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / float64(n) }
	return map[string]float64{"create": us(tCreate), "map": us(tMap), "set_access": us(tAccess),
		"unmap": us(tUnmap), "release": us(tRelease)}, nil
}

func newCache(drv vmem.Driver, batch, maxCtx int, budget int64, bg bool) (*vmem.Cache, error) {
	return vmem.New(vmem.Config{Layers: *layers, KVHeads: *kvHeads, HeadDim: *headDim, DTypeBytes: *dtype,
		MaxBatch: batch, MaxContext: maxCtx, BudgetBytes: budget, NoBackground: !bg,
		LookaheadTokens: *look, ReclaimBelowBytes: -1}, drv)
}

// steady times Step for 64 slots whose pages are all mapped.
func steady(drv vmem.Driver) (mean, p99 float64, err error) {
	const b = 64
	unit := int64(2 * *layers * drv.Granularity())
	c, err := newCache(drv, b, 512, 2*b*unit, true)
	if err != nil {
		return 0, 0, err
	}
	defer c.Close()
	slots, ctx := make([]int32, b), make([]int32, b)
	for i := range slots {
		s, err := c.Alloc()
		if err != nil {
			return 0, 0, err
		}
		slots[i], ctx[i] = int32(s), int32(100+i)
	}
	if err := c.Step(slots, ctx); err != nil {
		return 0, 0, err
	}
	c.WaitBackground()
	const n = 200000
	lat := make([]float64, 0, n)
	t0 := time.Now()
	for i := 0; i < n; i++ {
		if err := c.Step(slots, ctx); err != nil {
			return 0, 0, err
		}
	}
	mean = float64(time.Since(t0).Nanoseconds()) / n
	for i := 0; i < 20000; i++ {
		t := time.Now()
		_ = c.Step(slots, ctx)
		lat = append(lat, float64(time.Since(t).Nanoseconds()))
	}
	slices.Sort(lat)
	return mean, lat[len(lat)*99/100], nil
}

// decode runs one decode loop: batch slots, contexts staggered across a page
// so each slot crosses one page boundary at a different step.
func decode(drv vmem.Driver, batch int, bg bool, tpp int) (runResult, error) {
	n := *steps
	if n == 0 {
		n = tpp + 64
	}
	maxCtx := 2*tpp + n + 64
	unitsPerSlot := (maxCtx + tpp - 1) / tpp
	unit := int64(2 * *layers * drv.Granularity())
	c, err := newCache(drv, batch, maxCtx, int64(batch*unitsPerSlot)*unit, bg)
	if err != nil {
		return runResult{}, err
	}
	defer c.Close()
	slots, ctx := make([]int32, batch), make([]int32, batch)
	for i := range slots {
		s, err := c.Alloc()
		if err != nil {
			return runResult{}, err
		}
		slots[i], ctx[i] = int32(s), int32(16+i*tpp/batch)
	}
	// The prefill step maps the first pages; not measured.
	if err := c.Step(slots, ctx); err != nil {
		return runResult{}, err
	}
	c.WaitBackground()
	before := c.Stats()
	gpu := time.Duration(*gpuMs * float64(time.Millisecond))
	var plain, bnd []float64
	for it := 0; it < n; it++ {
		crossing := false
		for i := range ctx {
			ctx[i]++
			if (ctx[i]-1)%int32(tpp) == 0 {
				crossing = true
			}
		}
		t := time.Now()
		if err := c.Step(slots, ctx); err != nil {
			return runResult{}, err
		}
		us := float64(time.Since(t).Nanoseconds()) / 1e3
		if crossing {
			bnd = append(bnd, us)
		} else {
			plain = append(plain, us)
		}
		time.Sleep(gpu)
	}
	st := c.Stats()
	r := runResult{Batch: batch, Background: bg, Steps: n, Boundary: len(bnd),
		StepMapMs:  float64(st.StepMapNs-before.StepMapNs) / 1e6,
		StepWaitMs: float64(st.StepWaitNs-before.StepWaitNs) / 1e6,
		BgMapMs:    float64(st.BackgroundMapNs-before.BackgroundMapNs) / 1e6,
		MapCalls:   st.MapCalls - before.MapCalls}
	all := append(slices.Clone(plain), bnd...)
	slices.Sort(all)
	slices.Sort(plain)
	slices.Sort(bnd)
	r.MedianUs = all[len(all)/2]
	r.P99Us = all[len(all)*99/100]
	if len(plain) > 0 {
		r.MaxPlainUs = plain[len(plain)-1]
	}
	if len(bnd) > 0 {
		r.BndMedUs, r.BndMaxUs = bnd[len(bnd)/2], bnd[len(bnd)-1]
	}
	return r, nil
}

func printReport(r report) {
	fmt.Printf("backend %s, %s, page %d B (%d tokens), simulated GPU %.1f ms/step\n", r.Backend, r.Model, r.PageSize, r.TokensPage, r.GPUMs)
	fmt.Printf("per page (us): create %.1f  map %.1f  set_access %.1f  unmap %.1f  release %.1f\n",
		r.PageCostUs["create"], r.PageCostUs["map"], r.PageCostUs["set_access"], r.PageCostUs["unmap"], r.PageCostUs["release"])
	fmt.Printf("steady Step, 64 slots, nothing to map: mean %.0f ns, p99 %.0f ns\n", r.SteadyNs, r.SteadyP99Ns)
	fmt.Println("batch  bg   steps bnd  step_med_us step_p99_us max_plain_us bnd_med_us bnd_max_us step_map_ms wait_ms bg_map_ms maps")
	for _, x := range r.Runs {
		fmt.Printf("%5d  %-4v %5d %4d %11.2f %11.2f %12.2f %10.2f %10.2f %11.1f %7.1f %9.1f %5d\n",
			x.Batch, x.Background, x.Steps, x.Boundary, x.MedianUs, x.P99Us, x.MaxPlainUs, x.BndMedUs, x.BndMaxUs,
			x.StepMapMs, x.StepWaitMs, x.BgMapMs, x.MapCalls)
	}
}
