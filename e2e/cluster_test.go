//go:build unix

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/natsstore"
)

// The shared-state tests run osmo's services against real NATS servers,
// several replicas of each, and kill things while rollouts run. What they
// hold the services to (docs: the NATS shared state):
//
//   - a rollout id starts one run cluster-wide, whichever replica or gateway
//     gets it; a duplicate is accepted (202) without a second run, a
//     duplicate G1 init gets the first answer;
//   - every replica answers status, GET /v1/rollouts/{id} and cancel for
//     every rollout;
//   - each accepted rollout gets exactly one completion (and one grader
//     callback on G2 and v0.3), delivered by whichever replica is alive;
//   - a rollout running on a replica that is SIGKILLed is concluded by a
//     survivor within --lost-after as a failure, err_category agent_error,
//     its message starting "interrupted: replica " and containing
//     " lost while "; a queued one just runs elsewhere;
//   - with NATS unreachable at start a service exits non-zero naming the
//     URL; with NATS lost while serving admissions answer 503 and nothing
//     accepted before is lost once it is back.

// interrupted reports whether msg is the failure a survivor reports for a
// rollout whose replica was lost while running it.
func interrupted(msg string) bool {
	return strings.HasPrefix(msg, "interrupted: replica ") && strings.Contains(msg, " lost while ")
}

// clusterRollouts is how many rollouts TestClusterLosesNothing drives:
// $OSMO_CLUSTER_ROLLOUTS, else 2,000.
func clusterRollouts(t *testing.T) int {
	t.Helper()
	v := os.Getenv("OSMO_CLUSTER_ROLLOUTS")
	if v == "" {
		return 2000
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 20 {
		t.Fatalf("OSMO_CLUSTER_ROLLOUTS=%q: want a count of at least 20", v)
	}
	return n
}

// startV03Controller runs a v0.3 trainer until the test ends.
func startV03Controller(t *testing.T, o controller.V03Options) *controller.V03 {
	t.Helper()
	ctl, err := controller.NewV03("127.0.0.1:0", o)
	if err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, ctl.Serve)
	return ctl
}

// Wires a cluster rollout is started by.
type wireKind int

const (
	wireG1 wireKind = iota
	wireG2
	wireV03
)

func (w wireKind) String() string { return [...]string{"g1", "g2", "v0.3"}[w] }

// When a rollout's duplicate is posted.
const (
	dupNone       = iota
	dupConcurrent // at the same time as the first post
	dupAccepted   // once the first was accepted
	dupFinished   // after the rollout's terminal callback
)

// clusterItem is one rollout of the cluster test: a multiplication the
// calculator workflow solves, with the right ground truth for even i (reward
// 1) and a wrong one for odd i (reward 0).
type clusterItem struct {
	id     string
	i      int
	wire   wireKind
	dup    int
	prompt string
	truth  string
	reward float64
	first  int // the gateway of the first post
	// copies says, for each callback received more than once with the
	// same bytes, when each copy came, in order.
	copies [][]time.Time

	// Set by the driver.
	accepted bool
	ended    bool
	failed   bool   // ended as a failure
	errMsg   string // its message
	g1Answer []byte // the first 202 body of a G1 init
}

func newClusterItem(i int) *clusterItem {
	a, b := 3+i%17, 4+i%13
	it := &clusterItem{id: fmt.Sprintf("cl-%05d", i), i: i, prompt: fmt.Sprintf("What is %d * %d?", a, b),
		truth: strconv.Itoa(a * b), reward: 1}
	if i%2 == 1 {
		it.truth, it.reward = strconv.Itoa(a*b+1), 0
	}
	return it
}

// assign draws it a wire (a fifth G1, two fifths each G2 and v0.3), a
// first gateway, and for a fifth of the rollouts a duplicate.
func (it *clusterItem) assign(rng *rand.Rand, gateways int) {
	switch r := rng.Float64(); {
	case r < 0.2:
		it.wire = wireG1
	case r < 0.6:
		it.wire = wireG2
	default:
		it.wire = wireV03
	}
	it.first = rng.IntN(gateways)
	if rng.Float64() < 0.2 {
		it.dup = 1 + rng.IntN(3)
	}
}

// failures collects a test's errors from many goroutines and reports the
// first few of each kind with a count, so a broken service does not bury
// the log under thousands of lines.
type failures struct {
	mu    sync.Mutex
	kinds []string
	count map[string]int
	first map[string][]string
}

func (f *failures) add(kind, format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.count == nil {
		f.count, f.first = map[string]int{}, map[string][]string{}
	}
	if f.count[kind] == 0 {
		f.kinds = append(f.kinds, kind)
	}
	f.count[kind]++
	if len(f.first[kind]) < 8 {
		f.first[kind] = append(f.first[kind], fmt.Sprintf(format, args...))
	}
}

func (f *failures) total() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.count {
		n += c
	}
	return n
}

// report fails t with every kind collected.
func (f *failures) report(t *testing.T) {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, k := range f.kinds {
		t.Errorf("%s: %d times, first:\n  %s", k, f.count[k], strings.Join(f.first[k], "\n  "))
	}
}

// postJSON posts body to url and returns the answer.
func postJSON(ctx context.Context, url string, body any) (int, http.Header, []byte, error) {
	payload, err := json.Marshal(body)
	if err != nil {
		return 0, nil, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, data, err
}

// getJSON gets url and decodes a JSON object answer.
func getJSON(ctx context.Context, url string) (int, map[string]any, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, nil, err
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		return resp.StatusCode, nil, fmt.Errorf("non-JSON answer %q", data)
	}
	return resp.StatusCode, m, nil
}

