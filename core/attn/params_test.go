package attn

import (
	"fmt"
	"reflect"
	"testing"

	"github.com/kvplug/kvplug/internal/cprobe"
)

type layoutCase struct {
	cname string
	typ   reflect.Type
	size  uintptr // documented in the header
}

var layoutCases = []layoutCase{
	{"kvp_paged_kv_params", reflect.TypeOf(pagedKVParams{}), 96},
	{"kvp_kv_write_params", reflect.TypeOf(kvWriteParams{}), 160},
	{"kvp_decode_params", reflect.TypeOf(decodeParams{}), 216},
	{"kvp_merge_params", reflect.TypeOf(mergeParams{}), 232},
	{"kvp_prefill_plan_params", reflect.TypeOf(prefillPlanParams{}), 56},
	{"kvp_prefill_params", reflect.TypeOf(prefillParams{}), 208},
}

// TestParamsLayout compiles a program against kernels/kvplug_kernels.h that
// prints sizeof and offsetof of every mirrored field (internal/cprobe), and
// compares them with the Go structs, with the header's shared-memory
// formulas.
func TestParamsLayout(t *testing.T) {
	p := cprobe.New("kvplug_kernels.h")
	for _, c := range layoutCases {
		if got := c.typ.Size(); got != c.size {
			t.Errorf("%s: Go size %d, header documents %d", c.cname, got, c.size)
		}
		p.Structs(t, cprobe.Struct{CName: c.cname, Type: c.typ})
	}
	for _, d := range headDims {
		for _, dt := range []DType{F16, F32} {
			p.Value(fmt.Sprintf("smem.%d.%d", dt.Size(), d), fmt.Sprintf("kvp_decode_smem_bytes(%d, %d)", dt.Size(), d),
				uint64(decodeSharedBytes(dt, d)))
			p.Value(fmt.Sprintf("prefill_smem.%d.%d", dt.Size(), d), fmt.Sprintf("kvp_prefill_smem_bytes(%d, %d)", dt.Size(), d),
				uint64(prefillSharedBytes(dt, d)))
		}
		p.Value(fmt.Sprintf("cascade_smem.%d", d), fmt.Sprintf("kvp_cascade_smem_bytes(%d)", d), uint64(cascadeSharedBytes(d)))
		p.Value(fmt.Sprintf("cascade_e4m3_smem.%d", d), fmt.Sprintf("kvp_cascade_smem_bytes_e4m3(%d)", d),
			uint64(cascadeSharedBytesE4M3(d)))
		p.Value(fmt.Sprintf("e4m3_smem.%d", d), fmt.Sprintf("kvp_decode_smem_bytes_e4m3(%d)", d), uint64(decodeSharedBytesE4M3(d)))
		p.Value(fmt.Sprintf("e4m3_prefill_smem.%d", d), fmt.Sprintf("kvp_prefill_smem_bytes_e4m3(%d)", d),
			uint64(prefillSharedBytesE4M3(d)))
		p.Value(fmt.Sprintf("sm90_smem.%d", d), fmt.Sprintf("kvp_prefill_sm90_smem_bytes(2, %d)", d), uint64(prefillSM90SharedBytes(BF16, d)))
		p.Value(fmt.Sprintf("sm90_e4m3_smem.%d", d), fmt.Sprintf("kvp_prefill_sm90_smem_bytes_e4m3(%d)", d),
			uint64(prefillSM90SharedBytesE4M3(d)))
	}
	p.Value("sm90_fp8_smem", fmt.Sprintf("kvp_prefill_sm90_smem_bytes_fp8(%d)", fp8QKVHeadDim), uint64(prefillSM90SharedBytesFP8(fp8QKVHeadDim)))
	p.Run(t, "../../kernels")
}
