// Package kvmtest holds fixtures of managers for the tests of the packages
// that build on core/kvmanager (core/attn's shared-prefix planner, capi's
// kvp_manager_cascade_plan), so that they plan the same batches.
package kvmtest

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kvmanager"
)

// SharingManager is a manager (block size 16, prefix cache on) holding 3
// system prompts' worth of sharing: 12 sequences admitted with one of two
// system prompts (544 and 280 tokens), the first group's four with a
// few-shot block after it, and 3 forks of sequence 1; it returns the
// manager and the batch's ids in a scrambled order.
func SharingManager(t testing.TB) (*kvmanager.Manager, []int64) {
	t.Helper()
	m, err := kvmanager.New(kvmanager.Config{NumBlocks: 1024, BlockSize: 16, EnablePrefixCache: true})
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	toks := func(n int) []int32 {
		v := make([]int32, n)
		for i := range v {
			v[i] = r.Int32N(32000)
		}
		return v
	}
	sys := [][]int32{toks(544), toks(280)}
	shots := toks(160)
	var ids []int64
	for id := int64(1); id <= 12; id++ {
		p := slices.Clone(sys[id%2])
		if id%2 == 0 && id <= 8 {
			p = append(p, shots...)
		}
		p = append(p, toks(int(id)*7)...)
		if _, err := m.Admit([]int64{id}, kvmanager.Prompts{Tokens: p, Offsets: []int64{0, int64(len(p))}}, nil); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if _, err := m.Fork(1, []int64{101, 102, 103}, make([]kvmanager.CopyPair, 3)); err != nil {
		t.Fatal(err)
	}
	ids = append(ids, 101, 102, 103)
	ones := make([]int32, len(ids))
	for i := range ones {
		ones[i] = 1
	}
	if err := m.Grow(ids, ones); err != nil {
		t.Fatal(err)
	}
	r.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	return m, ids
}
