package execagent_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/workflows/execagent"
)

func TestLimitsJSON(t *testing.T) {
	want := execagent.Limits{Memory: 512 << 20, Processes: 64, CPU: 30 * time.Second, FileSize: execagent.Unlimited}
	for _, doc := range []string{
		`{"command":["true"],"limits":"memory=512MiB,processes=64,cpu=30s,file-size=none"}`,
		`{"command":["true"],"limits":{"memory":"512MiB","processes":64,"cpu":"30s","file-size":"none"}}`,
	} {
		var cfg execagent.Config
		if err := json.Unmarshal([]byte(doc), &cfg); err != nil {
			t.Fatalf("%s: %v", doc, err)
		}
		if cfg.Limits != want {
			t.Errorf("%s: limits %+v, want %+v", doc, cfg.Limits, want)
		}
		out, err := json.Marshal(cfg.Limits)
		if err != nil || string(out) != `"memory=512MiB,processes=64,cpu=30s,file-size=none"` {
			t.Errorf("marshal: %s %v", out, err)
		}
	}
	var cfg execagent.Config
	err := json.Unmarshal([]byte(`{"limits":{"processes":"many"}}`), &cfg)
	if err == nil || !strings.Contains(err.Error(), "processes") {
		t.Errorf("a bad limit: %v, want an error naming processes", err)
	}
}

func TestLimitErrorNamesTheLimit(t *testing.T) {
	err := error(&execagent.LimitError{Limit: "memory", Value: "512MiB", How: "the kernel's OOM killer killed 1 of its processes"})
	wrapped := errors.Join(errors.New("context"), err)
	var le *execagent.LimitError
	if !errors.As(wrapped, &le) || le.Limit != "memory" {
		t.Fatalf("errors.As: %v", wrapped)
	}
	if got := err.Error(); !strings.HasPrefix(got, "exec agent exceeded its memory limit (memory=512MiB)") {
		t.Errorf("Error() = %q", got)
	}
}

func TestPassEnvValidation(t *testing.T) {
	cfg := execagent.Config{Command: []string{"true"}, PassEnv: []string{"GOOD", "AWS_*", "OPENAI_API_KEY", "OSMOSIS_*", "*"}}
	err := cfg.Validate()
	for _, field := range []string{"pass_env[2]", "pass_env[3]", "pass_env[4]"} {
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("Validate() = %v, want it to refuse %s", err, field)
		}
	}
	if err != nil && (strings.Contains(err.Error(), "pass_env[0]") || strings.Contains(err.Error(), "pass_env[1]")) {
		t.Errorf("Validate() refused a good name: %v", err)
	}
}
