package cli

import (
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/workflows/execagent"
)

func TestExecLimitsFlag(t *testing.T) {
	var f execLimitsFlag
	if err := f.Set("memory=512MiB, processes=64,files=none,cpu=30s,file-size=1G"); err != nil {
		t.Fatal(err)
	}
	want := execagent.Limits{Memory: 512 << 20, Processes: 64, Files: execagent.Unlimited, CPU: 30 * time.Second, FileSize: 1 << 30}
	if f.limits != want {
		t.Errorf("limits %+v, want %+v", f.limits, want)
	}
	if got := f.String(); got != "memory=512MiB,processes=64,files=none,cpu=30s,file-size=1GiB" {
		t.Errorf("String() = %q", got)
	}
	// Laid over the config's: the keys given win, the others stay.
	got := f.over(execagent.Limits{Memory: 1 << 30, CPU: time.Minute, FileSize: 4096})
	if got.Memory != 512<<20 || got.CPU != 30*time.Second || got.FileSize != 1<<30 {
		t.Errorf("over: %+v", got)
	}
	var unset execLimitsFlag
	if got := unset.over(execagent.Limits{Processes: 9}); got.Processes != 9 {
		t.Errorf("an unset flag changed the config: %+v", got)
	}
}

func TestExecLimitsFlagErrors(t *testing.T) {
	for in, key := range map[string]string{
		"memory=lots":          "memory",
		"memory=-5MiB":         "memory",
		"processes=1.5":        "processes",
		"files=-1":             "files",
		"cpu=500ms":            "cpu",
		"cpu=forever":          "cpu",
		"file-size=1Q":         "file-size",
		"swap=1G":              "swap",
		"memory":               "memory",
		"memory=1G,memory=2G":  "memory",
		"user=nosuchuser-osmo": "user",
	} {
		var f execLimitsFlag
		err := f.Set(in)
		if err == nil {
			t.Errorf("Set(%q) accepted", in)
			continue
		}
		if !strings.Contains(err.Error(), key) {
			t.Errorf("Set(%q) = %v, want it to name %s", in, err, key)
		}
	}
}
