package kvmanager

import (
	"testing"
	"unsafe"
)

// A step walks hundreds of sequences: each fits one 64-byte cache line.
func TestSeqFitsACacheLine(t *testing.T) {
	if n := unsafe.Sizeof(seq{}); n > 64 {
		t.Fatalf("seq is %d bytes, more than a 64-byte cache line", n)
	}
}