// retryableAdmission is an answer a trainer resubmits after: the server
// could not take the start now (a replica or NATS going away), and since
// admission is idempotent the same id may be posted again.
func retryableAdmission(code int) bool {
	return code == 0 || code == http.StatusBadGateway || code == http.StatusServiceUnavailable || code == http.StatusGatewayTimeout
}

// admitter posts starts until they are accepted, through a random gateway
// after each retryable answer, and counts what it saw.
type admitter struct {
	gateways []string
	fails    *failures
	mu       sync.Mutex
	answers  map[string]int // "503", "transport error", ...
	rng      *rand.Rand
}

func (a *admitter) note(answer string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.answers[answer]++
}

func (a *admitter) gateway() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.gateways[a.rng.IntN(len(a.gateways))]
}

// admit calls post on gateway gw, then on random gateways, until it
// answers 202 (returning that answer's body) or something that is not
// retryable, or ctx ends.
func (a *admitter) admit(ctx context.Context, what, gw string, post func(ctx context.Context, gw string) (int, http.Header, []byte, error)) ([]byte, bool) {
	for {
		began := time.Now()
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		code, header, body, err := post(actx, gw)
		cancel()
		if took := time.Since(began); took > 20*time.Second && ctx.Err() == nil {
			a.fails.add("an admission hung", "%s through %s: %v (answer %d %v)", what, gw, took, code, err)
		}
		switch {
		case ctx.Err() != nil:
			// Canceled: the rollout failed otherwise, and said so.
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				a.fails.add("not admitted before the deadline", "%s: last answer %d %s %v", what, code, body, err)
			}
			return nil, false
		case err == nil && code == http.StatusAccepted:
			return body, true
		case err != nil:
			a.note("transport error")
		case retryableAdmission(code):
			a.note(strconv.Itoa(code))
		case code == http.StatusTooManyRequests:
			a.note("429")
			pause, _ := strconv.ParseFloat(header.Get("Retry-After"), 64)
			time.Sleep(min(max(time.Duration(pause*float64(time.Second)), 50*time.Millisecond), time.Second))
		default:
			a.fails.add("admission refused", "%s through %s: %d %s", what, gw, code, body)
			return nil, false
		}
		time.Sleep(50 * time.Millisecond)
		gw = a.gateway()
	}
}

