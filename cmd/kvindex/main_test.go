package main

import "testing"

func TestInstanceFlag(t *testing.T) {
	var f instanceFlags
	for _, ok := range []string{"a=tcp://h:1", "b=tcp://h:2,tcp://h:3", "c=tcp://h:4,tcp://h:5,kv@c@m"} {
		if err := f.Set(ok); err != nil {
			t.Fatalf("%s: %v", ok, err)
		}
	}
	if len(f) != 3 || f[1].ReplayEndpoint != "tcp://h:3" || f[2].Topic != "kv@c@m" || f[0].ReplayEndpoint != "" {
		t.Fatalf("parsed %+v", f)
	}
	for _, bad := range []string{"", "a", "=tcp://h:1", "a="} {
		if err := f.Set(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestFlagWeight(t *testing.T) {
	for in, want := range map[float64]float64{0: -1, 0.5: 0.5, 1: 1} {
		if got := flagWeight(in); got != want {
			t.Errorf("flagWeight(%v) = %v, want %v", in, got, want)
		}
	}
}
