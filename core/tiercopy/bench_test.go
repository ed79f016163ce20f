package tiercopy

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/internal/gputest"
)

// BenchmarkStore times one batch of demotions of a Llama-3-8B-shaped cache
// (32 layers, K and V, 16 tokens x 8 kv heads x head_dim 128 x bf16 = 32
// KiB a chunk, 2 MiB a slot) by each store engine, 32 and 256 blocks drawn
// at random from 1024, on a stream of its own with nothing beside it:
//
//	gpu-us/op      the device time from an event before the batch to one after it
//	GB/s           the slots' bytes over that time
//	enqueue-us/op  the host time of the Run call
//
// ns/op adds the wait for the events. What the copy engines save the
// kernels running beside a store (its SM time) shows in a serving step,
// not here. Run on a GPU machine with
//
//	go test -c -o .device/tiercopy.test ./core/tiercopy && KVPLUG_REQUIRE_GPU=1 .device/tiercopy.test -test.run '^$' -test.bench Store -test.benchtime 200x
func BenchmarkStore(b *testing.B) {
	gputest.Need(b)
	const (
		layers    = 32
		chunk     = 16 * 8 * 128 * 2
		numBlocks = 1024
		maxOps    = 256
	)
	// Two layouts of the same cache: an allocation a layer and tensor
	// ("arrays", the copy engines' stores then one batched copy a chunk),
	// and one tensor [layers][K, V][blocks] ("tensor", as kvplug.hf
	// allocates; a strided copy a block).
	arrays := Layers{ChunkBytes: chunk, KBlockStride: chunk, VBlockStride: chunk, NumBlocks: numBlocks}
	for range layers {
		arrays.K = append(arrays.K, gputest.Alloc(b, numBlocks*chunk))
		arrays.V = append(arrays.V, gputest.Alloc(b, numBlocks*chunk))
	}
	tensor := arrays
	tensor.K, tensor.V = nil, nil
	whole := gputest.Alloc(b, layers*2*numBlocks*chunk)
	for i := range layers {
		tensor.K = append(tensor.K, whole+cuda.DevicePtr((2*i)*numBlocks*chunk))
		tensor.V = append(tensor.V, whole+cuda.DevicePtr((2*i+1)*numBlocks*chunk))
	}
	slotBytes := arrays.SlotBytesNeeded()
	mem := alignedHost(int(slotBytes) * maxOps)
	host := Host{Base: unsafe.Pointer(&mem[0]), SlotBytes: slotBytes, NumSlots: maxOps}
	stream, err := cuda.StreamCreate()
	if err != nil {
		b.Fatal(err)
	}
	defer cuda.StreamDestroy(stream)
	start, err := cuda.EventCreate()
	if err != nil {
		b.Fatal(err)
	}
	defer start.Destroy()
	end, err := cuda.EventCreate()
	if err != nil {
		b.Fatal(err)
	}
	defer end.Destroy()

	rng := rand.New(rand.NewPCG(1, 2))
	for _, layout := range []struct {
		name string
		l    Layers
	}{{"arrays", arrays}, {"tensor", tensor}} {
		for _, stores := range []StoreEngine{StoreKernel, StoreCopyEngine} {
			c, err := New(layout.l, host, Options{Stores: stores})
			if err != nil {
				b.Fatal(err)
			}
			for _, n := range []int{32, 256} {
				perm := rng.Perm(numBlocks)
				ops := make([]Op, n)
				for i := range ops {
					ops[i] = Op{Block: int32(perm[i]), Slot: int32(i)}
				}
				b.Run(fmt.Sprintf("%s/%s/blocks=%d", layout.name, stores, n), func(b *testing.B) {
					run := func() (gpuMs float32, enqueue time.Duration) {
						if err := start.Record(stream); err != nil {
							b.Fatal(err)
						}
						t0 := time.Now()
						if err := c.Run(ops, nil, stream); err != nil {
							b.Fatal(err)
						}
						enqueue = time.Since(t0)
						if err := end.Record(stream); err != nil {
							b.Fatal(err)
						}
						ms, err := start.Elapsed(end)
						if err != nil {
							b.Fatal(err)
						}
						return ms, enqueue
					}
					run() // first use: the module load, the driver's first batch
					var gpu float64
					var enq time.Duration
					b.ResetTimer()
					for range b.N {
						ms, e := run()
						gpu += float64(ms)
						enq += e
					}
					b.StopTimer()
					us := gpu * 1e3 / float64(b.N)
					b.ReportMetric(us, "gpu-us/op")
					b.ReportMetric(float64(int64(n)*slotBytes)/(us*1e-6)/1e9, "GB/s")
					b.ReportMetric(float64(enq.Nanoseconds())/1e3/float64(b.N), "enqueue-us/op")
				})
			}
			if err := c.Close(); err != nil {
				b.Fatal(err)
			}
		}
	}
}
