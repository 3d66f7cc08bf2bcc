package cli

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestBenchPlane: `osmo bench plane` measures the single-upstream proxy and
// says why the plane's rows are missing while the proxy has no engine set.
func TestBenchPlane(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	out, err := runCommand(ctx, nil, "bench", "plane", "-n", "100", "--samples", "20", "--rollouts", "40")
	if err != nil {
		t.Fatalf("osmo bench plane: %v\n%s", err, out)
	}
	for _, want := range []string{"single upstream", "direct", "added p99", "affinity", "engine killed mid-run"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("osmo bench plane output lacks %q:\n%s", want, out)
		}
	}
	for _, args := range [][]string{{"-n", "5"}, {"--clients", "0"}, {"--samples", "3"}, {"--kill-engines", "1"}, {"--rollouts", "0"}, {"--long-calls", "1"}, {"extra"}} {
		_, err := runCommand(ctx, nil, append([]string{"bench", "plane"}, args...)...)
		if !errors.As(err, new(usageError)) {
			t.Errorf("osmo bench plane %v: %v, want a usage error", args, err)
		}
	}
}