// TestClusterLosesNothing drives thousands of rollouts of all three wires
// through two gateways into three rollout replicas and two graders sharing
// a three-node NATS cluster, while a replica is SIGKILLed for good, another
// is SIGKILLed and restarted, a NATS server is SIGKILLed and restarted, and
// a fifth of all callback posts answer 503; a fifth of the rollouts are
// posted twice through different gateways. Every accepted rollout gets
// exactly one completion (and one grader callback) from exactly one run:
// its reward, or the failure of a rollout whose replica was lost; status
// and cancel through either gateway agree with the callbacks.
func TestClusterLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of rollouts on a cluster")
	}
	n := clusterRollouts(t)
	began := time.Now()
	nc := startNATSCluster(t, 3)

	// The trainers: a fifth of their callback posts fail.
	policy := "http://" + startMockPolicy(t, "--latency", "5ms") + "/v1"
	g2 := startController(t, controller.G2Options{PolicyURL: policy, APIKey: controllerKey, FailFraction: 0.2, Logger: quietLog()})
	g1 := startG1Controller(t, controller.Options{PolicyURL: policy, APIKey: controllerKey, FailFraction: 0.2, Logger: quietLog()})
	v03 := startV03Controller(t, controller.V03Options{PolicyURL: policy, CallbackKey: "K-callbacks", LLMKey: "K-llm",
		FailFraction: 0.2, RetryAdmission: retryableAdmission, Logger: quietLog()})

	// Replicas on loopback addresses of their own, one port each service,
	// found through DNS as a headless Service's pods are.
	rolloutIPs := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	graderIPs := []string{"127.0.0.5", "127.0.0.6"}
	rolloutPort, graderPort := sharedPort(t, rolloutIPs...), sharedPort(t, graderIPs...)
	dns := startDNS(t, map[string][]string{"osmo-rollout.test": rolloutIPs, "osmo-grader.test": graderIPs})
	rolloutTarget := "dns://" + dns.addr + "/osmo-rollout.test:" + rolloutPort
	graderTarget := "dns://" + dns.addr + "/osmo-grader.test:" + graderPort

	for i, ip := range graderIPs {
		addr := ip + ":" + graderPort
		p := start(t, fmt.Sprintf("grader-%d", i), nil, "grader", "--grpc-addr", addr, "--metrics-addr", "",
			"--grader", "calculator", "--nats", nc.URL(), "--log-level", "warn")
		waitGRPC(t, p, addr)
	}
	const maxConcurrent = 16
	rolloutArgs := func(ip string) []string {
		return []string{"rollout", "--grpc-addr", ip + ":" + rolloutPort, "--metrics-addr", "",
			"--grader-addr", graderTarget, "--workflow", "calculator", "--max-concurrent", strconv.Itoa(maxConcurrent),
			"--max-queued", strconv.Itoa(2 * n), "--nats", nc.URL(), "--lost-after", "3s", "--log-level", "warn"}
	}
	// The G1 completion is retried with the client's delays, which double
	// to 30 s by default: a completion whose trainer fails it five times
	// in a row (a fifth of posts fail, and about one callback in a run
	// gets there) would wait longer than the test's two minutes leave.
	// Capped at 4 s, as G2's and v0.3's 8 s cap keeps theirs, a callback
	// has a dozen attempts in any minute.
	rolloutEnv := []string{"OSMOSIS_ROLLOUT_CLIENT_RETRY_MAX_DELAY=4"}
	replicas := make([]*proc, len(rolloutIPs))
	for i, ip := range rolloutIPs {
		replicas[i] = start(t, fmt.Sprintf("rollout-%d", i), rolloutEnv, rolloutArgs(ip)...)
		waitGRPC(t, replicas[i], ip+":"+rolloutPort)
	}
	gateways := make([]string, 2)
	for i := range gateways {
		p, addrs := startListening(t, fmt.Sprintf("gateway-%d", i), nil, "gateway", "--addr", "127.0.0.1:0", "--rollout-addr", rolloutTarget,
			"--grader-addr", graderTarget, "--log-level", "warn")
		gateways[i] = addrs["http"]
		waitHTTP(t, p, gateways[i]+"/health")
	}
	// The replicas' logs, less the retries of the callbacks failed on
	// purpose.
	output := func() string {
		var b strings.Builder
		for i, p := range replicas {
			var kept []string
			for _, line := range strings.Split(p.Output(), "\n") {
				if !strings.Contains(line, `"msg":"callback attempt failed"`) {
					kept = append(kept, line)
				}
			}
			fmt.Fprintf(&b, "--- rollout-%d (tail)\n%s\n", i, tail(strings.Join(kept, "\n"), 3000))
		}
		return b.String()
	}
	t.Logf("cluster up in %v: NATS %s, rollout %s, grader %s, gateways %v", time.Since(began).Round(time.Millisecond), nc.URL(), rolloutTarget, graderTarget, gateways)

	rng := rand.New(rand.NewPCG(1, uint64(n)))
	items := make([]*clusterItem, n)
	for i := range items {
		items[i] = newClusterItem(i)
		items[i].assign(rng, len(gateways))
	}
	fails := &failures{}
	adm := &admitter{gateways: gateways, fails: fails, answers: map[string]int{}, rng: rand.New(rand.NewPCG(2, 2))}

	driveTimeout := max(60*time.Second, time.Duration(n)*60*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), driveTimeout)
	defer cancel()
	var finished atomic.Int64
	d := &clusterDriver{g1: g1, g2: g2, v03: v03, gateways: gateways, adm: adm, fails: fails, finished: &finished, began: began}

	// As a trainer keeps a batch in flight: a window of rollouts twice what
	// the replicas run at once, so some always wait in the queue.
	work := make(chan *clusterItem)
	var wg sync.WaitGroup
	for range 2 * maxConcurrent * len(rolloutIPs) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for it := range work {
				d.drive(ctx, it)
			}
		}()
	}
	go func() {
		defer close(work)
		for _, it := range items {
			select {
			case work <- it:
			case <-ctx.Done():
				return
			}
		}
	}()
	drained := make(chan struct{})
	go func() { wg.Wait(); close(drained) }()

	// The faults, at fractions of the rollouts ended; a server killed to
	// come back is restarted a little later, while the run goes on.
	faults := []struct {
		at           float64
		what         string
		kill         func()
		restartAfter time.Duration
		restart      func()
	}{
		{at: 0.3, what: "SIGKILL rollout-0 (for good)", kill: func() {
			replicas[0].Stop(syscall.SIGKILL, 5*time.Second)
			d.kills = append(d.kills, time.Now()) // once it is gone
		}},
		{at: 0.5, what: "SIGKILL nats-2", kill: func() {
			nc.Kill(2)
			d.kills = append(d.kills, time.Now())
		}, restartAfter: 2 * time.Second, restart: func() { nc.Restart(2) }},
		{at: 0.6, what: "SIGKILL rollout-1", kill: func() {
			replicas[1].Stop(syscall.SIGKILL, 5*time.Second)
			d.kills = append(d.kills, time.Now()) // once it is gone
		},
			restartAfter: time.Second, restart: func() {
				replicas[1] = start(t, "rollout-1-again", rolloutEnv, rolloutArgs(rolloutIPs[1])...)
				waitGRPCWithin(t, replicas[1], rolloutIPs[1]+":"+rolloutPort, time.Minute)
			}},
	}
	type restart struct {
		when time.Time
		what string
		do   func()
	}
	var restarts []restart
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	logf := func(format string, args ...any) {
		t.Logf("%v: "+format, append([]any{time.Since(began).Round(time.Millisecond)}, args...)...)
	}
	next := 0
