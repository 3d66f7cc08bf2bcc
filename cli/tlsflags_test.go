package cli_test

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/cli"
	"github.com/osmo-rl/osmo/internal/tlsconfig/tlstest"
)

// TestTLSFlagErrors checks that bad TLS flags stop a command at startup,
// before it listens or dials, with an error that names the flag and file.
func TestTLSFlagErrors(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "ca")
	files := ca.Issue(t, "osmo").Write(t, dir, "osmo", ca)
	missing := filepath.Join(dir, "missing.pem")
	gateway := []string{"gateway", "--addr", "127.0.0.1:0", "--rollout-addr", "127.0.0.1:1"}
	grader := []string{"grader", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", ""}
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"missing cert", append(gateway, "--tls-cert", missing, "--tls-key", files.Key), []string{"--tls-cert " + missing, "no such file"}},
		{"key of no cert", append(gateway, "--tls-cert", files.Cert, "--tls-key", files.CA), []string{"--tls-cert " + files.Cert, "--tls-key " + files.CA}},
		{"cert without key", append(gateway, "--tls-cert", files.Cert), []string{"--tls-cert and --tls-key go together"}},
		{"garbage CA", append(gateway, "--tls-ca", files.Key), []string{"--tls-ca " + files.Key, "no PEM certificate"}},
		{"CA alone on a server only", append(grader, "--tls-ca", files.CA), []string{"--tls-ca needs --tls-cert and --tls-key"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var out, errOut bytes.Buffer
			err := cli.Run(ctx, append(tc.args, "--log-level", "error"), &out, &errOut)
			if err == nil {
				t.Fatal("started")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}
