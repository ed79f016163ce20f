// Command gen writes capi/forkguard.c from include/kvplug.h (package
// forkguard); `go generate ./capi` runs it from capi/.
package main

import (
	"fmt"
	"os"

	"github.com/kvplug/kvplug/internal/forkguard"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: gen HEADER OUTPUT")
		os.Exit(2)
	}
	h, err := os.ReadFile(os.Args[1])
	if err == nil {
		var out string
		if out, err = forkguard.Generate(string(h)); err == nil {
			err = os.WriteFile(os.Args[2], []byte(out), 0o644)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
