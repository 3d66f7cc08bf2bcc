package cli

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// TestLogDurations: durations in log records read as durations, in JSON
// and text, however they get into a record.
func TestLogDurations(t *testing.T) {
	const d = 911209085 * time.Nanosecond
	for _, format := range []string{"json", "text"} {
		var buf bytes.Buffer
		log, err := (&logFlags{level: "info", format: format}).logger(&buf)
		if err != nil {
			t.Fatal(err)
		}
		log.With("grace", 5*time.Second).WithGroup("g").Info("m", "retry_in", d, "n", 3, "g2", map[string]any{"x": 1})
		out := buf.String()
		if format == "text" {
			for _, want := range []string{"grace=5s", "g.retry_in=911.209085ms", "g.n=3"} {
				if !strings.Contains(out, want) {
					t.Errorf("text record lacks %s: %s", want, out)
				}
			}
			continue
		}
		var rec map[string]any
		if err := json.Unmarshal(buf.Bytes(), &rec); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		g, _ := rec["g"].(map[string]any)
		if rec["grace"] != "5s" || g["retry_in"] != "911.209085ms" || g["n"] != float64(3) {
			t.Errorf("json record: %s", out)
		}
	}
}
