// Package cprobe checks Go mirrors of C structs against the C header they
// mirror: it compiles a small program against the header with the system C
// compiler (cc), which prints sizeof and offsetof of every mirrored field,
// and compares them with the Go types. Tests of the packages that launch
// kernels use it, so that a header change that the Go mirror did not follow
// fails in make test, not on a GPU.
//
// A mirror's fields carry `c:"name"` tags naming the C members; a field of
// struct type is descended into (a nested C struct member).
package cprobe

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// Struct is one C struct and its Go mirror.
type Struct struct {
	CName string       // the C type name: "kvp_decode_params"
	Type  reflect.Type // the Go mirror
}

// Probe is a probe program under construction: the structs to compare, and
// any further values (the header's inline formulas) a test adds.
type Probe struct {
	src  strings.Builder
	want map[string]uint64
}

// New starts a probe of header (a file name in includeDir).
func New(header string) *Probe {
	p := &Probe{want: map[string]uint64{}}
	fmt.Fprintf(&p.src, "#include <stdio.h>\n#include <stddef.h>\n#include \"%s\"\nint main(void) {\n", header)
	return p
}

// Structs adds every field's offset and size, and each struct's size.
func (p *Probe) Structs(t testing.TB, ss ...Struct) {
	t.Helper()
	for _, s := range ss {
		fmt.Fprintf(&p.src, "  printf(\"%s.sizeof %%zu\\n\", sizeof(%s));\n", s.CName, s.CName)
		p.want[s.CName+".sizeof"] = uint64(s.Type.Size())
		p.fields(t, s.CName, "", s.Type, 0)
	}
}

func (p *Probe) fields(t testing.TB, cname, prefix string, typ reflect.Type, base uintptr) {
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		cf := f.Tag.Get("c")
		if cf == "" {
			t.Fatalf("%s.%s has no c tag", typ.Name(), f.Name)
		}
		member := prefix + cf
		fmt.Fprintf(&p.src, "  printf(\"%s.%s %%zu\\n\", offsetof(%s, %s));\n", cname, member, cname, member)
		fmt.Fprintf(&p.src, "  printf(\"%s.%s.size %%zu\\n\", sizeof(((%s *)0)->%s));\n", cname, member, cname, member)
		p.want[cname+"."+member] = uint64(base + f.Offset)
		p.want[cname+"."+member+".size"] = uint64(f.Type.Size())
		if f.Type.Kind() == reflect.Struct {
			p.fields(t, cname, member+".", f.Type, base+f.Offset)
		}
	}
}

// Value adds a C expression of unsigned type (printed with %u) that must
// equal want.
func (p *Probe) Value(key, expr string, want uint64) {
	fmt.Fprintf(&p.src, "  printf(\"%s %%u\\n\", (unsigned)(%s));\n", key, expr)
	p.want[key] = want
}

// Run compiles the probe against includeDir, runs it and fails t on every
// value that differs.
func (p *Probe) Run(t testing.TB, includeDir string) {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Fatalf("a C compiler (cc) is needed to check the Go mirrors against the header: %v", err)
	}
	p.src.WriteString("  return 0;\n}\n")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "probe.c"), []byte(p.src.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	inc, err := filepath.Abs(includeDir)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "probe")
	if out, err := exec.Command(cc, "-std=c99", "-Wall", "-Werror", "-I", inc, "-o", bin, filepath.Join(dir, "probe.c")).CombinedOutput(); err != nil {
		t.Fatalf("compiling the layout probe: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("running the layout probe: %v", err)
	}
	seen := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var key string
		var v uint64
		if _, err := fmt.Sscanf(line, "%s %d", &key, &v); err != nil {
			t.Fatalf("probe line %q: %v", line, err)
		}
		if w, ok := p.want[key]; !ok || w != v {
			t.Errorf("%s: C says %d, Go has %d", key, v, w)
		}
		seen++
	}
	if seen != len(p.want) {
		t.Fatalf("probe printed %d values, want %d", seen, len(p.want))
	}
}
