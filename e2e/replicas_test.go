//go:build unix

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/natsstore"
)

// The replica tests run two `osmo rollout` replicas on one NATS server,
// each on a loopback address of its own behind a gateway that balances
// over both through DNS, and check what one replica does for a rollout
// another one holds: hand its queue back when it drains, cancel a rollout
// the other runs, and keep a rollout's spans in one trace wherever its
// callbacks are retried.

// replica is one `osmo rollout` process of a replicaCluster.
type replica struct {
	name    string // its --replica-name
	addr    string // gRPC host:port
	metrics string // base URL of its /metrics
	proc    *proc
	client  rolloutv1.RolloutServiceClient
}

// replicaCluster is a grader and rollout replicas sharing one NATS server,
// and a gateway in front of them.
type replicaCluster struct {
	nats     *natsCluster
	replicas []*replica
	gateway  string // base URL
}

// replicaOptions configure startReplicas.
type replicaOptions struct {
	// n is how many rollout replicas run (on 127.0.0.2 and up).
	n int
	// env is the environment of a service ("grader", "gateway", or the
	// replica's name), added to the test's.
	env func(service string) []string
	// args are added to every replica's flags.
	args []string
}

// startReplicas starts the cluster: replica i is named rollout-a,
// rollout-b, ... and listens on 127.0.0.(2+i), its gRPC and metrics on
// ports shared by all.
func startReplicas(t *testing.T, o replicaOptions) *replicaCluster {
	t.Helper()
	env := func(service string) []string {
		if o.env == nil {
			return nil
		}
		return o.env(service)
	}
	c := &replicaCluster{nats: startNATSCluster(t, 1)}
	var ips []string
	for i := range o.n {
		ips = append(ips, fmt.Sprintf("127.0.0.%d", 2+i))
	}
	grpcPort, metricsPort := sharedPort(t, ips...), sharedPort(t, ips...)
	dns := startDNS(t, map[string][]string{"osmo-rollout.test": ips})

	gr, addrs := startListening(t, "grader", env("grader"), "grader", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "",
		"--grader", "calculator", "--nats", c.nats.URL(), "--log-level", "warn")
	graderAddr := addrs["grpc"]
	waitGRPC(t, gr, graderAddr)
	for i, ip := range ips {
		r := &replica{name: "rollout-" + string(rune('a'+i)), addr: ip + ":" + grpcPort, metrics: "http://" + ip + ":" + metricsPort + "/metrics"}
		args := append([]string{"rollout", "--grpc-addr", r.addr, "--metrics-addr", ip + ":" + metricsPort,
			"--grader-addr", graderAddr, "--workflow", "calculator", "--replica-name", r.name,
			"--nats", c.nats.URL(), "--lost-after", "3s", "--log-level", "info"}, o.args...)
		r.proc = start(t, r.name, env(r.name), args...)
		waitGRPC(t, r.proc, r.addr)
		conn, err := grpc.NewClient(r.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		r.client = rolloutv1.NewRolloutServiceClient(conn)
		c.replicas = append(c.replicas, r)
	}
	gw, addrs := startListening(t, "gateway", env("gateway"), "gateway", "--addr", "127.0.0.1:0", "--rollout-addr", "dns://"+dns.addr+"/osmo-rollout.test:"+grpcPort,
		"--grader-addr", graderAddr, "--log-level", "warn")
	c.gateway = addrs["http"]
	waitHTTP(t, gw, c.gateway+"/health")
	return c
}

// gauge reads a metric without labels from the replica's /metrics; -1 when
// it cannot be read.
func (r *replica) gauge(name string) float64 {
	resp, err := httpClient.Get(r.metrics)
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return -1
			}
			return f
		}
	}
	return -1
}

