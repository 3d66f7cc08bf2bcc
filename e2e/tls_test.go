package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/tlsconfig/tlstest"
)

// clientTLS is a client configuration that trusts the CA certificates in
// rootsPEM and presents pair (none if nil). It is built from crypto/tls
// alone, not from osmo's own code, so the servers are checked by a client
// that shares nothing with them.
func clientTLS(t *testing.T, rootsPEM []byte, pair *tlstest.Pair) *tls.Config {
	t.Helper()
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(rootsPEM) {
		t.Fatal("no CA certificate")
	}
	cfg := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	if pair != nil {
		cert, err := tls.X509KeyPair(pair.CertPEM, pair.KeyPEM)
		if err != nil {
			t.Fatal(err)
		}
		// Presented whatever CAs the server names: a Go client's
		// Certificates are sent only to a server that trusts their issuer.
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
	}
	return cfg
}

// httpsClient is an HTTP client over cfg: HTTP/2 if h2, else HTTP/1.1.
func httpsClient(cfg *tls.Config, h2 bool) *http.Client {
	tr := &http.Transport{TLSClientConfig: cfg.Clone(), ForceAttemptHTTP2: h2}
	if !h2 {
		tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
	}
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// tlsFlags are the --tls-* flags of f.
func tlsFlags(f tlstest.Files) []string {
	return []string{"--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA}
}

// healthCheck asks addr's gRPC health service once over creds.
func healthCheck(t *testing.T, addr string, creds credentials.TransportCredentials) error {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// serverSerial is the serial of the certificate a new TLS connection to
// addr is served.
func serverSerial(t *testing.T, addr string, cfg *tls.Config) *big.Int {
	t.Helper()
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"}
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber
}

// tlsInit starts a G1 rollout over client (the gateway's port wants a
// client certificate, which the controller's own client has not) whose
// completion goes to ctl.
func tlsInit(t *testing.T, client *http.Client, base string, ctl *controller.Controller, id string) {
	t.Helper()
	body, err := json.Marshal(controller.InitRequest{
		RolloutID:        id,
		ServerURL:        ctl.URL(),
		Messages:         []map[string]any{{"role": "user", "content": "What is 6 * 7?"}},
		CompletionParams: map[string]any{"temperature": 1.0},
		Metadata:         map[string]any{"ground_truth": "42"},
	})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Post(base+"/v1/rollout/init", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("init %s: %v", id, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("init %s: %d %s", id, resp.StatusCode, b)
	}
}

// waitRewarded waits for id's completion and checks it was graded 1.
func waitRewarded(t *testing.T, ctl *controller.Controller, id string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := ctl.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != 1 {
		t.Fatalf("%s: %s", id, c.Raw)
	}
}

// TestTLSSplitDeployment runs grader, rollout and gateway as separate
// processes over mutual TLS, a rollout end to end through them; shows that
// clients with a certificate of another CA, or with none, are refused with
// a clear error; and replaces the grader's certificate on disk, which its
// next connection is served without a restart.
func TestTLSSplitDeployment(t *testing.T) {
	mockAddr := startMockPolicy(t)
	ctl := startG1Controller(t, controller.Options{PolicyURL: "http://" + mockAddr + "/v1"})

	dir := t.TempDir()
	ca := tlstest.NewCA(t, "osmo test CA")
	graderFiles := ca.Issue(t, "grader").Write(t, dir, "grader", ca)
	rolloutFiles := ca.Issue(t, "rollout").Write(t, dir, "rollout", ca)
	gatewayFiles := ca.Issue(t, "gateway").Write(t, dir, "gateway", ca)
	me := ca.Issue(t, "trainer")
	mine := clientTLS(t, ca.PEM, &me)

	grader, addrs := startListening(t, "grader", nil, append([]string{"grader", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0",
		"--grader", "calculator", "--log-level", "info"}, tlsFlags(graderFiles)...)...)
	graderAddr := addrs["grpc"]
	waitGRPCCreds(t, grader, graderAddr, 20*time.Second, credentials.NewTLS(mine))
	roll, addrs := startListening(t, "rollout", nil, append([]string{"rollout", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0",
		"--grader-addr", graderAddr, "--workflow", "calculator", "--log-level", "warn"}, tlsFlags(rolloutFiles)...)...)
	rolloutAddr := addrs["grpc"]
	waitGRPCCreds(t, roll, rolloutAddr, 20*time.Second, credentials.NewTLS(mine))
	gw, addrs := startListening(t, "gateway", nil, append([]string{"gateway", "--addr", "127.0.0.1:0", "--rollout-addr", rolloutAddr,
		"--grader-addr", graderAddr, "--log-level", "warn"}, tlsFlags(gatewayFiles)...)...)
	base := addrs["http"]
	gwAddr := strings.TrimPrefix(base, "https://")
	client := httpsClient(mine, true)
	waitHTTPClient(t, gw, client, base+"/health")

	tlsInit(t, client, base, ctl, "tls-1")
	waitRewarded(t, ctl, "tls-1")

	t.Run("refused", func(t *testing.T) {
		other := tlstest.NewCA(t, "another CA")
		stranger := other.Issue(t, "stranger")
		err := healthCheck(t, graderAddr, credentials.NewTLS(clientTLS(t, other.PEM, &stranger)))
		if err == nil || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
			t.Errorf("a client trusting another CA: %v, want the server's certificate refused (unknown authority)", err)
		}
		// It trusts the server, but the server does not trust it.
		// In TLS 1.3 the server judges the client's certificate after the
		// client has finished its half of the handshake: the client reads
		// the server's alert ("unknown certificate authority") or, when
		// its first write comes first, a closed connection. Either way it
		// is refused, and the server's log says why.
		err = healthCheck(t, graderAddr, credentials.NewTLS(clientTLS(t, append(append([]byte{}, ca.PEM...), other.PEM...), &stranger)))
		checkRefused(t, "a client certificate of another CA", err, "unknown certificate authority", grader, "certificate signed by unknown authority")
		err = healthCheck(t, graderAddr, credentials.NewTLS(clientTLS(t, ca.PEM, nil)))
		checkRefused(t, "a client without a certificate", err, "certificate required", grader, "didn't provide a certificate")
		// Plaintext to a TLS port is no answer either.
		resp, err := http.Get("http://" + gwAddr + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				t.Error("the gateway answered plaintext HTTP")
			}
		}
		eventually(5*time.Second, func() bool { return countLines(grader.Output(), "TLS handshake refused") >= 3 })
		if got := countLines(grader.Output(), "TLS handshake refused"); got < 3 {
			t.Errorf("the grader logged %d refused handshakes, want 3:\n%s", got, grader.Output())
		}
	})

	t.Run("rotation", func(t *testing.T) {
		before := serverSerial(t, graderAddr, mine)
		next := ca.Issue(t, "grader")
		if next.Serial.Cmp(before) == 0 {
			t.Fatal("the new certificate has the old serial")
		}
		next.Write(t, dir, "grader", ca)
		// The files are checked at most once a second.
		deadline := time.Now().Add(10 * time.Second)
		for serverSerial(t, graderAddr, mine).Cmp(next.Serial) != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("the grader still serves serial %v, not the new %v:\n%s", before, next.Serial, grader.Output())
			}
			time.Sleep(100 * time.Millisecond)
		}
		select {
		case <-grader.Done():
			t.Fatalf("the grader exited:\n%s", grader.Output())
		default:
		}
		// The log line is written before the handshake ends, but reaches
		// the test through a pipe that may lag.
		if !waitOutput(grader, "reloaded the TLS certificate", 5*time.Second) {
			t.Errorf("the grader logged no reload:\n%s", grader.Output())
		}
		// The deployment still works end to end.
		tlsInit(t, client, base, ctl, "tls-2")
		waitRewarded(t, ctl, "tls-2")
	})
}

