//go:build unix

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// natsBin is the nats-server binary: $OSMO_NATS_BIN (the test script builds
// it first), else built here by scripts/nats.sh from the module proxy and
// cached under ~/.cache/osmo.
func natsBin(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv("OSMO_NATS_BIN"); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("OSMO_NATS_BIN: %v", err)
		}
		return bin
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", filepath.Join("..", "scripts", "nats.sh"))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("scripts/nats.sh: %v\n%s", err, out.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	return lines[len(lines)-1]
}

// natsConfig is what nats-server takes only from a file: the largest
// message, as large as osmo's embedded server allows (a finished record
// carries every sample's messages).
const natsConfig = "max_payload: 8MB\n"

// natsCluster is n nats-server processes with JetStream on loopback, routed
// to each other as one cluster (a lone server when n is 1).
type natsCluster struct {
	t     *testing.T
	bin   string
	nodes []*natsNode
}

// natsNode is one server of a natsCluster. Its ports and store directory
// stay the same across restarts.
type natsNode struct {
	name    string
	client  string // host:port of the client listener
	monitor string // host:port of the monitoring listener
	dir     string // JetStream store directory
	args    []string
	proc    *proc
}

// startNATSCluster starts n JetStream servers and returns once every one
// reports JetStream healthy (in a cluster: in contact with the meta
// leader).
func startNATSCluster(t *testing.T, n int) *natsCluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("startNATSCluster: n = %d", n)
	}
	c := &natsCluster{t: t, bin: natsBin(t)}
	conf := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, []byte(natsConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	routes := make([]string, n)
	for i := range n {
		routes[i] = freeAddr(t)
	}
	for i := range n {
		nd := &natsNode{name: fmt.Sprintf("nats-%d", i), client: freeAddr(t), monitor: freeAddr(t), dir: t.TempDir()}
		nd.args = []string{"-c", conf, "-a", "127.0.0.1", "-p", portOf(nd.client), "-m", portOf(nd.monitor),
			"-js", "-sd", nd.dir, "-n", nd.name}
		if n > 1 {
			var others []string
			for j, r := range routes {
				if j != i {
					others = append(others, "nats://"+r)
				}
			}
			nd.args = append(nd.args, "--cluster_name", "osmo-e2e", "--cluster", "nats://"+routes[i],
				"--routes", strings.Join(others, ","))
		}
		c.nodes = append(c.nodes, nd)
	}
	for _, nd := range c.nodes {
		nd.proc = startBin(t, nd.name, c.bin, nil, nd.args...)
	}
	for i := range c.nodes {
		c.waitHealthy(i)
	}
	return c
}

// portOf is the port of a host:port.
func portOf(addr string) string { return addr[strings.LastIndexByte(addr, ':')+1:] }

// URLs are the client URLs of the servers.
func (c *natsCluster) URLs() []string {
	urls := make([]string, len(c.nodes))
	for i, nd := range c.nodes {
		urls[i] = "nats://" + nd.client
	}
	return urls
}

// URL is every client URL, comma-separated: the value of --nats.
func (c *natsCluster) URL() string { return strings.Join(c.URLs(), ",") }

// Kill SIGKILLs server i and waits for it to exit.
func (c *natsCluster) Kill(i int) {
	c.t.Helper()
	c.nodes[i].proc.Stop(syscall.SIGKILL, 5*time.Second)
}

// Restart starts server i again on its ports and store directory (after
// Kill) and waits until its JetStream is healthy: recovered from its files
// and, in a cluster, current with the meta leader and its streams.
func (c *natsCluster) Restart(i int) {
	c.t.Helper()
	nd := c.nodes[i]
	if !nd.proc.Exited() {
		c.t.Fatalf("%s: Restart while it runs", nd.name)
	}
	nd.proc = startBin(c.t, nd.name, c.bin, nil, nd.args...)
	c.waitHealthy(i)
}

// waitHealthy polls server i's /healthz until it answers 200: JetStream
// enabled and, in a cluster, in contact with the meta leader and current
// with it and with every stream and consumer the server holds.
func (c *natsCluster) waitHealthy(i int) {
	c.t.Helper()
	nd := c.nodes[i]
	url := "http://" + nd.monitor + "/healthz"
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		if nd.proc.Exited() {
			c.t.Fatalf("%s exited early:\n%s", nd.name, nd.proc.Output())
		}
		resp, err := http.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, bytes.TrimSpace(b))
		} else {
			last = err.Error()
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.t.Fatalf("%s: JetStream not healthy in 30s (last /healthz: %s):\n%s", nd.name, last, tail(nd.proc.Output(), 4000))
}
