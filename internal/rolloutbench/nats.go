package rolloutbench

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/osmo-rl/osmo/internal/benchproc"
)

// FindNATS finds a nats-server binary: envBin ($OSMO_NATS_BIN) if set,
// else the one scripts/nats.sh builds (or has cached), the script found
// in the working directory, the executable's, or one of their parents (a
// checkout of this repository). The error says why there is none.
func FindNATS(ctx context.Context, envBin string) (string, error) {
	if envBin != "" {
		if _, err := os.Stat(envBin); err != nil {
			return "", fmt.Errorf("OSMO_NATS_BIN: %w", err)
		}
		return envBin, nil
	}
	script := findUp(filepath.Join("scripts", "nats.sh"))
	if script == "" {
		return "", errors.New("OSMO_NATS_BIN is not set and no scripts/nats.sh is found from the working directory or the executable's")
	}
	// A first build fetches and compiles nats-server; later runs find it
	// cached.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "bash", script).Output()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			err = fmt.Errorf("%w: %s", err, exit.Stderr[max(len(exit.Stderr)-2000, 0):])
		}
		return "", fmt.Errorf("%s: %w", script, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	bin := lines[len(lines)-1]
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("%s printed %q: %w", script, bin, err)
	}
	return bin, nil
}

// findUp is rel under the working directory, the executable's directory,
// or the nearest of their parents that has it; "" if none has.
func findUp(rel string) string {
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	for _, dir := range starts {
		for {
			p := filepath.Join(dir, rel)
			if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
				return p
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	return ""
}

// natsConfig is what nats-server takes only from a file: the largest
// message, as large as osmo's embedded server allows (a finished record
// carries every sample's messages).
const natsConfig = "max_payload: 8MB\n"

// natsCluster is three nats-server processes with JetStream on loopback,
// their stores under dir, routed to each other as one cluster.
type natsCluster struct {
	nodes []*benchproc.Proc
	urls  []string
}

// startNATS starts the cluster and returns once every node reports
// JetStream healthy (in contact with the meta leader). Its caller stops
// the nodes (stop), also on error.
func startNATS(ctx context.Context, bin, dir string) (*natsCluster, error) {
	const n = 3
	conf := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(conf, []byte(natsConfig), 0o644); err != nil {
		return nil, err
	}
	// Client, route and monitoring listeners of each node.
	addrs, err := benchproc.FreeAddrs("127.0.0.1", 3*n)
	if err != nil {
		return nil, err
	}
	clients, routes, monitors := addrs[:n], addrs[n:2*n], addrs[2*n:]
	c := &natsCluster{}
	for i := range n {
		var others []string
		for j, r := range routes {
			if j != i {
				others = append(others, "nats://"+r)
			}
		}
		name := fmt.Sprintf("nats-%d", i)
		cmd := exec.Command(bin, "-c", conf, "-a", "127.0.0.1", "-p", portOf(clients[i]), "-m", portOf(monitors[i]),
			"-js", "-sd", filepath.Join(dir, name), "-n", name,
			"--cluster_name", "osmo-bench", "--cluster", "nats://"+routes[i], "--routes", strings.Join(others, ","))
		p, err := benchproc.Start(name, cmd, (*exec.Cmd).Start)
		if err != nil {
			return c, err
		}
		c.nodes = append(c.nodes, p)
		c.urls = append(c.urls, "nats://"+clients[i])
	}
	// /healthz answers 200 once JetStream is up and, in a cluster, current
	// with the meta leader.
	for i, p := range c.nodes {
		if err := p.WaitHTTP(ctx, "http://"+monitors[i]+"/healthz", http.StatusOK); err != nil {
			return c, err
		}
	}
	return c, nil
}

// url is every client URL, comma-separated: the value of --nats.
func (c *natsCluster) url() string { return strings.Join(c.urls, ",") }

// stop stops the nodes started, if any.
func (c *natsCluster) stop() {
	if c != nil {
		benchproc.StopAll(c.nodes, 10*time.Second)
	}
}
