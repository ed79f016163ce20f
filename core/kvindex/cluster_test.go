package kvindex

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/redistest"
)

// The Valkey backend on a 3-primary cluster (one replicated): the backend
// contract holds; each instance's sets share a slot (hash tags) while the
// instances spread over the primaries; after the replicated primary's loss
// and its replica's promotion the generation changes (every instance is
// rebuilt) and the sets answer again.
func TestValkeyBackendCluster(t *testing.T) {
	cl := redistest.StartCluster(t, redistest.Find(t), 3, 1)
	v, err := NewValkey(cl.Seed(), "kvcl", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if !v.cluster || !strings.HasSuffix(string(v.keyIn("a", prefix.MediumCPU)), ":{a}") {
		t.Fatalf("cluster %v, key %s", v.cluster, v.keyIn("a", prefix.MediumCPU))
	}
	testBackendMedia(t, v)
	const n = 30
	insts := make([]string, n)
	chains := make([][]kvevents.Key, n)
	for i := range insts {
		insts[i] = fmt.Sprint("inst-", i)
		chains[i] = keys(1, 2, 3)
		if err := v.Apply(insts[i], []Op{
			{Kind: OpAdd, Keys: keys(1)},
			{Kind: OpAdd, Medium: prefix.MediumCPU, Keys: keys(2)},
			{Kind: OpAdd, Medium: prefix.MediumShared, Keys: keys(3)},
		}); err != nil {
			t.Fatal(err)
		}
	}
	check := func() error {
		got, err := v.Match(insts, chains)
		if err != nil {
			return err
		}
		for i, h := range got {
			if h != (Held{1, 1, 1}) {
				return fmt.Errorf("instance %d holds %+v", i, h)
			}
		}
		return nil
	}
	if err := check(); err != nil {
		t.Fatal(err)
	}
	for _, p := range cl.Primaries {
		if k := redistest.Cmd(t, p.Addr(), "DBSIZE").(int64); k < 3 {
			t.Fatalf("primary %s holds %d keys", p.Addr(), k)
		}
	}
	// An instance's sets are cleared in one DEL: one slot.
	if err := v.Apply(insts[0], []Op{{Kind: OpClear}}); err != nil {
		t.Fatal(err)
	}
	if err := v.Apply(insts[0], []Op{{Kind: OpAdd, Keys: keys(1)}, {Kind: OpAdd, Medium: prefix.MediumCPU, Keys: keys(2)},
		{Kind: OpAdd, Medium: prefix.MediumShared, Keys: keys(3)}}); err != nil {
		t.Fatal(err)
	}

	victim, replica := cl.Primaries[0], cl.Replicas[0]
	deadline := time.Now().Add(10 * time.Second)
	for redistest.Cmd(t, replica.Addr(), "DBSIZE").(int64) != redistest.Cmd(t, victim.Addr(), "DBSIZE").(int64) {
		if time.Now().After(deadline) {
			t.Fatal("the replica did not catch up")
		}
		time.Sleep(10 * time.Millisecond)
	}
	gen := v.Generation()
	victim.Stop()
	if err := check(); err == nil {
		t.Fatal("no error with a primary down")
	}
	cl.Promote(t, replica)
	deadline = time.Now().Add(10 * time.Second)
	for {
		_ = v.Ping()
		if v.Generation() != gen && check() == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the failover: generation %d (was %d), %v", v.Generation(), gen, check())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
