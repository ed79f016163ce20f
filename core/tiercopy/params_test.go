package tiercopy

import (
	"reflect"
	"testing"

	"github.com/kvplug/kvplug/internal/cprobe"
)

// TestParamsLayout compares params with kvp_tier_copy_params of
// kernels/kvplug_kernels.h, every field's offset and size, and the launch
// constants with the header's.
func TestParamsLayout(t *testing.T) {
	p := cprobe.New("kvplug_kernels.h")
	p.Structs(t, cprobe.Struct{CName: "kvp_tier_copy_params", Type: reflect.TypeOf(params{})})
	p.Value("threads", "KVP_TIER_COPY_THREADS", threads)
	p.Value("cta_bytes", "KVP_TIER_COPY_CTA_BYTES", ctaByte)
	p.Value("ops", "KVP_TIER_COPY_OPS", OpsPerLaunch)
	p.Run(t, "../../kernels")
}