faults:
	for next < len(faults) || len(restarts) > 0 {
		select {
		case <-drained:
			break faults
		case <-ctx.Done():
			break faults
		case <-tick.C:
		}
		if next < len(faults) && finished.Load() >= int64(faults[next].at*float64(n)) {
			f, at := faults[next], finished.Load()
			f.kill()
			logf("%s with %d of %d rollouts ended", f.what, at, n)
			if f.restart != nil {
				restarts = append(restarts, restart{time.Now().Add(f.restartAfter), f.what, f.restart})
				slices.SortFunc(restarts, func(a, b restart) int { return a.when.Compare(b.when) })
			}
			next++
		}
		for len(restarts) > 0 && time.Now().After(restarts[0].when) {
			restarts[0].do()
			logf("restarted after %s with %d of %d rollouts ended", restarts[0].what, finished.Load(), n)
			restarts = restarts[1:]
		}
	}
	if ctx.Err() == nil && (next < len(faults) || len(restarts) > 0) {
		t.Errorf("the run ended before the faults did (%d of %d made, %d restarts pending): they hit less than planned", next, len(faults), len(restarts))
	}
	<-drained
	drainedAt := time.Now()
	ended := finished.Load()
	t.Logf("%v: %d of %d rollouts ended; admission answers retried: %v", time.Since(began).Round(time.Millisecond), ended, n, adm.answers)
	if ended < int64(n) {
		fails.report(t)
		var open []string
		for _, it := range items {
			// A v0.3 rollout is marked accepted only when its run
			// returns, so one that did not end is shown either way.
			if (it.accepted || it.wire == wireV03) && !it.ended && len(open) < 10 {
				open = append(open, it.id)
			}
		}
		t.Logf("the shared state's queues:\n%s", queueDump(nc.URL(), open...))
		t.Fatalf("only %d of %d rollouts ended in %v\n%s", ended, n, driveTimeout, output())
	}

	// Status, the record and cancel answer for every rollout through either
	// gateway. Their final word may trail the callbacks a little.
	checkClusterAnswers(t, items, gateways, fails)

	// A duplicate callback or a second run would have shown by now: more
	// than --lost-after since the last rollout ended.
	time.Sleep(time.Until(drainedAt.Add(4 * time.Second)))
	checkClusterCallbacks(t, items, d, fails)
	fails.report(t)
	if t.Failed() {
		t.Logf("%s", output())
	}
	t.Logf("%v in all", time.Since(began).Round(time.Millisecond))
}

// clusterDriver runs one rollout at a time per worker: it posts it (and its
// duplicate) and waits for its terminal callback.
type clusterDriver struct {
	g1       *controller.Controller
	g2       *controller.G2
	v03      *controller.V03
	gateways []string
	adm      *admitter
	fails    *failures
	finished *atomic.Int64
	began    time.Time // the test's start, for the times it logs
	// kills are when a rollout replica or a NATS node was SIGKILLed.
	kills []time.Time
}

func (d *clusterDriver) other(gw int) string { return d.gateways[(gw+1)%len(d.gateways)] }

// start posts it through gateway gw until accepted; for G1 it keeps the
// first answer and checks a duplicate's against it.
func (d *clusterDriver) start(ctx context.Context, it *clusterItem, gw string, dup bool) bool {
	what := fmt.Sprintf("%s %s", it.wire, it.id)
	if dup {
		what += " (duplicate)"
	}
	var post func(ctx context.Context, gw string) (int, http.Header, []byte, error)
	switch it.wire {
	case wireG1:
		post = func(ctx context.Context, gw string) (int, http.Header, []byte, error) {
			code, body, err := d.g1.Init(ctx, gw, "", d.g1Init(it))
			return code, nil, body, err
		}
	case wireG2:
		post = func(ctx context.Context, gw string) (int, http.Header, []byte, error) {
			return d.g2.Start(ctx, gw, "", d.g2Body(it))
		}
	case wireV03:
		post = func(ctx context.Context, gw string) (int, http.Header, []byte, error) {
			return postJSON(ctx, gw+"/rollout", d.v03.StartBody(d.v03Request(it)))
		}
	}
	body, ok := d.adm.admit(ctx, what, gw, post)
	if ok && it.wire == wireG1 {
		d.sameG1Answer(it, body, dup)
	}
	return ok
}

var g1AnswerMu sync.Mutex

// sameG1Answer keeps the first G1 answer and checks any other against it:
// a duplicate init gets the saved answer.
func (d *clusterDriver) sameG1Answer(it *clusterItem, body []byte, dup bool) {
	g1AnswerMu.Lock()
	defer g1AnswerMu.Unlock()
	if it.g1Answer == nil {
		it.g1Answer = body
		return
	}
	var a, b any
	if json.Unmarshal(it.g1Answer, &a) != nil || json.Unmarshal(body, &b) != nil || !reflect.DeepEqual(a, b) {
		d.fails.add("a duplicate G1 init got another answer", "%s: %s, then %s (dup %v)", it.id, it.g1Answer, body, dup)
	}
}

func (d *clusterDriver) g1Init(it *clusterItem) controller.InitRequest {
	return controller.InitRequest{
		RolloutID:        it.id,
		Messages:         []map[string]any{{"role": "user", "content": it.prompt}},
		CompletionParams: map[string]any{"temperature": 0.7},
		Metadata:         map[string]any{"ground_truth": it.truth},
	}
}

func (d *clusterDriver) g2Body(it *clusterItem) map[string]any {
	body := d.g2.StartBody(it.id, []map[string]any{{"role": "user", "content": it.prompt}})
	body["label"] = it.truth
	body["metadata"] = map[string]any{"row": it.i}
	body["agent_timeout_sec"] = 300
	body["grader_timeout_sec"] = 300
	return body
}

func (d *clusterDriver) v03Request(it *clusterItem) controller.V03RunRequest {
	timeout := 300.0
	return controller.V03RunRequest{RolloutID: it.id, Messages: []map[string]any{{"role": "user", "content": it.prompt}},
		Label: &it.truth, Metadata: map[string]any{"row": it.i}, AgentTimeoutSec: &timeout, GraderTimeoutSec: &timeout}
}

