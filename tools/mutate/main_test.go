package main

import (
	"os"
	"strings"
	"testing"
)

func TestParseList(t *testing.T) {
	const src = `# a comment
flags core/x -run TestA

mutant x-flip
file core/x/a.go
desc flips it
<<<
	if a > b {
		return
===
	if a >= b {
		return
>>>

mutant x-drop
file core/x/b.go
desc drops a line
equivalent nothing reads it
<<<
	n++
===
>>>
`
	l, err := parseList(strings.NewReader(src), "list")
	if err != nil {
		t.Fatal(err)
	}
	if len(l.muts) != 2 || strings.Join(l.flags["core/x"], " ") != "-run TestA" {
		t.Fatalf("parsed %+v", l)
	}
	a, b := l.muts[0], l.muts[1]
	if a.ID != "x-flip" || a.pkg() != "core/x" || a.Orig != "\tif a > b {\n\t\treturn" || a.Repl != "\tif a >= b {\n\t\treturn" || a.Equivalent != "" {
		t.Fatalf("first mutant %+v", a)
	}
	if b.Orig != "\tn++" || b.Repl != "" || b.Equivalent != "nothing reads it" || b.Line != 15 {
		t.Fatalf("second mutant %+v", b)
	}
}

func TestParseListErrors(t *testing.T) {
	for name, src := range map[string]string{
		"unterminated": "mutant a\nfile f.go\n<<<\nx\n===\n",
		"no file":      "mutant a\n<<<\nx\n===\ny\n>>>\n",
		"no snippet":   "mutant a\nfile f.go\n",
		"twice":        "mutant a\nfile f.go\n<<<\nx\n===\n>>>\nmutant a\nfile f.go\n<<<\nx\n===\n>>>\n",
		"stray":        "file f.go\n",
		"unknown":      "mutant a\nfrobnicate\n",
	} {
		if _, err := parseList(strings.NewReader(src), "list"); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// The shipped list parses (whether it still applies to the code is
// `go run ./tools/mutate -check`'s question, not make test's).
func TestShippedListParses(t *testing.T) {
	f, err := os.Open("mutations.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	l, err := parseList(f, "mutations.txt")
	if err != nil {
		t.Fatal(err)
	}
	if len(l.muts) < 40 {
		t.Fatalf("%d mutations", len(l.muts))
	}
	for _, m := range l.muts {
		if m.Desc == "" {
			t.Errorf("mutant %s has no description", m.ID)
		}
	}
}
