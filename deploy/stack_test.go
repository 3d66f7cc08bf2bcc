package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/types"

	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/proctest"
)

// composeStack runs the osmo services of docker-compose.yml as processes on
// loopback, each with exactly the command and environment the compose file
// gives it. Only what a container has to itself changes, because every
// service shares one host: a service name becomes 127.0.0.1, each (service,
// container port) pair becomes its own free loopback port, the same one
// everywhere it is named, and each volume mount point becomes a directory of
// the test's own. Jaeger's OTLP ports become an in-test OTLP sink.
type composeStack struct {
	project *types.Project
	addrs   map[string]map[int]string    // service -> container port -> 127.0.0.1:N
	mounts  map[string]map[string]string // service -> mount target -> test directory
	sink    *otlpSink
	procs   []*proc // in start order
	apiKey  string  // OSMO_API_KEY the rollout service got from .env
}

// startComposeStack starts every osmo service of the compose file, every
// profile enabled, in depends_on order, and waits for each one's own
// healthcheck command to pass before starting what depends on it.
func startComposeStack(t *testing.T) *composeStack {
	t.Helper()
	st := &composeStack{
		project: composeProject(t, true),
		addrs:   map[string]map[int]string{},
		mounts:  map[string]map[string]string{},
		sink:    startOTLPSink(t),
	}
	for _, s := range st.project.Services {
		st.mounts[s.Name] = map[string]string{}
		for _, v := range s.Volumes {
			st.mounts[s.Name][path.Clean(v.Target)] = t.TempDir()
		}
		st.addrs[s.Name] = map[int]string{}
		for port := range exposedPorts(t, s) {
			addr := freeAddr(t)
			if s.Name == "jaeger" {
				switch port {
				case 4317:
					addr = st.sink.GRPCAddr
				case 4318:
					addr = st.sink.HTTPAddr
				}
			}
			st.addrs[s.Name][port] = addr
		}
	}
	for _, s := range st.startOrder(t) {
		if !isOsmo(s) {
			continue
		}
		args := make([]string, len(s.Command))
		for i, a := range s.Command {
			args[i] = st.rewrite(t, s.Name, a)
		}
		var env []string
		for k, v := range s.Environment {
			if v != nil {
				env = append(env, k+"="+st.rewrite(t, s.Name, *v))
			}
		}
		sort.Strings(env)
		if s.Name == "rollout" {
			if v := s.Environment["OSMO_API_KEY"]; v != nil {
				st.apiKey = *v
			}
		}
		p := startProc(t, s.Name, env, args)
		st.procs = append(st.procs, p)
		st.waitHealthy(t, s, p)
	}
	return st
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

// rewrite maps the host:port references in one argument or environment
// value of service self to the loopback addresses standing in for them, and
// a path under one of its mount points to the test's directory.
func (st *composeStack) rewrite(t *testing.T, self, s string) string {
	t.Helper()
	for target, dir := range st.mounts[self] {
		if s == target || strings.HasPrefix(s, target+"/") {
			return dir + strings.TrimPrefix(s, target)
		}
	}
	return hostPortRE.ReplaceAllStringFunc(s, func(m string) string {
		g := hostPortRE.FindStringSubmatch(m)
		host := g[2]
		svc := host
		if localHosts[host] {
			svc = self
		}
		ports, ok := st.addrs[svc]
		if !ok {
			return m // not a compose service: leave it alone
		}
		n, _ := strconv.Atoi(g[3])
		addr, ok := ports[n]
		if !ok {
			t.Fatalf("service %s refers to %s:%d, which %s does not declare", self, host, n, svc)
		}
		return g[1] + addr
	})
}

// addr is the loopback address standing in for service:port.
func (st *composeStack) addr(t *testing.T, service string, port int) string {
	t.Helper()
	a, ok := st.addrs[service][port]
	if !ok {
		t.Fatalf("%s does not declare port %d", service, port)
	}
	return a
}

// waitHealthy runs the service's compose healthcheck, rewritten like its
// command, until it passes.
func (st *composeStack) waitHealthy(t *testing.T, s types.ServiceConfig, p *proc) {
	t.Helper()
	if s.HealthCheck == nil || len(s.HealthCheck.Test) < 2 || s.HealthCheck.Test[0] != "CMD" {
		t.Fatalf("service %s: no CMD healthcheck", s.Name)
	}
	argv := make([]string, 0, len(s.HealthCheck.Test)-2)
	for _, a := range s.HealthCheck.Test[2:] {
		argv = append(argv, st.rewrite(t, s.Name, a))
	}
	deadline := time.Now().Add(30 * time.Second)
	var last []byte
	for time.Now().Before(deadline) {
		if p.Exited() {
			t.Fatalf("service %s exited before it was healthy:\n%s", s.Name, p.Output())
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		out, err := exec.CommandContext(ctx, osmoBin, argv...).CombinedOutput()
		cancel()
		if err == nil {
			return
		}
		last = out
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("service %s: healthcheck %q never passed; last output %s\nservice output:\n%s", s.Name, argv, last, p.Output())
}

// stop ends every process, last started first, each with SIGTERM and the
// compose stop_grace_period before SIGKILL.
func (st *composeStack) stop() {
	for i := len(st.procs) - 1; i >= 0; i-- {
		st.procs[i].Stop(syscall.SIGTERM, 35*time.Second)
	}
}

func freeAddr(t *testing.T) string { return proctest.FreeAddr(t) }

// proc is a running osmo process and its combined output.
type proc = proctest.Proc

// startProc runs osmo with exactly env as its environment, in its own
// process group; cleanup stops it and shows its output if the test failed.
func startProc(t *testing.T, name string, env, args []string) *proc {
	t.Helper()
	return proctest.Start(t, proctest.Cmd{Name: name, Bin: osmoBin, Args: args, Env: env, Grace: 35 * time.Second})
}

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
		for _, c := range ctl.ChatCalls() {
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
		body = strings.Replace(body, in.ServerURL, st.rewrite(t, "rollout", in.ServerURL), 1)
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

	t.Run("the grader journals to its volume", func(t *testing.T) {
		g, _ := st.project.GetService("grader")
		journal, _ := composeCmd(t, g).last("journal")
		b, err := os.ReadFile(st.rewrite(t, "grader", journal))
		if err != nil || !bytes.Contains(b, []byte("compose-g1-1")) {
			t.Fatalf("journal %s: %v; want the graded rollout in it", journal, err)
		}
	})

	t.Run("the rollout service logs its state to its volume", func(t *testing.T) {
		r, _ := st.project.GetService("rollout")
		dir, _ := composeCmd(t, r).last("state")
		b, err := os.ReadFile(path.Join(st.rewrite(t, "rollout", dir), "rollouts.wal"))
		if err != nil || !bytes.Contains(b, []byte("compose-g1-1")) {
			t.Fatalf("state log in %s: %v; want the rollout in it", dir, err)
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
		}{
			{"rollout", 9464, "osmo_rollouts_finished_total"},
			{"grader", 9465, "osmo_grader_gradings_total"},
			{"gateway", 9000, "go_goroutines"},
			{"mockllm", 9003, "go_goroutines"},
			{"llmproxy", 9002, "go_goroutines"},
		} {
			url := fmt.Sprintf("http://%s/metrics", st.addr(t, target.service, target.port))
			code, body := request(ctx, t, http.MethodGet, url, "", "")
			if code != http.StatusOK || !bytes.Contains(body, []byte(target.want)) {
				t.Errorf("GET %s (%s): %d, want 200 with %s", url, target.service, code, target.want)
			}
		}
	})
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