// drive runs one rollout: its post (and duplicate) and its terminal
// callback.
func (d *clusterDriver) drive(ctx context.Context, it *clusterItem) {
	first := d.gateways[it.first]
	// The duplicate's context ends early when the rollout itself fails.
	dctx, stopDup := context.WithCancel(ctx)
	defer stopDup()
	var dups sync.WaitGroup
	dupOK := true
	postDup := func() {
		if !d.start(dctx, it, d.other(it.first), true) {
			dupOK = false
		}
	}
	switch it.wire {
	case wireV03:
		// Run posts the start and waits for the grader callback; the
		// duplicate goes through the other gateway meanwhile.
		switch it.dup {
		case dupConcurrent:
			dups.Add(1)
			go func() { defer dups.Done(); time.Sleep(2 * time.Millisecond); postDup() }()
		case dupAccepted:
			dups.Add(1)
			go func() { defer dups.Done(); d.waitKnown(dctx, it); postDup() }()
		}
		res, err := d.v03.Run(ctx, first, "", d.v03Request(it))
		if err != nil {
			d.fails.add("v0.3 rollout did not end", "%s: %v", it.id, err)
			stopDup()
			dups.Wait()
			return
		}
		it.accepted, it.ended = true, true
		it.failed = res.Status != "success"
		if res.ErrMessage != nil {
			it.errMsg = *res.ErrMessage
		}
	default:
		if it.dup == dupConcurrent {
			dups.Add(1)
			go func() { defer dups.Done(); postDup() }()
		}
		if !d.start(ctx, it, first, false) {
			stopDup()
			dups.Wait()
			return
		}
		it.accepted = true
		if it.dup == dupAccepted {
			postDup()
		}
		if !d.waitEnd(ctx, it) {
			stopDup()
			dups.Wait()
			return
		}
	}
	d.finished.Add(1)
	if it.dup == dupFinished {
		postDup()
	}
	dups.Wait()
	if !dupOK {
		d.fails.add("a duplicate was not accepted", "%s (%s, dup mode %d)", it.id, it.wire, it.dup)
	}
}

// waitKnown polls the status through the other gateway until the rollout is
// known there (its first post was accepted).
func (d *clusterDriver) waitKnown(ctx context.Context, it *clusterItem) {
	for ctx.Err() == nil {
		code, st, err := getJSON(ctx, d.other(it.first)+"/rollout/"+it.id+"/status")
		if err == nil && code == http.StatusOK && st["status"] != "unknown" {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitEnd waits for a G1 or G2 rollout's terminal callback.
func (d *clusterDriver) waitEnd(ctx context.Context, it *clusterItem) bool {
	if it.wire == wireG1 {
		c, err := d.g1.Wait(ctx, it.id)
		if err != nil {
			d.fails.add("no G1 completion", "%s: %v", it.id, err)
			return false
		}
		it.ended, it.failed, it.errMsg = true, c.Status != "COMPLETED", c.ErrorMessage
		return true
	}
	if _, err := d.g2.WaitCompletion(ctx, it.id); err != nil {
		d.fails.add("no G2 completion", "%s: %v", it.id, err)
		return false
	}
	g, err := d.g2.WaitGrader(ctx, it.id)
	if err != nil {
		d.fails.add("no G2 grader callback", "%s: %v", it.id, err)
		return false
	}
	it.ended, it.failed = true, g.Status != "success"
	if g.ErrMessage != nil {
		it.errMsg = *g.ErrMessage
	}
	return true
}

// checkClusterAnswers asks both gateways for every rollout's status, one of
// them for its record, and both to cancel it: status is the final word of
// its callbacks, the record is finished, cancel finds nothing to cancel.
func checkClusterAnswers(t *testing.T, items []*clusterItem, gateways []string, fails *failures) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ids := make(chan *clusterItem)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for it := range ids {
				for g, gw := range gateways {
					checkStatus(ctx, it, gw, fails)
					if (it.i+g)%len(gateways) == 0 {
						checkRecord(ctx, it, gw, fails)
					}
				}
			}
		}()
	}
	for _, it := range items {
		if it.accepted && it.ended {
			ids <- it
		}
	}
	close(ids)
	wg.Wait()

	// Cancel in batches, alternating gateways: every finished rollout is
	// not_found.
	const batch = 100
	for b := 0; b*batch < len(items); b++ {
		var names []string
		for _, it := range items[b*batch : min((b+1)*batch, len(items))] {
			if it.accepted && it.ended {
				names = append(names, it.id)
			}
		}
		if len(names) == 0 {
			continue
		}
		gw := gateways[b%len(gateways)]
		code, _, data, err := postJSON(ctx, gw+"/rollout/cancel", map[string]any{"ids": names})
		var answer struct {
			Dispositions map[string]string `json:"dispositions"`
		}
		if err != nil || code != http.StatusOK || json.Unmarshal(data, &answer) != nil {
			fails.add("cancel failed", "through %s: %d %s %v", gw, code, data, err)
			continue
		}
		for _, id := range names {
			if got := answer.Dispositions[id]; got != "not_found" {
				fails.add("cancel of a finished rollout did not answer not_found", "%s through %s: %q", id, gw, got)
			}
		}
	}
}

// checkStatus polls GET /rollout/{id}/status through gw until it says what
// the callbacks said (a little while at most).
func checkStatus(ctx context.Context, it *clusterItem, gw string, fails *failures) {
	var last string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		code, st, err := getJSON(ctx, gw+"/rollout/"+it.id+"/status")
		lagging := false
		if err == nil && code == http.StatusOK && st["rollout_id"] == it.id {
			msg, _ := st["err_message"].(string)
			switch st["status"] {
			case "success":
				if !it.failed && st["reward"] == it.reward {
					return
				}
			case "failure":
				if it.failed && st["err_category"] == "agent_error" && interrupted(msg) {
					return
				}
			case "queued", "running", "grading":
				// The record may trail the callbacks a little.
				lagging = true
			}
		}
		last = fmt.Sprintf("%d %v %v", code, st, err)
		// Unknown, an error or another outcome is wrong at once: every
		// replica answers for every rollout.
		if !lagging || time.Now().After(deadline) || ctx.Err() != nil {
			fails.add("status is not the final word", "%s (%s, failed %v) through %s: %s", it.id, it.wire, it.failed, gw, last)
			return
		}
	}
}

