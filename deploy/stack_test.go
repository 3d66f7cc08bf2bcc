package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/types"

	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/proctest"
)

// composeStack runs the services of docker-compose.yml as processes on
// loopback: the osmo services and the NATS server, each with exactly the
// command and environment the compose file gives it. Only what a container
// has to itself changes, because every service shares one host: each
// container gets a loopback IP and each (service, container port) pair its
// own free port, the same one everywhere it is named; each volume mount
// point and mounted config becomes a path of the test's own. A service with
// replicas runs one process per replica, each on its own loopback IP
// (127.0.0.2, 127.0.0.3, ...) and the same ports, and an in-test DNS server
// resolves the service name to all of them, as Docker's DNS does, for the
// dns:/// targets that balance over them. Jaeger's OTLP ports become an
// in-test OTLP sink.
type composeStack struct {
	project   *types.Project
	instances map[string][]*instance // service -> its replicas
	dns       *dnsServer
	sink      *otlpSink
	procs     []*proc    // in start order
	apiKey    string     // OSMO_API_KEY the rollout service got from .env
	owner     *testing.T // the test whose cleanup stops the processes
}

// instance is one container of a compose service, as a process.
type instance struct {
	spec    types.ServiceConfig
	replica int               // 1-based, as compose numbers containers
	ip      string            // the loopback IP standing in for the container's
	addrs   map[int]string    // container port -> ip:N
	mounts  map[string]string // mount target (volume or config) -> test path
	bin     string
	args    []string
	env     []string
	proc    *proc
}

func (in *instance) name() string {
	if in.spec.GetScale() == 1 {
		return in.spec.Name
	}
	return fmt.Sprintf("%s-%d", in.spec.Name, in.replica)
}

// startComposeStack starts every osmo and NATS service of the compose file,
// every profile enabled, in depends_on order, and waits for each one's own
// healthcheck to pass before starting what depends on it.
func startComposeStack(t *testing.T) *composeStack {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("replicas listen on 127.0.0.2 and up, which only Linux routes to loopback by default")
	}
	st := &composeStack{
		owner:     t,
		project:   composeProject(t, true),
		instances: map[string][]*instance{},
		dns:       startDNSServer(t),
		sink:      startOTLPSink(t),
	}
	nextIP := netip.MustParseAddr("127.0.0.2")
	// Every chosen port stays bound until all are chosen, so no two
	// services draw the same one.
	var held []net.Listener
	for _, s := range st.project.Services {
		n := s.GetScale()
		ips := []string{"127.0.0.1"}
		if n > 1 {
			ips = ips[:0]
			for range n {
				ips = append(ips, nextIP.String())
				nextIP = nextIP.Next()
			}
		}
		ports := map[int]int{}
		for port := range exposedPorts(t, s) {
			var lns []net.Listener
			ports[port], lns = sharedFreePort(t, ips)
			held = append(held, lns...)
		}
		var configs map[string]string
		if len(s.Configs) > 0 {
			configs = natsConfigFiles(t, st.project, s)
		}
		var hosts []netip.Addr
		for i, ip := range ips {
			in := &instance{spec: s, replica: i + 1, ip: ip, addrs: map[int]string{}, mounts: map[string]string{}}
			for port, p := range ports {
				in.addrs[port] = net.JoinHostPort(ip, strconv.Itoa(p))
				if s.Name == "jaeger" {
					switch port {
					case 4317:
						in.addrs[port] = st.sink.GRPCAddr
					case 4318:
						in.addrs[port] = st.sink.HTTPAddr
					}
				}
			}
			for _, v := range s.Volumes {
				in.mounts[path.Clean(v.Target)] = t.TempDir()
			}
			for target, f := range configs {
				in.mounts[target] = f
			}
			st.instances[s.Name] = append(st.instances[s.Name], in)
			hosts = append(hosts, netip.MustParseAddr(ip))
		}
		st.dns.set(s.Name, hosts...)
	}
	for _, ln := range held {
		ln.Close()
	}
	for _, s := range st.startOrder(t) {
		var bin string
		switch {
		case isOsmo(s):
			bin = osmoBin
		case isNATS(s):
			bin = natsServerBin(t)
		default:
			continue
		}
		if s.Name == "rollout" {
			if v := s.Environment["OSMO_API_KEY"]; v != nil {
				st.apiKey = *v
			}
		}
		for _, in := range st.instances[s.Name] {
			in.bin = bin
			for _, a := range s.Command {
				in.args = append(in.args, st.rewrite(t, in, a))
			}
			if isNATS(s) {
				in.args = natsLoopbackArgs(t, in)
			}
			for k, v := range s.Environment {
				if v != nil {
					in.env = append(in.env, k+"="+st.rewrite(t, in, *v))
				}
			}
			sort.Strings(in.env)
			st.start(t, in)
		}
	}
	return st
}

