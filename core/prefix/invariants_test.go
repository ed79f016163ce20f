package prefix

import (
	"strings"
	"testing"
)

// CheckStructure skips only the rehash of cached blocks: a block whose
// stored tokens no longer hash to its hash fails CheckInvariants and passes
// CheckStructure, and a broken count fails both.
func TestCheckStructureSkipsOnlyTheRehash(t *testing.T) {
	x := newIndex(t, 4, 16, false)
	insertChain(t, x, []int32{1, 2, 3, 4, 5, 6, 7, 8}, nil, 3, 4)
	if err := x.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	i := x.byBlock[4]
	x.tokensOf(i)[0]++ // the block's content, behind the index's back
	if err := x.CheckInvariants(); err == nil || !strings.Contains(err.Error(), "content hashes to") {
		t.Fatalf("CheckInvariants after a content change: %v", err)
	}
	if err := x.CheckStructure(); err != nil {
		t.Fatalf("CheckStructure rehashed: %v", err)
	}
	x.tokensOf(i)[0]--
	x.nodes[i].pin++ // a pin no Pin took
	for name, check := range map[string]func() error{"CheckInvariants": x.CheckInvariants, "CheckStructure": x.CheckStructure} {
		if err := check(); err == nil {
			t.Fatalf("%s missed a pin no Pin took", name)
		}
	}
}