// finishedBy is, per rollout id, the statuses of the "rollout finished"
// lines in a replica's log: what the replica concluded.
func finishedBy(output string) map[string][]string {
	out := map[string][]string{}
	for _, line := range strings.Split(output, "\n") {
		if !strings.Contains(line, `"msg":"rollout finished"`) {
			continue
		}
		var rec struct {
			RolloutID string `json:"rollout_id"`
			Status    string `json:"status"`
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.RolloutID != "" {
			out[rec.RolloutID] = append(out[rec.RolloutID], rec.Status)
		}
	}
	return out
}

// holders reads, from the shared state, which replica holds each of ids
// and in what phase: "" for one that no replica holds.
func holders(t *testing.T, natsURL string, ids []string) map[string]string {
	t.Helper()
	js := natsJS(t, natsURL)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, "osmo_rollouts")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, id := range ids {
		e, err := kv.Get(ctx, natsstore.Key(id))
		if err != nil {
			t.Fatalf("lifecycle of %s: %v", id, err)
		}
		var lc struct {
			Owner string `json:"owner"`
			Phase string `json:"phase"`
		}
		if err := json.Unmarshal(e.Value(), &lc); err != nil {
			t.Fatalf("lifecycle of %s: %v", id, err)
		}
		out[id] = lc.Owner + " " + lc.Phase
	}
	return out
}

// g2Runs counts, per rollout id, the runs whose LLM calls reached the
// trainer (a run of the calculator workflow opens with the one call whose
// history has no assistant turn), and the sample ids its calls bore.
func g2Runs(ctl *controller.G2) (runs map[string]int, samples map[string][]string) {
	runs, samples = map[string]int{}, map[string][]string{}
	for _, c := range ctl.Chats() {
		id := c.Header.Get("X-Rollout-Id")
		if opening(c.Body) {
			runs[id]++
		}
		if s := c.Header.Get("X-Sample-Id"); !slices.Contains(samples[id], s) {
			samples[id] = append(samples[id], s)
		}
	}
	return runs, samples
}