// sharedFreePort returns a port nothing listens on at any of ips, and the
// listeners that hold it there until the caller closes them.
func sharedFreePort(t *testing.T, ips []string) (int, []net.Listener) {
	t.Helper()
	for range 50 {
		ln, err := net.Listen("tcp", net.JoinHostPort(ips[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		lns := []net.Listener{ln}
		for _, ip := range ips[1:] {
			other, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
			if err != nil {
				break
			}
			lns = append(lns, other)
		}
		if len(lns) == len(ips) {
			return port, lns
		}
		for _, l := range lns {
			l.Close()
		}
	}
	t.Fatalf("no port free on all of %v", ips)
	return 0, nil
}

// natsLoopbackArgs points a NATS instance's listen ports (--port,
// --http_port ...) at its stand-in ports and binds it to its loopback IP.
func natsLoopbackArgs(t *testing.T, in *instance) []string {
	t.Helper()
	args := append([]string(nil), in.args...)
	mapPort := func(flag, v string) string {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("service %s: -%s %q: %v", in.spec.Name, flag, v, err)
		}
		addr, ok := in.addrs[n]
		if !ok {
			t.Fatalf("service %s listens on %d (-%s) without exposing it", in.spec.Name, n, flag)
		}
		_, p, _ := net.SplitHostPort(addr)
		return p
	}
	for i := 0; i < len(args); i++ {
		name, value, hasValue := strings.Cut(strings.TrimLeft(args[i], "-"), "=")
		if !strings.HasPrefix(args[i], "-") || !natsPortFlags[name] {
			continue
		}
		if hasValue {
			args[i] = "--" + name + "=" + mapPort(name, value)
		} else if i+1 < len(args) {
			i++
			args[i] = mapPort(name, args[i])
		}
	}
	return append(args, "--addr", in.ip)
}

// start runs an instance's process and waits until it is healthy. The
// process lives until the stack's test ends, even when a subtest started it.
func (st *composeStack) start(t *testing.T, in *instance) {
	t.Helper()
	in.proc = proctest.Start(st.owner, proctest.Cmd{Name: in.name(), Bin: in.bin, Args: in.args, Env: in.env, Grace: 35 * time.Second})
	st.procs = append(st.procs, in.proc)
	st.waitHealthy(t, in)
}

// startOrder sorts the services so each comes after what it depends on.
func (st *composeStack) startOrder(t *testing.T) []types.ServiceConfig {
	t.Helper()
	var order []types.ServiceConfig
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string)
	visit = func(name string) {
		switch state[name] {
		case 1:
			t.Fatalf("depends_on cycle through %s", name)
		case 2:
			return
		}
		state[name] = 1
		s, err := st.project.GetService(name)
		if err != nil {
			t.Fatalf("depends_on names %s: %v", name, err)
		}
		deps := make([]string, 0, len(s.DependsOn))
		for d := range s.DependsOn {
			deps = append(deps, d)
		}
		sort.Strings(deps)
		for _, d := range deps {
			visit(d)
		}
		state[name] = 2
		order = append(order, s)
	}
	names := st.project.ServiceNames()
	sort.Strings(names)
	for _, n := range names {
		visit(n)
	}
	return order
}

// dnsTargetRE is a gRPC target resolved by DNS: dns:///HOST:PORT.
var dnsTargetRE = regexp.MustCompile(`^dns:///([A-Za-z0-9.-]+):(\d{1,5})$`)

// rewrite maps the host:port references in one argument or environment
// value of instance self to the loopback addresses standing in for them
// (dns:/// targets to the in-test DNS server, which knows every replica),
// and a path under one of its mount points to the test's own.
func (st *composeStack) rewrite(t *testing.T, self *instance, s string) string {
	t.Helper()
	for target, p := range self.mounts {
		if s == target || strings.HasPrefix(s, target+"/") {
			return p + strings.TrimPrefix(s, target)
		}
	}
	if m := dnsTargetRE.FindStringSubmatch(s); m != nil {
		if _, ok := st.instances[m[1]]; ok {
			n, _ := strconv.Atoi(m[2])
			_, port, _ := net.SplitHostPort(st.addr(t, m[1], n))
			return "dns://" + st.dns.Addr + "/" + m[1] + ":" + port
		}
	}
	return hostPortRE.ReplaceAllStringFunc(s, func(m string) string {
		g := hostPortRE.FindStringSubmatch(m)
		host := g[2]
		n, _ := strconv.Atoi(g[3])
		ports := self.addrs
		if !localHosts[host] {
			in, ok := st.instances[host]
			if !ok {
				return m // not a compose service: leave it alone
			}
			ports = in[0].addrs
		}
		addr, ok := ports[n]
		if !ok {
			t.Fatalf("service %s refers to %s:%d, which %s does not declare", self.spec.Name, host, n, host)
		}
		return g[1] + addr
	})
}

// rewriteFor rewrites a value as the first replica of service would see it.
func (st *composeStack) rewriteFor(t *testing.T, service, s string) string {
	t.Helper()
	return st.rewrite(t, st.instances[service][0], s)
}

// addr is the loopback address standing in for service:port (its first
// replica's).
func (st *composeStack) addr(t *testing.T, service string, port int) string {
	t.Helper()
	ins := st.instances[service]
	if len(ins) == 0 {
		t.Fatalf("no service %s", service)
	}
	a, ok := ins[0].addrs[port]
	if !ok {
		t.Fatalf("%s does not declare port %d", service, port)
	}
	return a
}

// waitHealthy runs the instance's compose healthcheck, rewritten like its
// command, until it passes: an osmo service's `/osmo health ...` with the
// binary under test, and for others the URL their check fetches.
func (st *composeStack) waitHealthy(t *testing.T, in *instance) {
	t.Helper()
	s := in.spec
	if s.HealthCheck == nil || len(s.HealthCheck.Test) < 2 || s.HealthCheck.Test[0] != "CMD" {
		t.Fatalf("service %s: no CMD healthcheck", s.Name)
	}
	var probe func(ctx context.Context) ([]byte, error)
	if isOsmo(s) {
		argv := make([]string, 0, len(s.HealthCheck.Test)-2)
		for _, a := range s.HealthCheck.Test[2:] {
			argv = append(argv, st.rewrite(t, in, a))
		}
		probe = func(ctx context.Context) ([]byte, error) {
			return exec.CommandContext(ctx, osmoBin, argv...).CombinedOutput()
		}
	} else {
		var url string
		for _, a := range s.HealthCheck.Test[1:] {
			if strings.HasPrefix(a, "http://") {
				url = st.rewrite(t, in, a)
			}
		}
		if url == "" {
			t.Fatalf("service %s: healthcheck %q fetches no http:// URL", s.Name, s.HealthCheck.Test)
		}
		probe = func(ctx context.Context) ([]byte, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			if err != nil {
				return nil, err
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return nil, err
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			if resp.StatusCode != http.StatusOK {
				return b, fmt.Errorf("GET %s: %s", url, resp.Status)
			}
			return b, nil
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	var last []byte
	for time.Now().Before(deadline) {
		if in.proc.Exited() {
			t.Fatalf("service %s exited before it was healthy:\n%s", in.name(), in.proc.Output())
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		out, err := probe(ctx)
		cancel()
		if err == nil {
			return
		}
		last = append(out, []byte(err.Error())...)
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("service %s: healthcheck %q never passed; last output %s\nservice output:\n%s", in.name(), s.HealthCheck.Test, last, in.proc.Output())
}

// stop ends every process, last started first, each with SIGTERM and the
// compose stop_grace_period before SIGKILL.
func (st *composeStack) stop() {
	for i := len(st.procs) - 1; i >= 0; i-- {
		st.procs[i].Stop(syscall.SIGTERM, 35*time.Second)
	}
}

// proc is a running process and its combined output.
type proc = proctest.Proc

// trainer is the G1 controller of internal/controller, playing the
// training cluster: it serves server_url, forwarding the rollout service's
// LLM calls to the compose stack's mockllm, and collects completions.
func startTrainer(t *testing.T, st *composeStack) *controller.Controller {
	t.Helper()
	ctl, err := controller.New("127.0.0.1:0", controller.Options{
		PolicyURL: "http://" + st.addr(t, "mockllm", 9003) + "/v1",
		APIKey:    "trainer-callback-key",
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = ctl.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return ctl
}

// calculatorInit is a G1 init for the calculator workflow.
func calculatorInit(id, question, answer string) controller.InitRequest {
	return controller.InitRequest{
		RolloutID: id,
		Messages: []map[string]any{
			{"role": "system", "content": "You are a calculator. Use the tools, then answer with '#### <number>'."},
			{"role": "user", "content": question},
		},
		CompletionParams: map[string]any{"temperature": 1.0, "max_tokens": 256, "logprobs": true},
		Metadata:         map[string]any{"ground_truth": answer},
	}
}

// request sends one HTTP request and returns the status and body.
func request(ctx context.Context, t *testing.T, method, url, key, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, url, err)
	}
	return resp.StatusCode, b
}

// rolloutRecord is the part of GET /v1/rollouts/{id} the tests read.
type rolloutRecord struct {
	State         string `json:"state"`
	CallbackError string `json:"callback_error"`
	Samples       []struct {
		Reward   *float64 `json:"reward"`
		LLMCalls []any    `json:"llm_calls"`
	} `json:"samples"`
}

// waitRecord polls GET /v1/rollouts/{id} until the rollout left the
// running states.
func waitRecord(ctx context.Context, t *testing.T, base, key, id string) rolloutRecord {
	t.Helper()
	for {
		code, body := request(ctx, t, http.MethodGet, base+"/v1/rollouts/"+id, key, "")
		if code == http.StatusOK {
			var rec rolloutRecord
			if err := json.Unmarshal(body, &rec); err != nil {
				t.Fatalf("GET /v1/rollouts/%s: %v: %s", id, err, body)
			}
			switch rec.State {
			case "STATE_SUCCEEDED", "STATE_FAILED", "STATE_CANCELLED":
				return rec
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("rollout %s did not finish: last answer %d %s", id, code, body)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TestComposeStackServesG1Rollout runs the compose services as processes and
// drives them as a training cluster would through the gateway: the G1
// rollout completes with reward 1.0, and the requests docs/deploy.md and the
// README show work against the stack.
func TestComposeStackServesG1Rollout(t *testing.T) {
	st := startComposeStack(t)
	if st.apiKey == "" {
		t.Fatal("the rollout service got no OSMO_API_KEY from .env")
	}
	ctl := startTrainer(t, st)
	base := "http://" + st.addr(t, "gateway", 9000)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	t.Run("health needs no key", func(t *testing.T) {
		code, body := request(ctx, t, http.MethodGet, base+"/health", "", "")
		if code != http.StatusOK || !bytes.Contains(body, []byte(`"healthy"`)) {
			t.Fatalf("GET /health: %d %s", code, body)
		}
	})

	t.Run("init without the key from .env is refused", func(t *testing.T) {
		code, body, err := ctl.Init(ctx, base, "", calculatorInit("compose-nokey", "What is 2 + 2?", "4"))
		if err != nil || code != http.StatusUnauthorized {
			t.Fatalf("init without key: %d %s %v; want 401", code, body, err)
		}
	})

	t.Run("G1 rollout completes with reward 1.0", func(t *testing.T) {
		const id = "compose-g1-1"
		code, body, err := ctl.Init(ctx, base, st.apiKey, calculatorInit(id, "What is 6 * 7?", "42"))
		if err != nil || code != http.StatusAccepted {
			t.Fatalf("init: %d %s %v", code, body, err)
		}
		var accepted struct {
			RolloutID string           `json:"rollout_id"`
			Tools     []map[string]any `json:"tools"`
		}
		if err := json.Unmarshal(body, &accepted); err != nil || accepted.RolloutID != id || len(accepted.Tools) == 0 {
			t.Fatalf("init answer %s (%v): want the rollout id and the workflow's tools", body, err)
		}
		comp, err := ctl.Wait(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if comp.Status != "COMPLETED" || comp.Reward == nil || *comp.Reward != 1.0 {
			t.Fatalf("completion: %s", comp.Raw)
		}
		if n := len(ctl.Completions(id)); n != 1 {
			t.Errorf("%d completions for %s, want exactly 1", n, id)
		}
		calls := 0
		for _, c := range ctl.Chats() {
			if c.Body["rollout_id"] == id {
				calls++
			}
		}
		if calls == 0 {
			t.Error("the trainer served no LLM call for the rollout")
		}
		rec := waitRecord(ctx, t, base, st.apiKey, id)
		if rec.State != "STATE_SUCCEEDED" || rec.CallbackError != "" || len(rec.Samples) == 0 || rec.Samples[0].Reward == nil || *rec.Samples[0].Reward != 1.0 {
			t.Fatalf("GET /v1/rollouts/%s: %+v", id, rec)
		}
	})

	// docs/deploy.md's curl smoke test, with the body the docs show: with
	// mockllm as server_url the LLM calls work and the grader sets the
	// reward; the completion post fails (mockllm is no trainer), which the
	// record reports.
	t.Run("the documented curl smoke test", func(t *testing.T) {
		body := docsDemoInit(t)
		var in struct {
			RolloutID string `json:"rollout_id"`
			ServerURL string `json:"server_url"`
		}
		if err := json.Unmarshal([]byte(body), &in); err != nil {
			t.Fatalf("the documented init body is no JSON: %v", err)
		}
		if in.ServerURL != "http://mockllm:9003" {
			t.Fatalf("the documented server_url is %q, want the compose mockllm", in.ServerURL)
		}
		body = strings.Replace(body, in.ServerURL, st.rewriteFor(t, "rollout", in.ServerURL), 1)
		code, answer := request(ctx, t, http.MethodPost, base+"/v1/rollout/init", st.apiKey, body)
		if code != http.StatusAccepted {
			t.Fatalf("init: %d %s", code, answer)
		}
		rec := waitRecord(ctx, t, base, st.apiKey, in.RolloutID)
		if rec.State != "STATE_SUCCEEDED" || len(rec.Samples) == 0 || rec.Samples[0].Reward == nil || *rec.Samples[0].Reward != 1.0 || len(rec.Samples[0].LLMCalls) == 0 {
			t.Fatalf("GET /v1/rollouts/%s: %+v", in.RolloutID, rec)
		}
		if !strings.Contains(rec.CallbackError, "404") {
			t.Errorf("callback_error %q, want the trainer-less 404 the docs describe", rec.CallbackError)
		}
	})

	t.Run("the services keep their state in NATS JetStream on its volume", func(t *testing.T) {
		checkNATSHoldsState(ctx, t, st)
	})

	t.Run("either rollout replica serves alone", func(t *testing.T) {
		// The gateway's dns:/// target knows both replicas: with either
		// one stopped, an init through the gateway still runs to its
		// completion, on the other.
		rollouts := st.instances["rollout"]
		if len(rollouts) < 2 {
			t.Fatalf("rollout runs %d replica(s)", len(rollouts))
		}
		for i, down := range rollouts {
			func() {
				down.proc.Stop(syscall.SIGTERM, 35*time.Second)
				// Both run again afterwards, for the subtests below.
				defer st.start(t, down)
				ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				defer cancel()
				id := fmt.Sprintf("compose-alone-%d", i+1)
				initUntilAccepted(ctx, t, ctl, base, st.apiKey, calculatorInit(id, "What is 5 * 5?", "25"))
				comp, err := ctl.Wait(ctx, id)
				if err != nil {
					t.Fatalf("with %s stopped: %v", down.name(), err)
				}
				if comp.Status != "COMPLETED" || comp.Reward == nil || *comp.Reward != 1.0 {
					t.Fatalf("with %s stopped, completion %s", down.name(), comp.Raw)
				}
			}()
		}
	})

	t.Run("Connect JSON as in the README", func(t *testing.T) {
		code, body := request(ctx, t, http.MethodPost, base+"/osmo.rollout.v1.RolloutService/Health", st.apiKey, "{}")
		if code != http.StatusOK {
			t.Fatalf("Connect Health: %d %s", code, body)
		}
	})

	t.Run("llmproxy forwards to the policy", func(t *testing.T) {
		// The path form binds the call to a rollout and sample for clients
		// that cannot set the x-rollout-id / x-sample-id headers.
		url := "http://" + st.addr(t, "llmproxy", 9002) + "/r/compose-proxy-1/s/0/v1/chat/completions"
		code, body := request(ctx, t, http.MethodPost, url, "", `{"model":"openai/osmosis-rollout","messages":[{"role":"user","content":"What is 2 + 3?"}]}`)
		if code != http.StatusOK || !bytes.Contains(body, []byte(`"choices"`)) {
			t.Fatalf("POST %s: %d %s", url, code, body)
		}
		url = "http://" + st.addr(t, "llmproxy", 9002) + "/r/compose-proxy-1/calls"
		code, body = request(ctx, t, http.MethodGet, url, "", "")
		if code != http.StatusOK || !bytes.Contains(body, []byte("What is 2 + 3?")) {
			t.Fatalf("GET %s: %d %s; want the recorded call", url, code, body)
		}
	})

	t.Run("every service serves Prometheus metrics", func(t *testing.T) {
		for _, target := range []struct {
			service string
			port    int
			want    string
			key     string // the gateway's port serves the API: its /metrics needs the key
		}{
			{"rollout", 9464, "osmo_rollouts_finished_total", ""},
			{"grader", 9465, "osmo_grader_gradings_total", ""},
			{"gateway", 9000, "go_goroutines", st.apiKey},
			{"mockllm", 9003, "go_goroutines", ""},
			{"llmproxy", 9002, "go_goroutines", ""},
		} {
			url := fmt.Sprintf("http://%s/metrics", st.addr(t, target.service, target.port))
			if target.key != "" {
				if code, _ := request(ctx, t, http.MethodGet, url, "", ""); code != http.StatusUnauthorized {
					t.Errorf("GET %s (%s) without the key: %d, want 401", url, target.service, code)
				}
			}
			code, body := request(ctx, t, http.MethodGet, url, target.key, "")
			if code != http.StatusOK || !bytes.Contains(body, []byte(target.want)) {
				t.Errorf("GET %s (%s): %d, want 200 with %s", url, target.service, code, target.want)
			}
		}
	})
}

// initUntilAccepted posts a G1 init until the gateway accepts it, as a
// trainer retries: while a rollout replica is away, the gateway may answer
// 503 until its connection to the other one is ready. The init is
// idempotent by rollout id.
func initUntilAccepted(ctx context.Context, t *testing.T, ctl *controller.Controller, base, key string, req controller.InitRequest) {
	t.Helper()
	for {
		code, body, err := ctl.Init(ctx, base, key, req)
		if err == nil && code == http.StatusAccepted {
			return
		}
		if err == nil && code < 500 {
			t.Fatalf("init %s: %d %s", req.RolloutID, code, body)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("init %s never accepted: last %d %s %v", req.RolloutID, code, body, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// checkNATSHoldsState checks, after rollouts ran, that the compose NATS
// server is the one the services share: every rollout replica and the
// grader are connected to it, JetStream holds streams with messages, its
// files are on the service's volume, and it runs with the compose file's
// max_payload.
func checkNATSHoldsState(ctx context.Context, t *testing.T, st *composeStack) {
	t.Helper()
	n, _ := st.project.GetService("nats")
	mon := "http://" + st.addr(t, "nats", composeNATSOptions(t, st.project, n).HTTPPort)
	get := func(path string, v any) {
		t.Helper()
		code, body := request(ctx, t, http.MethodGet, mon+path, "", "")
		if code != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, code, body)
		}
		if err := json.Unmarshal(body, v); err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
	}
	var varz struct {
		MaxPayload int `json:"max_payload"`
	}
	get("/varz", &varz)
	if varz.MaxPayload != natsstore.DefaultMaxPayload {
		t.Errorf("nats runs with max_payload %d, want the compose config's %d", varz.MaxPayload, natsstore.DefaultMaxPayload)
	}
	want := len(st.instances["rollout"]) + len(st.instances["grader"])
	var connz struct {
		NumConns int `json:"num_connections"`
	}
	get("/connz", &connz)
	if connz.NumConns < want {
		t.Errorf("%d connections to nats, want at least %d (every rollout replica and the grader)", connz.NumConns, want)
	}
	var jsz struct {
		Streams  int    `json:"streams"`
		Messages uint64 `json:"messages"`
		Config   struct {
			StoreDir string `json:"store_dir"`
		} `json:"config"`
	}
	get("/jsz", &jsz)
	if jsz.Streams == 0 || jsz.Messages == 0 {
		t.Errorf("JetStream holds %d streams, %d messages; want the services' state", jsz.Streams, jsz.Messages)
	}
	dir := st.instances["nats"][0].mounts[path.Clean(composeNATSOptions(t, st.project, n).StoreDir)]
	var files int
	_ = filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files++
		}
		return nil
	})
	if dir == "" || !strings.HasPrefix(jsz.Config.StoreDir, dir) || files == 0 {
		t.Errorf("JetStream stores in %q (%d files in the volume's %q), want the nats-data volume", jsz.Config.StoreDir, files, dir)
	}
}

// TestComposeStackExportsTraces runs a G1 rollout through the compose
// services and checks that the gateway, the rollout service and the grader
// export spans over OTLP to the endpoint the compose file names (Jaeger's
// gRPC port, here the in-test sink), carrying the rollout id.
func TestComposeStackExportsTraces(t *testing.T) {
	st := startComposeStack(t)
	ctl := startTrainer(t, st)
	base := "http://" + st.addr(t, "gateway", 9000)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const id = "compose-trace-1"
	code, body, err := ctl.Init(ctx, base, st.apiKey, calculatorInit(id, "What is 9 * 9?", "81"))
	if err != nil || code != http.StatusAccepted {
		t.Fatalf("init: %d %s %v", code, body, err)
	}
	comp, err := ctl.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if comp.Status != "COMPLETED" {
		t.Fatalf("completion: %s", comp.Raw)
	}
	// A graceful stop flushes the exporters' batches.
	st.stop()
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
	defer wcancel()
	missing, err := st.sink.waitFor(wctx, "osmo-gateway", "osmo-rollout", "osmo-grader", id)
	if err != nil {
		t.Fatalf("after %d OTLP exports, none mentions %q", st.sink.count(), missing)
	}
}
