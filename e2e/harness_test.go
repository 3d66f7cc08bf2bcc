//go:build unix

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/osmo-rl/osmo/internal/controller"
)

// TestDNSResponder: the test DNS server answers its names' A records over
// UDP and TCP, NXDOMAIN for other names, and no records of other types.
func TestDNSResponder(t *testing.T) {
	d := startDNS(t, map[string][]string{"osmo-rollout.test": {"127.0.0.2", "127.0.0.3", "127.0.0.4"}})
	for _, network := range []string{"udp", "tcp"} {
		t.Run(network, func(t *testing.T) {
			r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var dialer net.Dialer
				return dialer.DialContext(ctx, network, d.addr)
			}}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			before := d.Queries()
			got, err := r.LookupHost(ctx, "OSMO-rollout.test")
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(got)
			if want := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}; !slices.Equal(got, want) {
				t.Errorf("LookupHost = %v, want %v", got, want)
			}
			if d.Queries() == before {
				t.Error("the lookup did not reach the server")
			}
			if ips, err := r.LookupIP(ctx, "ip6", "osmo-rollout.test"); err == nil || len(ips) != 0 {
				t.Errorf("AAAA lookup = %v, %v; want no addresses", ips, err)
			}
			var dnsErr *net.DNSError
			if _, err := r.LookupHost(ctx, "other.test"); !errors.As(err, &dnsErr) || !dnsErr.IsNotFound {
				t.Errorf("unknown name: %v, want not found", err)
			}
		})
	}
}

// TestNATSClusterHarness: startNATSCluster brings up a JetStream cluster
// that replicates (an R3 stream takes 8MB-class messages and keeps taking
// writes with a server down), and a server killed and restarted on its
// store catches up; a lone server keeps its stream across a SIGKILL.
func TestNATSClusterHarness(t *testing.T) {
	t.Run("three", func(t *testing.T) {
		c := startNATSCluster(t, 3)
		js := natsJS(t, c.URL())
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		createStream(ctx, t, js, jetstream.StreamConfig{Name: "HARNESS", Subjects: []string{"harness.>"}, Replicas: 3, Storage: jetstream.FileStorage})
		publish(ctx, t, js, 5)
		big := make([]byte, 7<<20)
		if _, err := js.Publish(ctx, "harness.big", big); err != nil {
			t.Fatalf("a 7 MiB message: %v", err)
		}
		c.Kill(1)
		publish(ctx, t, js, 5) // two of three keep a quorum
		c.Restart(1)
		// The restarted server holds all 11 messages of its replica.
		waitFor(t, "nats-1 to catch up", func() bool { return jszMessages(t, c.nodes[1].monitor) == 11 })
		info, err := js.Stream(ctx, "HARNESS")
		if err != nil {
			t.Fatal(err)
		}
		si, err := info.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if si.State.Msgs != 11 || si.Cluster == nil || len(si.Cluster.Replicas) != 2 {
			t.Fatalf("stream after the restart: %d messages, cluster %+v", si.State.Msgs, si.Cluster)
		}
	})
	t.Run("one", func(t *testing.T) {
		c := startNATSCluster(t, 1)
		js := natsJS(t, c.URL())
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "LONE", Subjects: []string{"harness.>"}, Storage: jetstream.FileStorage}); err != nil {
			t.Fatal(err)
		}
		publish(ctx, t, js, 5)
		c.Kill(0)
		c.Restart(0)
		waitFor(t, "the lone server to recover its stream", func() bool { return jszMessages(t, c.nodes[0].monitor) == 5 })
	})
}

// natsJS connects to url (reconnecting forever) until the test ends.
func natsJS(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond), nats.Timeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		t.Fatalf("JetStream account info: %v", err)
	}
	return js
}

