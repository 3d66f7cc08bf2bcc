package cli

import (
	"runtime/debug"
	"testing"
)

func TestApplyGCDefault(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))

	applyGCDefault(func(string) string { return "" })
	if got := debug.SetGCPercent(100); got != DefaultGCPercent {
		t.Errorf("without GOGC the collector runs at %d, want DefaultGCPercent %d", got, DefaultGCPercent)
	}

	// A GOGC in the environment was applied by the runtime; it stands.
	debug.SetGCPercent(50)
	applyGCDefault(func(k string) string {
		if k == "GOGC" {
			return "50"
		}
		return ""
	})
	if got := debug.SetGCPercent(100); got != 50 {
		t.Errorf("with GOGC=50 set the collector runs at %d, want 50 left alone", got)
	}
}
