package kverr

import (
	"os"
	"regexp"
	"strconv"
	"testing"
)

// The codes here are the header's enum kvp_status, name for name and value
// for value: the C ABI returns them as they are.
func TestCodesMatchTheHeader(t *testing.T) {
	src, err := os.ReadFile("../../include/kvplug.h")
	if err != nil {
		t.Fatal(err)
	}
	body := regexp.MustCompile(`(?s)typedef enum kvp_status \{(.*?)\} kvp_status;`).FindSubmatch(src)
	if body == nil {
		t.Fatal("enum kvp_status not found in include/kvplug.h")
	}
	header := map[string]Code{}
	for _, m := range regexp.MustCompile(`(?m)^\s*(KVP_\w+)\s*=\s*(\d+)`).FindAllSubmatch(body[1], -1) {
		v, _ := strconv.Atoi(string(m[2]))
		header[string(m[1])] = Code(v)
	}
	if len(header) != len(names) {
		t.Errorf("the header has %d status codes, kverr %d", len(header), len(names))
	}
	for code, name := range names {
		if v, ok := header[name]; !ok || v != code {
			t.Errorf("%s is %d in kverr, %d in the header (present: %v)", name, code, v, ok)
		}
	}
}
