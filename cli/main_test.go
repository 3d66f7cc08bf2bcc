package cli_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo/cli"
)

// osmoModeEnv makes the test binary run the osmo command line on its
// arguments instead of the tests: tests start osmo commands as real
// processes without building the binary.
const osmoModeEnv = "OSMO_CLI_TEST_AS_OSMO"

func TestMain(m *testing.M) {
	if os.Getenv(osmoModeEnv) == "1" {
		cli.Main() // exits on failure
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// osmoCommand runs `osmo args...` as the test binary with env added to
// this process's environment.
func osmoCommand(env []string, args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), osmoModeEnv+"=1", "GORACE="+childGORACE()), env...)
	return cmd
}

// childGORACE is the GORACE of children: it keeps a race-enabled child
// from sleeping a second when it exits (the race detector's default, to let
// other threads report).
func childGORACE() string {
	return strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
}