// TestTLSServe runs osmo serve with mutual TLS on its HTTP port, with a
// certificate for a name that is not the loopback address its own
// connections use: REST over HTTP/2 and HTTP/1.1 works, and so does the
// watch, which the gateway of osmo serve makes over a loopback gRPC
// connection to its rollout service.
func TestTLSServe(t *testing.T) {
	mockAddr := startMockPolicy(t)
	ctl := startG1Controller(t, controller.Options{PolicyURL: "http://" + mockAddr + "/v1"})
	ca := tlstest.NewCA(t, "osmo test CA")
	files := ca.Issue(t, "osmo", "osmo.example").Write(t, t.TempDir(), "osmo", ca)
	me := ca.Issue(t, "trainer")
	mine := clientTLS(t, ca.PEM, &me)
	mine.ServerName = "osmo.example"

	srv, addrs := startListening(t, "serve", nil, append([]string{"serve", "-H", "127.0.0.1", "-p", "0", "--workflow", "calculator", "--log-level", "warn"}, tlsFlags(files)...)...)
	base := addrs["http"]
	waitHTTPClient(t, srv, httpsClient(mine, true), base+"/health")

	for _, h2 := range []bool{true, false} {
		client := httpsClient(mine, h2)
		resp, err := client.Get(base + "/health")
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		want := map[bool]string{true: "HTTP/2.0", false: "HTTP/1.1"}[h2]
		if resp.StatusCode != http.StatusOK || resp.Proto != want {
			t.Errorf("GET /health: %d over %s, want 200 over %s", resp.StatusCode, resp.Proto, want)
		}
		id := fmt.Sprintf("serve-tls-%v", h2)
		tlsInit(t, client, base, ctl, id)
		waitRewarded(t, ctl, id)
	}

	// The watch replays the finished rollouts through the loopback gRPC
	// connection.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/rollouts:watch?after_sequence=0", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := httpsClient(mine, true).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if resp.StatusCode != http.StatusOK || !strings.Contains(line, "serve-tls-") {
		t.Fatalf("watch: %d %q %v\n%s", resp.StatusCode, line, err, srv.Output())
	}

	// Without a client certificate the port refuses.
	if _, err := httpsClient(clientTLS(t, ca.PEM, nil), true).Get(base + "/health"); err == nil {
		t.Error("a client without a certificate was answered")
	}
}

// checkRefused fails unless err refuses the client: with the reason the
// client reads (the server's alert), or with a closed connection when the
// server's log gives the reason it closed it for. The server may close the
// connection before its log line is out: that is waited for, up to 5 s.
func checkRefused(t *testing.T, what string, err error, clientReason string, server *proc, serverReason string) {
	t.Helper()
	switch {
	case err == nil:
		t.Errorf("%s: accepted, want it refused", what)
	case strings.Contains(err.Error(), clientReason):
	case status.Code(err) == codes.Unavailable && waitOutput(server, serverReason, 5*time.Second):
	default:
		t.Errorf("%s: %v, want it refused (%s), and the server's log to say %q", what, err, clientReason, serverReason)
	}
}

// waitOutput reports whether p's output holds s within timeout: a process's
// output reaches the test through a pipe that may lag what it did.
func waitOutput(p *proc, s string, timeout time.Duration) bool {
	return eventually(timeout, func() bool { return strings.Contains(p.Output(), s) })
}

// eventually reports whether cond holds within timeout, polling it.
func eventually(timeout time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(timeout); ; time.Sleep(20 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}
