// Command certgen writes the throwaway PKI of redistest.Certs into a
// directory, for tests outside Go (the Python tests of the shared tier's
// TLS):
//
//	go run ./internal/redistest/certgen DIR
package main

import (
	"fmt"
	"os"

	"github.com/kvplug/kvplug/internal/redistest"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: certgen DIR")
		os.Exit(2)
	}
	if _, err := redistest.WriteCerts(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "certgen:", err)
		os.Exit(1)
	}
}
