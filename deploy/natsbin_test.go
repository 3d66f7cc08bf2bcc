package deploy_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// natsModule is the nats-server module; the version the tests run is the one
// go.mod requires (the server osmo embeds), which the compose file's and the
// manifests' nats images must carry too.
const natsModule = "github.com/nats-io/nats-server/v2"

// natsVersion is the nats-server version go.mod requires, without the "v".
func natsVersion(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*(?:require\s+)?` + regexp.QuoteMeta(natsModule) + `\s+v(\S+)`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("go.mod does not require %s", natsModule)
	}
	return string(m[1])
}

var (
	natsBinOnce sync.Once
	natsBinPath string
	natsBinErr  error
)

// natsServerBin is a nats-server binary of natsVersion: $OSMO_NATS_BIN (the
// test script builds it first with scripts/nats.sh), else one installed
// here from its module with `go install`, kept in ~/.cache/osmo/bin (or
// $OSMO_CACHE_DIR/bin) for the next run. Either way its version is checked.
func natsServerBin(t *testing.T) string {
	t.Helper()
	want := natsVersion(t)
	natsBinOnce.Do(func() {
		if bin := os.Getenv("OSMO_NATS_BIN"); bin != "" {
			natsBinPath, natsBinErr = bin, checkNATSVersion(bin, want)
			if natsBinErr != nil {
				natsBinErr = fmt.Errorf("OSMO_NATS_BIN: %w", natsBinErr)
			}
			return
		}
		natsBinPath, natsBinErr = installNATS(want)
	})
	if natsBinErr != nil {
		t.Fatal(natsBinErr)
	}
	return natsBinPath
}

// checkNATSVersion runs `bin --version`, which prints
// "nats-server: vX.Y.Z".
func checkNATSVersion(bin, want string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s --version: %v: %s", bin, err, out)
	}
	if got := strings.TrimSpace(string(out)); got != "nats-server: v"+want {
		return fmt.Errorf("%s is %q, want nats-server: v%s (go.mod's)", bin, got, want)
	}
	return nil
}

// installNATS returns the cached nats-server of version want, installing it
// first when the cache has none or another version. The binary is installed
// into a fresh directory and renamed into place, so concurrent test runs
// never see half a file.
func installNATS(want string) (string, error) {
	cache := os.Getenv("OSMO_CACHE_DIR")
	if cache == "" {
		dir, err := os.UserCacheDir()
		if err != nil {
			return "", err
		}
		cache = filepath.Join(dir, "osmo")
	}
	binDir := filepath.Join(cache, "bin")
	bin := filepath.Join(binDir, "nats-server")
	if checkNATSVersion(bin, want) == nil {
		return bin, nil
	}
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(binDir, ".nats-server-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "install", natsModule+"@v"+want)
	// Outside this module, so its go.mod and GOFLAGS play no part.
	cmd.Dir = tmp
	cmd.Env = append(os.Environ(), "GOBIN="+tmp, "CGO_ENABLED=0", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go install %s@v%s: %v\n%s", natsModule, want, err, out)
	}
	if err := os.Rename(filepath.Join(tmp, "nats-server"), bin); err != nil {
		return "", err
	}
	return bin, checkNATSVersion(bin, want)
}