// checkRecord gets GET /v1/rollouts/{id} through gw: a finished record.
func checkRecord(ctx context.Context, it *clusterItem, gw string, fails *failures) {
	want := "STATE_SUCCEEDED"
	if it.failed {
		want = "STATE_FAILED"
	}
	var last string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		code, rec, err := getJSON(ctx, gw+"/v1/rollouts/"+it.id)
		if err == nil && code == http.StatusOK && rec["rollout_id"] == it.id && rec["state"] == want &&
			(it.wire != wireG1 || rec["wire"] == "g1") {
			return
		}
		lagging := err == nil && code == http.StatusOK && rec["rollout_id"] == it.id &&
			(rec["state"] == "STATE_QUEUED" || rec["state"] == "STATE_RUNNING" || rec["state"] == "STATE_GRADING")
		last = fmt.Sprintf("%d state %v wire %v %v", code, rec["state"], rec["wire"], err)
		if !lagging || time.Now().After(deadline) || ctx.Err() != nil {
			fails.add("the record is not finished", "%s (%s) through %s: want %s, got %s", it.id, it.wire, gw, want, last)
			return
		}
	}
}

// repeatWindow is how long before a SIGKILL of its replica, or of a NATS
// node, a callback the trainer took may come again: its delivery's mark was
// not written yet.
// A post, the lifecycle's read and its write, on a loaded machine with the
// race detector on; the write waits out a stream leader's election when a
// NATS node was killed just before (seen: 4 s).
const repeatWindow = 5 * time.Second

// checkClusterCallbacks checks every rollout's callbacks and LLM calls.
func checkClusterCallbacks(t *testing.T, items []*clusterItem, d *clusterDriver, fails *failures) {
	t.Helper()
	runs, samples := clusterRuns(d)
	known := map[string]bool{}
	var graded, lost int
	for _, it := range items {
		known[it.id] = true
		if !it.accepted {
			continue
		}
		ok := checkItemCallbacks(it, d, fails)
		switch {
		case !ok:
		case it.failed:
			lost++
		default:
			graded++
		}
		// One run: its first LLM call (the only one without an assistant
		// turn in its history) came once; a rollout that ran to its end
		// made one.
		switch r := runs[it.id]; {
		case r > 1:
			fails.add("a rollout ran twice", "%s (%s): %d runs reached the policy", it.id, it.wire, r)
		case r == 0 && it.ended && !it.failed:
			fails.add("a graded rollout made no LLM call", "%s (%s)", it.id, it.wire)
		}
		if s := samples[it.id]; len(s) > 1 {
			fails.add("a rollout's calls came from several samples", "%s (%s): %v", it.id, it.wire, s)
		}
	}
	for id := range runs {
		if !known[id] {
			fails.add("LLM calls of an unknown rollout", "%q", id)
		}
	}
	// Delivery is at least once: a callback comes again, with the same
	// bytes, only when a kill caught it between the trainer taking it and
	// its mark: its replica killed, or the NATS node its replica wrote to
	// (the mark given up on, or the hold on it lapsed as the replica
	// reconnected). Each kill repeats it at most once; one whose mark a
	// NATS node's loss cost comes a third time if the replica that posts
	// it again is killed as it does.
	repeats := 0
	since := func(at time.Time) string { return at.Sub(d.began).Round(time.Millisecond).String() }
	for _, it := range items {
		for _, times := range it.copies {
			repeats += len(times) - 1
			if i := unexplained(times, d.kills); i >= 0 {
				var copies, kills []string
				for _, c := range times {
					copies = append(copies, since(c))
				}
				for _, k := range d.kills {
					kills = append(kills, since(k))
				}
				fails.add("a callback came again without a kill of its own as it was delivered",
					"%s (%s): copy %d of %v, the kills at %v", it.id, it.wire, i+1, copies, kills)
			}
		}
	}
	t.Logf("%d rollouts graded, %d concluded as lost with their replica; callback posts failed on purpose: G2 %d, v0.3 %d, G1 %d; "+
		"callbacks received again with the same bytes (taken by the trainer in the %v before a replica's or a NATS node's SIGKILL): %d",
		graded, lost, d.g2.FailedCallbacks(), d.v03.FailedCallbacks(), d.g1.FailedCallbacks(), repeatWindow, repeats)
	if lost == 0 {
		t.Errorf("no rollout was concluded as lost: the replica kills hit no running rollout")
	}
	if fails.total() == 0 && graded+lost != len(items) {
		t.Errorf("%d graded and %d lost of %d rollouts", graded, lost, len(items))
	}
}

