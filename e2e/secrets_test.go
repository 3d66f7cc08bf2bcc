//go:build unix

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// TestSecretsStaySecret runs G2 rollouts through `osmo serve` with its
// state on disk and an event log, SIGKILLs it while they wait on the
// policy, and restarts it on the same state: the restarted server must
// use the trainer's bearer it kept (the callbacks arrive under it), yet no
// log line, state file, event file or record holds that bearer or the
// server's own key, and the files are readable by their owner only.
func TestSecretsStaySecret(t *testing.T) {
	const (
		apiKey = "srv-key-51c0e9aa"
		ctlKey = "ctl-bearer-9b2f7d43"
	)
	secrets := []string{apiKey, ctlKey}
	mockAddr := startMockPolicy(t, "--latency", "1500ms")
	ctl, err := controller.NewG2("127.0.0.1:0", controller.G2Options{PolicyURL: "http://" + mockAddr + "/v1", APIKey: ctlKey, Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)

	dir := t.TempDir()
	stateDir, logDir := filepath.Join(dir, "state"), filepath.Join(dir, "events")
	args := []string{"serve", "--workflow", "multiply", "--grader", "multiply", "-p", "0", "-H", "127.0.0.1",
		"--state", stateDir, "--log", logDir, "--lost-after", "1s", "--log-level", "debug"}
	env := []string{"OSMO_API_KEY=" + apiKey, "OSMO_TRACE_CONTENT=true"}
	first, addrs := startListening(t, "serve-1", env, args...)
	base := addrs["http"]
	args = samePort(t, args, base)
	waitHTTP(t, first, base+"/health")

	ids := []string{"sec-0", "sec-1", "sec-2"}
	for i, id := range ids {
		g2Start(t, ctl, base, apiKey, id, i)
	}
	// The rollouts wait on the policy: their requests are in the state.
	time.Sleep(500 * time.Millisecond)
	first.Stop(syscall.SIGKILL, 0)
	<-first.Done()
	grepFiles(t, stateDir, secrets, "the state of a killed server")

	second := start(t, "serve-2", env, args...)
	waitHTTP(t, second, base+"/health")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for _, id := range ids {
		comp, err := ctl.WaitCompletion(ctx, id)
		if err != nil {
			t.Fatalf("%s: no completion after the restart: %v\n%s", id, err, tail(second.Output(), 4000))
		}
		if got := comp.Header.Get("Authorization"); got != "Bearer "+ctlKey {
			t.Errorf("%s: completion under %q, want the trainer's bearer", id, got)
		}
		if _, err := ctl.WaitGrader(ctx, id); err != nil {
			t.Fatalf("%s: no grader callback after the restart: %v", id, err)
		}
		// The record, as any holder of the server's key reads it.
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/rollouts/"+id, nil)
		req.Header.Set("Authorization", "Bearer "+apiKey)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body bytes.Buffer
		_, _ = body.ReadFrom(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /v1/rollouts/%s: %d %s", id, resp.StatusCode, body.Bytes())
		}
		for _, s := range secrets {
			if strings.Contains(body.String(), s) {
				t.Errorf("the record of %s holds a secret: %s", id, body.Bytes())
			}
		}
	}
	second.Stop(syscall.SIGTERM, 20*time.Second)
	<-second.Done()
	for name, out := range map[string]string{"first": first.Output(), "second": second.Output()} {
		for _, s := range secrets {
			if strings.Contains(out, s) {
				t.Errorf("the %s server's log holds a secret (%s…)", name, s[:4])
			}
		}
	}
	grepFiles(t, stateDir, secrets, "the state")
	grepFiles(t, logDir, secrets, "the event log")
	if n := countFiles(t, logDir); n == 0 {
		t.Errorf("no event files under %s: the check above proved nothing", logDir)
	}
}

// grepFiles fails if any file under dir holds one of secrets, or can be
// read by others than its owner.
func grepFiles(t *testing.T, dir string, secrets []string, what string) {
	t.Helper()
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, s := range secrets {
			if bytes.Contains(b, []byte(s)) {
				t.Errorf("%s: %s holds a secret (%s…)", what, path, s[:4])
			}
		}
		if info, err := d.Info(); err == nil && info.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s: %s has mode %v, want no access for group and others", what, path, info.Mode().Perm())
		}
		return nil
	})
	if err != nil {
		t.Fatal(fmt.Errorf("%s: %w", what, err))
	}
}

func countFiles(t *testing.T, dir string) int {
	t.Helper()
	n := 0
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			n++
		}
		return nil
	})
	return n
}
