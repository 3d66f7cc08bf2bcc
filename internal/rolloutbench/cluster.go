package rolloutbench

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/osmo-rl/osmo/internal/benchproc"
)

// Cluster says how to run the cluster: three `osmo rollout` replicas over
// a three-node NATS cluster, grading through one `osmo grader`, behind one
// `osmo gateway` that finds the replicas through DNS.
type Cluster struct {
	// Rollout, Grader and Gateway build the commands that run `osmo
	// rollout ARGS`, `osmo grader ARGS` and `osmo gateway ARGS`.
	Rollout, Grader, Gateway func(args []string) *exec.Cmd
	// NATS is the nats-server binary.
	NATS string
}

// replicaIPs are the rollout replicas' addresses: loopback, one each, so
// that they share one port as the pods of a Service do.
var replicaIPs = []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}

// replicaName is the DNS name of the replicas.
const replicaName = "osmo-rollout.bench"

// measureCluster starts the cluster, times cfg.Rollouts through the
// gateway as measureServe does through `osmo serve`, and stops every
// process it started, whatever happens.
func measureCluster(ctx context.Context, h *harness, cfg Config) (*Timed, error) {
	cl := cfg.Cluster
	dir, err := os.MkdirTemp("", "osmo-bench-nats-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	nc, err := startNATS(ctx, cl.NATS, dir)
	// The NATS nodes stop last: the replicas write to them until they
	// end.
	defer nc.stop()
	if err != nil {
		return nil, err
	}
	var procs []*benchproc.Proc
	defer func() { benchproc.StopAll(procs, 15*time.Second) }()
	start := func(name string, build func([]string) *exec.Cmd, args ...string) (*benchproc.Proc, error) {
		p, err := benchproc.Start(name, build(args), (*exec.Cmd).Start)
		if err == nil {
			procs = append(procs, p)
		}
		return p, err
	}

	graderAddr, err := benchproc.FreeAddr()
	if err != nil {
		return nil, err
	}
	grader, err := start("osmo grader", cl.Grader, "--grpc-addr", graderAddr, "--metrics-addr", "", "--nats", nc.url(), "--log-level", "warn")
	if err != nil {
		return nil, err
	}
	if err := waitGRPC(ctx, grader, graderAddr); err != nil {
		return nil, err
	}

	port, err := sharedPort(replicaIPs...)
	if err != nil {
		return nil, err
	}
	limit := strconv.Itoa(cfg.limit())
	var metrics []string
	for i, ip := range replicaIPs {
		// Not the replicas' port, which nothing holds until they start.
		var metricsAddr string
		for metricsAddr == "" || portOf(metricsAddr) == port {
			addrs, err := benchproc.FreeAddrs(ip, 1)
			if err != nil {
				return nil, err
			}
			metricsAddr = addrs[0]
		}
		name := fmt.Sprintf("rollout-%d", i)
		p, err := start("osmo rollout "+name, cl.Rollout, "--grpc-addr", ip+":"+port, "--metrics-addr", metricsAddr,
			"--nats", nc.url(), "--grader-addr", graderAddr, "--workflow", cmp.Or(cfg.Workflow, "multiply"),
			"--max-concurrent", strconv.Itoa(cfg.slots()), "--max-queued", limit, "--replica-name", name, "--drain-timeout", "2s", "--log-level", "warn")
		if err != nil {
			return nil, err
		}
		if err := waitGRPC(ctx, p, ip+":"+port); err != nil {
			return nil, err
		}
		metrics = append(metrics, "http://"+metricsAddr)
	}

	dns, err := startDNS(replicaName, replicaIPs)
	if err != nil {
		return nil, err
	}
	defer dns.close()
	gatewayAddr, err := benchproc.FreeAddr()
	if err != nil {
		return nil, err
	}
	gateway, err := start("osmo gateway", cl.Gateway, "--addr", gatewayAddr,
		"--rollout-addr", "dns://"+dns.addr+"/"+replicaName+":"+port, "--log-level", "warn")
	if err != nil {
		return nil, err
	}
	base := "http://" + gatewayAddr
	if err := gateway.WaitHTTP(ctx, base+"/health", http.StatusOK); err != nil {
		return nil, err
	}

	// The embedded server's timed run follows the held rollouts; this one
	// follows a warm-up of its own, not timed: the gateway's connections
	// to every replica made, the streams' and buckets' first writes done.
	b := h.bench(base)
	if _, err := b.timed(ctx, "cluster-warm", cfg.Concurrency, cfg.Concurrency); err != nil {
		return nil, withOutput(err, procs)
	}
	before, err := settledState(ctx, metrics)
	if err != nil {
		return nil, err
	}
	run, err := b.timed(ctx, "cluster", cfg.Rollouts, cfg.Concurrency)
	if err != nil {
		return nil, withOutput(err, procs)
	}
	after, err := settledState(ctx, metrics)
	if err != nil {
		return nil, err
	}
	run.StateWrites, run.StateBytes = after.writes-before.writes, after.bytes-before.bytes
	return &run, nil
}

// withOutput is err with the output of each process, which says why a
// rollout did not end.
func withOutput(err error, procs []*benchproc.Proc) error {
	var b strings.Builder
	for _, p := range procs {
		fmt.Fprintf(&b, "\n--- %s:\n%s", p.Name, p.Output())
	}
	return fmt.Errorf("%w%s", err, b.String())
}