// checkItemCallbacks checks one rollout's callbacks: exactly one of each,
// its reward, or the failure of a lost replica.
func checkItemCallbacks(it *clusterItem, d *clusterDriver, fails *failures) bool {
	ok := true
	bad := func(kind, format string, args ...any) {
		ok = false
		fails.add(kind, "%s (%s): "+format, append([]any{it.id, it.wire}, args...)...)
	}
	lostFailure := func(status string, category *string, msg *string) bool {
		return status == "failure" && category != nil && *category == "agent_error" && msg != nil && interrupted(*msg)
	}
	switch it.wire {
	case wireG1:
		cs := d.g1.Completions(it.id)
		raw := func(c controller.Completion) []byte { return c.Raw }
		it.copies = copiesOf(cs, raw, func(c controller.Completion) time.Time { return c.At })
		if len(cs) != 1 && distinct(cs, raw) == 1 {
			cs = cs[:1]
		}
		if len(cs) != 1 {
			bad("not exactly one completion", "%d", len(cs))
			return false
		}
		c := cs[0]
		switch {
		case c.Status == "COMPLETED":
			if c.Reward == nil || *c.Reward != it.reward {
				bad("wrong reward", "completion %s, want reward %v", c.Raw, it.reward)
			}
		case c.Status != "ERROR" || !interrupted(c.ErrorMessage):
			bad("a failure other than a lost replica's", "completion %s", c.Raw)
		}
	case wireG2:
		cs, gs := d.g2.Completions(it.id), d.g2.GraderCallbacks(it.id)
		raw := func(c controller.G2Callback) []byte { return c.Raw }
		at := func(c controller.G2Callback) time.Time { return c.At }
		it.copies = append(copiesOf(cs, raw, at), copiesOf(gs, raw, at)...)
		if len(cs) != 1 && distinct(cs, raw) == 1 {
			cs = cs[:1]
		}
		if len(gs) != 1 && distinct(gs, raw) == 1 {
			gs = gs[:1]
		}
		if len(cs) != 1 || len(gs) != 1 {
			bad("not exactly one completion and one grader callback", "%d and %d", len(cs), len(gs))
			return false
		}
		c, g := cs[0], gs[0]
		switch {
		case c.Status == "success" && g.Status == "success":
			for sid, s := range g.Samples {
				if s.Reward == nil || *s.Reward != it.reward {
					bad("wrong reward", "sample %s: %v, want %v", sid, s.Reward, it.reward)
				}
			}
			if len(g.Samples) == 0 {
				bad("a graded rollout without samples", "%s", g.Raw)
			}
		case c.Status == "success" && lostFailure(g.Status, g.ErrCategory, g.ErrMessage):
			// The run ended and was reported; its replica was lost while
			// grading it (the samples went with it).
		case !lostFailure(c.Status, c.ErrCategory, c.ErrMessage) || !lostFailure(g.Status, g.ErrCategory, g.ErrMessage):
			bad("a failure other than a lost replica's", "completion %s, grader callback %s", c.Raw, g.Raw)
		}
	case wireV03:
		cs, gs := d.v03.Completions(it.id), d.v03.GraderCallbacks(it.id)
		raw := func(c controller.V03Callback) []byte { return c.Raw }
		at := func(c controller.V03Callback) time.Time { return c.At }
		it.copies = append(copiesOf(cs, raw, at), copiesOf(gs, raw, at)...)
		if len(cs) != 1 && distinct(cs, raw) == 1 {
			cs = cs[:1]
		}
		if len(gs) != 1 && distinct(gs, raw) == 1 {
			gs = gs[:1]
		}
		if len(cs) != 1 || len(gs) != 1 {
			bad("not exactly one completion and one grader callback", "%d and %d", len(cs), len(gs))
			return false
		}
		c, g := cs[0], gs[0]
		switch {
		case c.Status == "success" && g.Status == "success":
			if g.Sample == nil || g.Sample.Reward == nil || *g.Sample.Reward != it.reward {
				bad("wrong reward", "grader callback %s, want reward %v", g.Raw, it.reward)
			}
		case c.Status == "success" && lostFailure(g.Status, g.ErrCategory, g.ErrMessage):
			// The run ended and was reported; its replica was lost while
			// grading it (the samples went with it).
		case !lostFailure(c.Status, c.ErrCategory, c.ErrMessage) || !lostFailure(g.Status, g.ErrCategory, g.ErrMessage):
			bad("a failure other than a lost replica's", "completion %s, grader callback %s", c.Raw, g.Raw)
		}
	}
	return ok
}

// clusterRuns counts, per rollout id, the runs whose LLM calls reached the
// trainers, and the sample ids they bore. A run of the calculator workflow
// opens with the one call whose history has no assistant turn; no call is
// retried here (the policy never fails), so a second such call is a second
// run.
func clusterRuns(d *clusterDriver) (runs map[string]int, samples map[string]map[string]bool) {
	runs, samples = map[string]int{}, map[string]map[string]bool{}
	count := func(id, sample string, body map[string]any) {
		if id == "" {
			id = "(none)"
		}
		if _, ok := runs[id]; !ok {
			runs[id] = 0
		}
		if opening(body) {
			runs[id]++
		}
		if sample != "" {
			if samples[id] == nil {
				samples[id] = map[string]bool{}
			}
			samples[id][sample] = true
		}
	}
	for _, c := range d.g1.Chats() {
		id, _ := c.Body["rollout_id"].(string)
		count(id, "", c.Body)
	}
	for _, c := range d.g2.Chats() {
		count(c.Header.Get("X-Rollout-Id"), c.Header.Get("X-Sample-Id"), c.Body)
	}
	for _, c := range d.v03.Chats() {
		count(c.RolloutID, c.Header.Get("X-Sample-Id"), c.Body)
	}
	return runs, samples
}

// opening reports whether an LLM call's history has no assistant turn yet.
func opening(body map[string]any) bool {
	msgs, _ := body["messages"].([]any)
	for _, m := range msgs {
		if mm, _ := m.(map[string]any); mm["role"] == "assistant" {
			return false
		}
	}
	return true
}