// TestReplicaDrainHandsBackWork: of two replicas each running two rollouts
// with more queued, one is sent SIGTERM. It takes no new work: the two it
// runs finish and are reported (success, each callback once), it exits 0
// within its drain time, and every rollout still queued runs on the other
// replica and succeeds; each rollout ran once, reported once.
func TestReplicaDrainHandsBackWork(t *testing.T) {
	if testing.Short() {
		t.Skip("drains a replica while a dozen rollouts run")
	}
	policy := "http://" + startMockPolicy(t, "--latency", "1500ms") + "/v1"
	ctl := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})
	const drainTimeout = 20 * time.Second
	c := startReplicas(t, replicaOptions{n: 2, args: []string{"--max-concurrent", "2", "--max-queued", "50",
		"--drain-timeout", drainTimeout.String()}})
	a, b := c.replicas[0], c.replicas[1]

	const n = 12
	d := &clusterDriver{g2: ctl}
	items := make([]*clusterItem, n)
	ids := make([]string, n)
	for i := range items {
		it := newClusterItem(i)
		it.id, it.wire = fmt.Sprintf("drain-%02d", i), wireG2
		items[i], ids[i] = it, it.id
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		code, _, data, err := ctl.Start(ctx, c.gateway, "", d.g2Body(it))
		cancel()
		if err != nil || code != http.StatusAccepted {
			t.Fatalf("start %s: %d %s %v", it.id, code, data, err)
		}
	}
	// A runs two (its LLM calls take 1.5s each, a rollout two of them):
	// none has finished yet, the rest wait in the queue.
	waitFor(t, "replica A to run two rollouts", func() bool { return a.gauge("osmo_rollouts_running") == 2 })
	held := holders(t, c.nats.URL(), ids)
	var onA []string
	for id, h := range held {
		if strings.HasPrefix(h, a.name+"-") {
			onA = append(onA, id)
			if !strings.HasSuffix(h, " running") {
				t.Fatalf("%s is held by A as %q, want running", id, h)
			}
		}
	}
	slices.Sort(onA)
	if len(onA) != 2 {
		t.Fatalf("replica A runs %d rollouts by the shared state, want 2: %v", len(onA), held)
	}
	if done := finishedBy(a.proc.Output()); len(done) != 0 {
		t.Fatalf("replica A finished rollouts before the SIGTERM (the policy's latency is too short for this test): %v", done)
	}
	t.Logf("replica A runs %v; SIGTERM", onA)

	sent := time.Now()
	a.proc.Stop(syscall.SIGTERM, drainTimeout+10*time.Second)
	took := time.Since(sent)
	if code := a.proc.ExitCode(); code != 0 {
		t.Errorf("replica A exited %d after SIGTERM, want 0", code)
	}
	if took >= drainTimeout {
		t.Errorf("replica A took %v to exit, more than its drain timeout (%v)", took, drainTimeout)
	}
	if strings.Contains(a.proc.Output(), "drain timeout") {
		t.Errorf("replica A's drain timed out; its log:\n%s", tail(a.proc.Output(), 4000))
	}
	t.Logf("replica A exited in %v", took.Round(time.Millisecond))
	// A's two rollouts were reported before it exited.
	for _, id := range onA {
		if len(ctl.Completions(id)) == 0 || len(ctl.GraderCallbacks(id)) == 0 {
			t.Errorf("%s, running on A at the SIGTERM, was not reported before A exited: %d completions, %d grader callbacks",
				id, len(ctl.Completions(id)), len(ctl.GraderCallbacks(id)))
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for _, id := range ids {
		if _, err := ctl.WaitGrader(ctx, id); err != nil {
			t.Fatalf("%s: %v\n%s", id, err, tail(b.proc.Output(), 4000))
		}
	}
	time.Sleep(time.Second) // a duplicate would have come by now

	// Who concluded what: A exactly the two it ran, B all the others.
	byA, byB := finishedBy(a.proc.Output()), finishedBy(b.proc.Output())
	var gotA []string
	for id := range byA {
		gotA = append(gotA, id)
	}
	slices.Sort(gotA)
	if !slices.Equal(gotA, onA) {
		t.Errorf("replica A concluded %v, want just the two it ran at the SIGTERM, %v", gotA, onA)
	}
	runs, samples := g2Runs(ctl)
	for _, it := range items {
		want, by := byB, "B"
		if slices.Contains(onA, it.id) {
			want, by = byA, "A"
		}
		if st := want[it.id]; len(st) != 1 || st[0] != "success" || len(byA[it.id])+len(byB[it.id]) != 1 {
			t.Errorf("%s: concluded by A %v and by B %v, want once with success by %s", it.id, byA[it.id], byB[it.id], by)
		}
		cs, gs := ctl.Completions(it.id), ctl.GraderCallbacks(it.id)
		if len(cs) != 1 || len(gs) != 1 {
			t.Errorf("%s: %d completions and %d grader callbacks, want exactly one each", it.id, len(cs), len(gs))
			continue
		}
		if cs[0].Status != "success" || gs[0].Status != "success" || len(gs[0].Samples) == 0 {
			t.Errorf("%s: completion %s, grader callback %s; want both success", it.id, cs[0].Raw, gs[0].Raw)
		}
		for sid, s := range gs[0].Samples {
			if s.Reward == nil || *s.Reward != it.reward {
				t.Errorf("%s: sample %s reward %v, want %v", it.id, sid, s.Reward, it.reward)
			}
		}
		if runs[it.id] != 1 || len(samples[it.id]) != 1 {
			t.Errorf("%s: %d runs reached the policy, their calls bore samples %v; want one run", it.id, runs[it.id], samples[it.id])
		}
	}
	if len(runs) != n {
		t.Errorf("LLM calls came for %d rollout ids, want %d: %v", len(runs), n, runs)
	}
}

// TestCancelReachesTheRunningReplica: each of two replicas (one slot each)
// runs a rollout held in its LLM call. Asked of the replica that does not
// run it, a rollout's status says running, and its cancel answers
// cancelled_running and reaches the replica running it: its in-flight LLM
// call is aborted (the trainer's relay sees its client go away) and it
// ends at once with one cancelled completion. A queued rollout cancelled
// through either replica or the gateway never starts and gets one
// cancelled completion.
func TestCancelReachesTheRunningReplica(t *testing.T) {
	const latency = 30 * time.Second
	policy := "http://" + startMockPolicy(t, "--latency", latency.String()) + "/v1"
	ctl := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})
	c := startReplicas(t, replicaOptions{n: 2, args: []string{"--max-concurrent", "1", "--max-queued", "10"}})

	d := &clusterDriver{g2: ctl}
	post := func(id string, i int) {
		t.Helper()
		it := newClusterItem(i)
		it.id = id
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if code, _, data, err := ctl.Start(ctx, c.gateway, "", d.g2Body(it)); err != nil || code != http.StatusAccepted {
			t.Fatalf("start %s: %d %s %v", id, code, data, err)
		}
	}
	calls := func(id string) int {
		n := 0
		for _, ch := range ctl.Chats() {
			if ch.Header.Get("X-Rollout-Id") == id {
				n++
			}
		}
		return n
	}
	running := func() []float64 {
		var out []float64
		for _, r := range c.replicas {
			out = append(out, r.gauge("osmo_rollouts_running"))
		}
		return out
	}
	// Which replica runs which: the first rollout on whichever took it,
	// the second on the other (each has one slot).
	runner := map[string]*replica{}
	for i, id := range []string{"held-0", "held-1"} {
		post(id, i)
		waitFor(t, id+"'s LLM call", func() bool { return calls(id) == 1 })
		var on []*replica
		for _, r := range c.replicas {
			if r.gauge("osmo_rollouts_running") == 1 {
				on = append(on, r)
			}
		}
		if len(on) != i+1 {
			t.Fatalf("after %s started, replicas run %v rollouts, want %d running one each", id, running(), i+1)
		}
	next:
		for _, r := range on {
			for _, taken := range runner {
				if taken == r {
					continue next
				}
			}
			runner[id] = r
		}
	}
	other := func(id string) *replica {
		for _, r := range c.replicas {
			if r != runner[id] {
				return r
			}
		}
		return nil
	}
	t.Logf("held-0 runs on %s, held-1 on %s", runner["held-0"].name, runner["held-1"].name)
	if h := holders(t, c.nats.URL(), []string{"held-0", "held-1"}); !strings.HasPrefix(h["held-0"], runner["held-0"].name+"-") ||
		!strings.HasPrefix(h["held-1"], runner["held-1"].name+"-") {
		t.Fatalf("the shared state says %v", h)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	status := func(r *replica, id string) string {
		t.Helper()
		st, err := r.client.GetRolloutStatus(ctx, &rolloutv1.GetRolloutStatusRequest{RolloutId: id})
		if err != nil {
			t.Fatalf("status of %s from %s: %v", id, r.name, err)
		}
		return st.GetStatus()
	}
	cancelOn := func(r *replica, id string) string {
		t.Helper()
		resp, err := r.client.CancelRollouts(ctx, &rolloutv1.CancelRolloutsRequest{Ids: []string{id}})
		if err != nil {
			t.Fatalf("cancel %s through %s: %v", id, r.name, err)
		}
		return resp.GetDispositions()[id]
	}
	for _, id := range []string{"held-0", "held-1"} {
		for _, r := range c.replicas {
			if got := status(r, id); got != "running" {
				t.Errorf("status of %s (running on %s) asked of %s: %q, want running", id, runner[id].name, r.name, got)
			}
		}
	}

	// Queued (both slots are taken), cancelled through a replica and
	// through the gateway: concluded at once, never run.
	post("queued-0", 2)
	post("queued-1", 3)
	for _, id := range []string{"queued-0", "queued-1"} {
		for _, r := range c.replicas {
			if got := status(r, id); got != "queued" {
				t.Errorf("status of %s asked of %s: %q, want queued", id, r.name, got)
			}
		}
	}
	if got := cancelOn(c.replicas[1], "queued-0"); got != "cancelled_queued" {
		t.Errorf("cancel of queued-0 through %s: %q, want cancelled_queued", c.replicas[1].name, got)
	}
	code, _, data, err := postJSON(ctx, c.gateway+"/rollout/cancel", map[string]any{"ids": []string{"queued-1"}})
	var answer struct {
		Dispositions map[string]string `json:"dispositions"`
	}
	if err != nil || code != http.StatusOK || json.Unmarshal(data, &answer) != nil || answer.Dispositions["queued-1"] != "cancelled_queued" {
		t.Errorf("POST /rollout/cancel of queued-1 through the gateway: %d %s %v, want cancelled_queued", code, data, err)
	}
	for _, id := range []string{"queued-0", "queued-1"} {
		if comp, err := ctl.WaitCompletion(ctx, id); err != nil || comp.Status != "cancelled" {
			t.Errorf("%s: completion %s %v, want cancelled", id, comp.Raw, err)
		}
	}

	// Each running rollout cancelled through the replica not running it.
	if n := ctl.InFlight(); n != 2 {
		t.Fatalf("%d LLM calls in flight at the trainer before the cancels, want the 2 held ones", n)
	}
	began := time.Now()
	for _, id := range []string{"held-0", "held-1"} {
		if got := cancelOn(other(id), id); got != "cancelled_running" {
			t.Errorf("cancel of %s (running on %s) through %s: %q, want cancelled_running", id, runner[id].name, other(id).name, got)
		}
	}
	for _, id := range []string{"held-0", "held-1"} {
		comp, err := ctl.WaitCompletion(ctx, id)
		if err != nil || comp.Status != "cancelled" {
			t.Errorf("%s: completion %s %v, want cancelled", id, comp.Raw, err)
		}
	}
	ended := time.Since(began)
	if ended > latency/3 {
		t.Errorf("the cancelled rollouts ended %v after the cancels, not long before their LLM calls would (%v): the calls were not aborted", ended, latency)
	}
	waitFor(t, "the held LLM calls to be aborted", func() bool { return ctl.InFlight() == 0 })
	t.Logf("cancelled rollouts reported %v after the cancels; LLM calls aborted %v after", ended.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))

	// Freed slots take nothing cancelled; everything was reported once.
	for _, id := range []string{"queued-0", "queued-1", "held-0", "held-1"} {
		if _, err := ctl.WaitGrader(ctx, id); err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}
	time.Sleep(2 * time.Second)
	for _, id := range []string{"queued-0", "queued-1", "held-0", "held-1"} {
		cs, gs := ctl.Completions(id), ctl.GraderCallbacks(id)
		if len(cs) != 1 || len(gs) != 1 {
			t.Errorf("%s: %d completions and %d grader callbacks, want exactly one each", id, len(cs), len(gs))
			continue
		}
		if cs[0].Status != "cancelled" || gs[0].Status != "failure" {
			t.Errorf("%s: completion %s, grader callback %s; want cancelled and failure", id, cs[0].Raw, gs[0].Raw)
		}
		want := 1
		if strings.HasPrefix(id, "queued-") {
			want = 0
		}
		if got := calls(id); got != want {
			t.Errorf("%s: %d LLM calls, want %d", id, got, want)
		}
		for _, r := range c.replicas {
			if got := status(r, id); got != "cancelled" {
				t.Errorf("status of %s asked of %s after it ended: %q, want cancelled", id, r.name, got)
			}
		}
	}
	if got := running(); !slices.Equal(got, []float64{0, 0}) {
		t.Errorf("replicas still run %v rollouts, want none", got)
	}
}

