package forkguard

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
)

// capi/forkguard.c is what Generate makes of the header: run `go generate
// ./capi` after changing a prototype.
func TestForkGuardIsCurrent(t *testing.T) {
	h, err := os.ReadFile("../../include/kvplug.h")
	if err != nil {
		t.Fatal(err)
	}
	want, err := Generate(string(h))
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("../../capi/forkguard.c")
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatal("capi/forkguard.c is stale: run `go generate ./capi`")
	}
}

// Every function of the header not written in C has an entry point, and
// the Go glue exports exactly the functions the entry points call.
func TestEveryGoExportHasAnEntryPoint(t *testing.T) {
	h, err := os.ReadFile("../../include/kvplug.h")
	if err != nil {
		t.Fatal(err)
	}
	fns, err := Parse(string(h))
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, f := range fns {
		if !cImplemented[f.Name] {
			want = append(want, "kvpgo_"+f.Name[len("kvp_"):])
		}
	}
	files, err := filepath.Glob("../../capi/*.go")
	if err != nil {
		t.Fatal(err)
	}
	export := regexp.MustCompile(`(?m)^//export (\w+)$`)
	var got []string
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range export.FindAllSubmatch(src, -1) {
			got = append(got, string(m[1]))
		}
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("the Go glue exports %v,\nthe header's entry points call %v", got, want)
	}
	if len(want) < 80 {
		t.Fatalf("only %d entry points parsed", len(want))
	}
}

// Parameters are named whatever their declaration looks like.
func TestParse(t *testing.T) {
	fns, err := Parse(`/* a comment: kvp_status kvp_nothing(void); */
kvp_status kvp_a(const kvp_x *a, int64_t b[4],
                 const void *const *c); // trailing
void kvp_b(void);
const char *kvp_c(void);`)
	if err != nil {
		t.Fatal(err)
	}
	if len(fns) != 3 || !slices.Equal(fns[0].Args, []string{"a", "b", "c"}) || fns[1].Args != nil || fns[2].Ret != "const char *" {
		t.Fatalf("%+v", fns)
	}
	if _, err := Parse("kvp_status kvp_a(int);"); err == nil {
		t.Fatal("an unnamed parameter parsed")
	}
}