// queueDump describes the rollout service's consumers in the cluster at
// urls, for a failure's report.
func queueDump(urls string, ids ...string) string {
	nc, err := nats.Connect(urls, nats.Timeout(5*time.Second))
	if err != nil {
		return err.Error()
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err.Error()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var b strings.Builder
	for _, sc := range [][2]string{{"osmo_work", "rollout-work"}, {"osmo_work", "rollout-control"}, {"osmo_outbox", "rollout-outbox"}} {
		c, err := js.Consumer(ctx, sc[0], sc[1])
		if err != nil {
			fmt.Fprintf(&b, "%s: %v; ", sc[1], err)
			continue
		}
		i := c.CachedInfo()
		fmt.Fprintf(&b, "%s: pending %d, ack pending %d, redelivered %d, waiting %d, leader %s, delivered %d, ack floor %d", sc[1],
			i.NumPending, i.NumAckPending, i.NumRedelivered, i.NumWaiting, i.Cluster.Leader, i.Delivered.Stream, i.AckFloor.Stream)
		if str, err := js.Stream(ctx, sc[0]); err == nil {
			st := str.CachedInfo().State
			fmt.Fprintf(&b, "; stream %s: %d messages, %d..%d", sc[0], st.Msgs, st.FirstSeq, st.LastSeq)
		}
		b.WriteString("\n")
	}
	if len(ids) > 0 {
		if kv, err := js.KeyValue(ctx, "osmo_rollouts"); err == nil {
			for _, id := range ids {
				e, err := kv.Get(ctx, natsstore.Key(id))
				if err != nil {
					fmt.Fprintf(&b, "lifecycle %s: %v\n", id, err)
					continue
				}
				fmt.Fprintf(&b, "lifecycle %s (revision %d): %s\n", id, e.Revision(), e.Value())
			}
		}
		if str, err := js.Stream(ctx, "osmo_outbox"); err == nil {
			for _, id := range ids {
				m, err := str.GetLastMsgForSubject(ctx, "osmo.outbox."+natsstore.Key(id)+".>")
				if err != nil {
					fmt.Fprintf(&b, "outbox %s: %v\n", id, err)
					continue
				}
				fmt.Fprintf(&b, "outbox %s: seq %d, %s: %s\n", id, m.Sequence, m.Subject, m.Data)
			}
		}
	}
	return b.String()
}

// copiesOf says, for each callback received more than once with the same
// bytes, when each copy came, in order.
func copiesOf[T any](cbs []T, raw func(T) []byte, at func(T) time.Time) [][]time.Time {
	var copies [][]time.Time
	for i, c := range cbs {
		if slices.ContainsFunc(cbs[:i], func(o T) bool { return bytes.Equal(raw(o), raw(c)) }) {
			continue // counted with its first copy
		}
		var times []time.Time
		for _, o := range cbs[i:] {
			if bytes.Equal(raw(o), raw(c)) {
				times = append(times, at(o))
			}
		}
		if len(times) > 1 {
			slices.SortFunc(times, time.Time.Compare)
			copies = append(copies, times)
		}
	}
	return copies
}

// unexplained is the first copy of a callback (from the second) that no
// SIGKILL of its own accounts for, or -1: each copy but the first follows
// a kill, each a different one, made within repeatWindow after the copy
// before it was taken. times and kills are in order.
func unexplained(times, kills []time.Time) int {
	next := 0 // the kills before it accounted for a copy, or came too early
	for i := 1; i < len(times); i++ {
		taken := times[i-1]
		// A post sent just before a kill may be read by the trainer just
		// after it. A kill too early for this copy is for the later ones.
		for next < len(kills) && !taken.Before(kills[next].Add(time.Second)) {
			next++
		}
		if next == len(kills) || kills[next].Sub(taken) > repeatWindow {
			return i
		}
		next++
	}
	return -1
}

// TestUnexplainedRepeats: each copy of a callback but the first needs a
// kill of its own, made within repeatWindow after the copy before it was
// taken. The kills are those of a run: rollout-0, nats-2, rollout-1.
func TestUnexplainedRepeats(t *testing.T) {
	at := func(secs ...float64) []time.Time {
		var times []time.Time
		for _, s := range secs {
			times = append(times, time.Unix(0, 0).Add(time.Duration(s*float64(time.Second))))
		}
		return times
	}
	kills := at(10.8, 14.2, 27.5)
	for _, c := range []struct {
		name   string
		copies []time.Time
		want   int
	}{
		{"once", at(20), -1},
		{"again after its replica's kill", at(27.3, 30.6), -1},
		{"again after a NATS node's kill, its mark given up on", at(14.3, 27.4), -1},
		{"and a third time, posted again as its replica was killed", at(14.3, 27.45, 30.6), -1},
		{"again without a kill", at(20, 22), 1},
		{"a third time with no second kill", at(14.3, 14.9, 18), 2},
		{"sent ahead of its mark, then again as its replica was killed", at(25.1, 27.55, 31.6), 2},
	} {
		if got := unexplained(c.copies, kills); got != c.want {
			t.Errorf("%s: unexplained = %d, want %d", c.name, got, c.want)
		}
	}
}

// distinct counts the different bodies among callbacks: a callback the
// trainer took in the instant before its replica was SIGKILLed, before the
// delivery was marked, is posted again with the same bytes (at least once);
// anything else sent twice differs.
func distinct[T any](cbs []T, raw func(T) []byte) int {
	var seen [][]byte
	for _, c := range cbs {
		if !slices.ContainsFunc(seen, func(b []byte) bool { return bytes.Equal(b, raw(c)) }) {
			seen = append(seen, raw(c))
		}
	}
	return len(seen)
}