// publish stores n messages, each retried until acknowledged: a stream's
// leader may be moving.
// createStream creates (or finds) a stream, asking again while a new
// cluster settles: a JetStream API reply can be lost while the servers'
// routes are still being made (a duplicate route is closed with what was
// in flight on it), and a request whose reply is lost waits out its
// context. CreateOrUpdateStream makes asking twice harmless.
func createStream(ctx context.Context, t *testing.T, js jetstream.JetStream, cfg jetstream.StreamConfig) {
	t.Helper()
	for {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := js.CreateOrUpdateStream(actx, cfg)
		cancel()
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("stream %s: %v", cfg.Name, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func publish(ctx context.Context, t *testing.T, js jetstream.JetStream, n int) {
	t.Helper()
	for i := range n {
		for {
			pctx, cancel := context.WithTimeout(ctx, time.Second)
			_, err := js.Publish(pctx, "harness.msg", []byte(strconv.Itoa(i)))
			cancel()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("publish %d: %v", i, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// jszMessages is the count of messages a server holds in its JetStream
// (its own replicas), from its monitoring /jsz; -1 when it does not answer.
func jszMessages(t *testing.T, monitor string) int {
	t.Helper()
	resp, err := httpClient.Get("http://" + monitor + "/jsz")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	var jsz struct {
		Messages int `json:"messages"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&jsz); err != nil {
		return -1
	}
	return jsz.Messages
}

// TestGatewayBalancesOverDNS: a gateway given dns://DNS/NAME:PORT as its
// rollout address spreads rollouts over every replica NAME resolves to,
// each on its own loopback address and the same port.
func TestGatewayBalancesOverDNS(t *testing.T) {
	ips := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	grpcPort, metricsPort := sharedPort(t, ips...), sharedPort(t, ips...)
	d := startDNS(t, map[string][]string{"osmo-rollout.test": ips})
	mockAddr := startMockPolicy(t)
	ctl := startController(t, controller.G2Options{PolicyURL: "http://" + mockAddr + "/v1", APIKey: controllerKey, Logger: quietLog()})
	for i, ip := range ips {
		p := start(t, fmt.Sprintf("rollout-%d", i), nil, "rollout", "--grpc-addr", ip+":"+grpcPort, "--metrics-addr", ip+":"+metricsPort,
			"--grader", "none", "--workflow", "calculator", "--log-level", "warn")
		waitGRPC(t, p, ip+":"+grpcPort)
	}
	gw, addrs := startListening(t, "gateway", nil, "gateway", "--addr", "127.0.0.1:0", "--rollout-addr", "dns://"+d.addr+"/osmo-rollout.test:"+grpcPort, "--log-level", "warn")
	gwAddr := strings.TrimPrefix(addrs["http"], "http://")
	waitHTTP(t, gw, "http://"+gwAddr+"/health")

	const n = 30
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("dns-%02d", i)
		body := ctl.StartBody(ids[i], []map[string]any{{"role": "user", "content": "What is 6 * 7?"}})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		code, _, data, err := ctl.Start(ctx, "http://"+gwAddr, "", body)
		cancel()
		if err != nil || code != 202 {
			t.Fatalf("start %s: %d %s %v", ids[i], code, data, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, id := range ids {
		if c, err := ctl.WaitCompletion(ctx, id); err != nil || c.Status != "success" {
			t.Fatalf("%s: %+v %v", id, c, err)
		}
	}
	started := regexp.MustCompile(`(?m)^osmo_rollouts_started_total (\d+)$`)
	total := 0
	for _, ip := range ips {
		m := started.FindStringSubmatch(httpGet(t, "http://"+ip+":"+metricsPort+"/metrics"))
		if m == nil {
			t.Fatalf("%s: no osmo_rollouts_started_total", ip)
		}
		got, _ := strconv.Atoi(m[1])
		if got == 0 {
			t.Errorf("replica %s started no rollout: the gateway did not balance over the DNS name", ip)
		}
		total += got
	}
	if total != n {
		t.Errorf("the replicas started %d rollouts in all, want %d", total, n)
	}
	if d.Queries() == 0 {
		t.Error("the gateway never queried the DNS server")
	}
	t.Logf("%d DNS queries", d.Queries())
}

// httpClient bounds the harness's own HTTP polls.
var httpClient = &http.Client{Timeout: 5 * time.Second}