// jaegerRunnable reports whether the test can have a Jaeger binary:
// $OSMO_JAEGER_BIN, or scripts/jaeger.sh with bash and go to run it.
func jaegerRunnable() (bool, string) {
	if os.Getenv("OSMO_JAEGER_BIN") != "" {
		return true, ""
	}
	if _, err := os.Stat(filepath.Join("..", "scripts", "jaeger.sh")); err != nil {
		return false, "OSMO_JAEGER_BIN is unset and scripts/jaeger.sh is missing: " + err.Error()
	}
	for _, tool := range []string{"bash", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			return false, "OSMO_JAEGER_BIN is unset and scripts/jaeger.sh cannot run: " + err.Error()
		}
	}
	return true, ""
}

// traceWithInstances gets a trace and, in the same answer, each process's
// service.instance.id (Jaeger numbers the processes anew in every answer).
func (j *jaeger) traceWithInstances(ctx context.Context, traceID string) (jaegerTrace, map[string]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, j.query+"/api/traces/"+traceID, nil)
	if err != nil {
		return jaegerTrace{}, nil, err
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return jaegerTrace{}, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return jaegerTrace{}, nil, err
	}
	if resp.StatusCode == http.StatusNotFound {
		return jaegerTrace{}, nil, nil // not there yet
	}
	var traces struct {
		Data []jaegerTrace `json:"data"`
	}
	var tags struct {
		Data []struct {
			Processes map[string]struct {
				Tags []struct {
					Key   string `json:"key"`
					Value any    `json:"value"`
				} `json:"tags"`
			} `json:"processes"`
		} `json:"data"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &traces) != nil || json.Unmarshal(body, &tags) != nil || len(traces.Data) != 1 {
		return jaegerTrace{}, nil, fmt.Errorf("GET /api/traces/%s: %d %s", traceID, resp.StatusCode, tail(string(body), 2000))
	}
	inst := map[string]string{}
	for pid, p := range tags.Data[0].Processes {
		for _, tag := range p.Tags {
			if tag.Key == "service.instance.id" {
				inst[pid] = fmt.Sprint(tag.Value)
			}
		}
	}
	return traces.Data[0], inst, nil
}

// tracesTagged lists, by trace id, the spans Jaeger's tag search finds for
// rollout id in each of the services, for a failure's report.
func (j *jaeger) tracesTagged(ctx context.Context, id string) string {
	var b strings.Builder
	tags := url.QueryEscape(`{"osmo.rollout.id":"` + id + `"}`)
	for _, svc := range []string{"osmo-gateway", "osmo-rollout", "osmo-llmproxy", "osmo-grader"} {
		found, err := j.getTraces(ctx, "/api/traces?service="+svc+"&lookback=1h&limit=20&tags="+tags)
		fmt.Fprintf(&b, "\n%s: %d traces %v", svc, len(found), err)
		for _, tr := range found {
			fmt.Fprintf(&b, "\n trace %s:%s", tr.TraceID, describe(tr))
		}
	}
	return b.String()
}

// TestOneTracePerRolloutAcrossReplicas: two replicas, a gateway and a
// grader export to a real Jaeger; G2 rollouts whose first callback post
// fails are retried from the shared outbox, by whichever replica takes it,
// until one's retry came from the replica that did not run it. Each
// rollout's spans are one trace, the trainer's, whichever processes made
// them: the gateway's request span, the rollout span, invoke_agent, the
// LLM calls, the grading, and both attempts at the completion callback and
// the grader callback, all under the rollout span; Jaeger's tag search by
// osmo.rollout.id finds that trace and no other.
func TestOneTracePerRolloutAcrossReplicas(t *testing.T) {
	if ok, why := jaegerRunnable(); !ok {
		t.Skip(why)
	}
	j := startJaeger(t)
	c := startReplicas(t, replicaOptions{n: 2, args: []string{"--max-concurrent", "4"}, env: func(service string) []string {
		return []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + j.otlpHTTP, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
			"OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_TRACES_SAMPLER=parentbased_always_on",
			"OTEL_RESOURCE_ATTRIBUTES=service.instance.id=" + service}
	}})
	policy := "http://" + startMockPolicy(t) + "/v1"

	// Each try is a fresh trainer whose first two callback posts fail: the
	// completion's first attempt is the running replica's, the next two
	// come from the outbox, the last one after a delay, from either
	// replica; the grader callback (owed by then) is sent by the running
	// replica or handed to the outbox. Tries go on until a callback came
	// from the replica that did not run the rollout.
	const (
		tries    = 8
		failures = 2
		attempts = failures + 1
	)
	crossed := 0
	for k := 0; k < tries && crossed == 0; k++ {
		id := fmt.Sprintf("traced-%d", k)
		ctl := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, FailCallbacks: failures, Logger: quietLog()})
		it := newClusterItem(k)
		it.id = id
		traceID, trainerSpan := randomHex(t, 16), randomHex(t, 8)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		code, _, data, err := ctl.StartWithHeader(ctx, c.gateway, "", http.Header{"Traceparent": {"00-" + traceID + "-" + trainerSpan + "-01"}},
			(&clusterDriver{g2: ctl}).g2Body(it))
		if err != nil || code != http.StatusAccepted {
			cancel()
			t.Fatalf("start %s: %d %s %v", id, code, data, err)
		}
		comp, err := ctl.WaitCompletion(ctx, id)
		if err == nil {
			_, err = ctl.WaitGrader(ctx, id)
		}
		if err != nil {
			cancel()
			t.Fatalf("%s: %v", id, err)
		}
		if comp.Status != "success" || ctl.FailedCallbacks() != failures {
			t.Errorf("%s: completion %s after %d failed posts, want success after %d", id, comp.Raw, ctl.FailedCallbacks(), failures)
		}

		// count counts op's spans of service; an op ending in a space is a
		// prefix.
		count := func(tr jaegerTrace, op, service string) int {
			n := 0
			for _, s := range tr.Spans {
				if (s.OperationName == op || strings.HasSuffix(op, " ") && strings.HasPrefix(s.OperationName, op)) && tr.Processes[s.ProcessID].ServiceName == service {
					n++
				}
			}
			return n
		}
		// The whole trace: every completion attempt, the grader callback,
		// the grading on both sides, the LLM calls.
		var (
			tr   jaegerTrace
			inst map[string]string
		)
		for wait := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
			tr, inst, err = j.traceWithInstances(ctx, traceID)
			// The rollout span ends last, once the outbox is done with its
			// callbacks.
			if err == nil && count(tr, "deliver_completion_callback", "osmo-rollout") >= attempts && count(tr, "deliver_grader_callback", "osmo-rollout") >= 1 &&
				count(tr, "grade", "osmo-rollout") >= 1 && count(tr, "grade", "osmo-grader") >= 1 && count(tr, "chat ", "osmo-llmproxy") >= 2 &&
				count(tr, "rollout", "osmo-rollout") >= 1 && count(tr, "POST /rollout", "osmo-gateway") >= 1 {
				break
			}
			if time.Now().After(wait) {
				t.Fatalf("%s: trace %s did not get every completion attempt, the grader callback, the grading and the LLM calls in 30s (%v); it holds:%s\n"+
					"Jaeger's tag search for osmo.rollout.id=%s finds:%s", id, traceID, err, describe(tr), id, j.tracesTagged(ctx, id))
			}
		}
		checkTrace(t, ctx, j, traceSpec{
			id: id, traceID: traceID, trainerSpan: trainerSpan,
			gatewayOp: "POST /rollout",
			ops: map[string]string{
				"POST /rollout":               "osmo-gateway",
				"rollout":                     "osmo-rollout",
				"invoke_agent calculator":     "osmo-rollout",
				"deliver_completion_callback": "osmo-rollout",
				"deliver_grader_callback":     "osmo-rollout",
				"run_grader calculator":       "osmo-grader",
			},
			underRollout: []string{"chat ", "invoke_agent ", "grade", "run_grader ", "deliver_"},
		})

		// Who did what: the rollout span's replica, each attempt's.
		cancel()
		ranOn := ""
		by := map[int]string{} // completion attempt -> replica
		var graderCallback []string
		for _, s := range tr.Spans {
			switch s.OperationName {
			case "rollout":
				ranOn = inst[s.ProcessID]
			case "deliver_completion_callback":
				n, _ := s.tag("osmo.attempt")
				f, _ := n.(float64)
				by[int(f)] = inst[s.ProcessID]
			case "deliver_grader_callback":
				graderCallback = append(graderCallback, inst[s.ProcessID])
			}
		}
		if got := count(tr, "deliver_completion_callback", "osmo-rollout"); got != attempts || len(by) != attempts {
			t.Errorf("%s: %d completion callback spans, by attempt %v; want attempts 1 to %d", id, got, by, attempts)
		}
		if by[1] != ranOn {
			t.Errorf("%s: ran on %s, but its first completion attempt came from %s", id, ranOn, by[1])
		}
		if len(graderCallback) != 1 {
			t.Errorf("%s: grader callback spans from %v, want one", id, graderCallback)
		} else if by[attempts] != ranOn || graderCallback[0] != ranOn {
			crossed++
		}
		t.Logf("%s: ran on %s; completion attempts from %v (1 direct, the rest from the outbox); grader callback from %v", id, ranOn, by, graderCallback)
	}
	if crossed == 0 {
		t.Errorf("in %d rollouts the completion was never delivered from the outbox by the replica that did not run the rollout: the trace across replicas was not exercised", tries)
	}
}

// TestLostReplicaRolloutsAdmittedByAnother admits every rollout through
// one replica while both take work from the queue, then SIGKILLs the other
// one with its rollouts running: the admitting replica, which knows each
// of them as it admitted it (queued), must read what became of the lost
// replica's ones when their work comes back to it, and conclude each once,
// as interrupted.
func TestLostReplicaRolloutsAdmittedByAnother(t *testing.T) {
	const latency = 8 * time.Second
	policy := "http://" + startMockPolicy(t, "--latency", latency.String()) + "/v1"
	ctl := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, Logger: quietLog()})
	c := startReplicas(t, replicaOptions{n: 2, args: []string{"--max-concurrent", "4", "--max-queued", "20"}})
	admitter, lost := c.replicas[0], c.replicas[1]

	d := &clusterDriver{g2: ctl}
	var ids []string
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for i := range 8 {
		it := newClusterItem(i)
		it.id = fmt.Sprintf("lost-%d", i)
		body, err := json.Marshal(d.g2Body(it))
		if err != nil {
			t.Fatal(err)
		}
		req := &rolloutv1.StartRolloutRequest{}
		if err := protojson.Unmarshal(body, req); err != nil {
			t.Fatal(err)
		}
		if _, err := admitter.client.StartRollout(ctx, req); err != nil {
			t.Fatalf("start %s on %s: %v", it.id, admitter.name, err)
		}
		ids = append(ids, it.id)
	}
	// Both replicas run some (each has four slots).
	waitFor(t, "every rollout's LLM call", func() bool { return len(ctl.Chats()) == len(ids) })
	held := holders(t, c.nats.URL(), ids)
	var onLost []string
	for id, h := range held {
		if strings.HasPrefix(h, lost.name+"-") {
			onLost = append(onLost, id)
		}
	}
	if len(onLost) == 0 || len(onLost) == len(ids) {
		t.Fatalf("holders %v: want rollouts on both replicas", held)
	}
	lost.proc.Stop(syscall.SIGKILL, 5*time.Second)

	for _, id := range ids {
		comp, err := ctl.WaitCompletion(ctx, id)
		if err != nil {
			t.Fatalf("%s (held by %s): %v", id, held[id], err)
		}
		if slices.Contains(onLost, id) != (comp.Status == "failure") {
			t.Errorf("%s (held by %s): completion %s", id, held[id], comp.Raw)
		}
	}
	for _, id := range ids {
		if n := len(ctl.Completions(id)); n != 1 {
			t.Errorf("%s: %d completion callbacks, want 1", id, n)
		}
	}
}
