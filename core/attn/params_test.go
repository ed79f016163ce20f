package attn

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

type layoutCase struct {
	cname string
	typ   reflect.Type
	size  uintptr // documented in the header
}

var layoutCases = []layoutCase{
	{"kvp_paged_kv_params", reflect.TypeOf(pagedKVParams{}), 96},
	{"kvp_kv_write_params", reflect.TypeOf(kvWriteParams{}), 160},
	{"kvp_decode_params", reflect.TypeOf(decodeParams{}), 200},
	{"kvp_merge_params", reflect.TypeOf(mergeParams{}), 224},
	{"kvp_prefill_plan_params", reflect.TypeOf(prefillPlanParams{}), 56},
	{"kvp_prefill_params", reflect.TypeOf(prefillParams{}), 200},
}

// TestParamsLayout compiles a program against kernels/kvplug_kernels.h that
// prints sizeof and offsetof of every mirrored field, and compares them with
// the Go structs.
func TestParamsLayout(t *testing.T) {
	for _, c := range layoutCases {
		if got := c.typ.Size(); got != c.size {
			t.Errorf("%s: Go size %d, header documents %d", c.cname, got, c.size)
		}
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Fatalf("a C compiler (cc) is needed to check the parameter layout against the header: %v", err)
	}
	var src strings.Builder
	src.WriteString("#include <stdio.h>\n#include <stddef.h>\n#include \"kvplug_kernels.h\"\nint main(void) {\n")
	want := map[string]uintptr{}
	for _, c := range layoutCases {
		fmt.Fprintf(&src, "  printf(\"%s.sizeof %%zu\\n\", sizeof(%s));\n", c.cname, c.cname)
		want[c.cname+".sizeof"] = c.typ.Size()
		probeFields(t, &src, want, c.cname, "", c.typ, 0)
	}
	for _, d := range headDims {
		for _, dt := range []DType{F16, F32} {
			key := fmt.Sprintf("smem.%d.%d", dt.Size(), d)
			fmt.Fprintf(&src, "  printf(\"%s %%u\\n\", kvp_decode_smem_bytes(%d, %d));\n", key, dt.Size(), d)
			want[key] = uintptr(decodeSharedBytes(dt, d))
			key = fmt.Sprintf("prefill_smem.%d.%d", dt.Size(), d)
			fmt.Fprintf(&src, "  printf(\"%s %%u\\n\", kvp_prefill_smem_bytes(%d, %d));\n", key, dt.Size(), d)
			want[key] = uintptr(prefillSharedBytes(dt, d))
		}
		key := fmt.Sprintf("cascade_smem.%d", d)
		fmt.Fprintf(&src, "  printf(\"%s %%u\\n\", kvp_cascade_smem_bytes(%d));\n", key, d)
		want[key] = uintptr(cascadeSharedBytes(d))
	}
	src.WriteString("  return 0;\n}\n")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "layout.c"), []byte(src.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	inc, _ := filepath.Abs("../../kernels")
	bin := filepath.Join(dir, "layout")
	if out, err := exec.Command(cc, "-std=c99", "-Wall", "-Werror", "-I", inc, "-o", bin, filepath.Join(dir, "layout.c")).CombinedOutput(); err != nil {
		t.Fatalf("compiling the layout probe: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("running the layout probe: %v", err)
	}
	seen := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var key string
		var v uintptr
		if _, err := fmt.Sscanf(line, "%s %d", &key, &v); err != nil {
			t.Fatalf("probe line %q: %v", line, err)
		}
		if w, ok := want[key]; !ok || w != v {
			t.Errorf("%s: C says %d, Go has %d", key, v, w)
		}
		seen++
	}
	if seen != len(want) {
		t.Fatalf("probe printed %d values, want %d", seen, len(want))
	}
}

// probeFields adds the offset and size of every field of typ (a Go mirror
// at offset base of C struct cname, reached through the member path
// prefix) to the probe, descending into nested structs (the paged-KV
// descriptor every cache-reading struct embeds).
func probeFields(t *testing.T, src *strings.Builder, want map[string]uintptr, cname, prefix string, typ reflect.Type, base uintptr) {
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		cf := f.Tag.Get("c")
		if cf == "" {
			t.Fatalf("%s.%s has no c tag", typ.Name(), f.Name)
		}
		member := prefix + cf
		fmt.Fprintf(src, "  printf(\"%s.%s %%zu\\n\", offsetof(%s, %s));\n", cname, member, cname, member)
		fmt.Fprintf(src, "  printf(\"%s.%s.size %%zu\\n\", sizeof(((%s *)0)->%s));\n", cname, member, cname, member)
		want[cname+"."+member] = base + f.Offset
		want[cname+"."+member+".size"] = f.Type.Size()
		if f.Type.Kind() == reflect.Struct {
			probeFields(t, src, want, cname, member+".", f.Type, base+f.Offset)
		}
	}
}
