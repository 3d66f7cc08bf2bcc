package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// jaegerBin is the Jaeger v2 all-in-one binary: $OSMO_JAEGER_BIN (the test
// script builds it first), else built here by scripts/jaeger.sh, which takes
// minutes the first time and is cached under ~/.cache/osmo afterwards.
func jaegerBin(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv("OSMO_JAEGER_BIN"); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("OSMO_JAEGER_BIN: %v", err)
		}
		return bin
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", filepath.Join("..", "scripts", "jaeger.sh"))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("scripts/jaeger.sh: %v\n%s", err, out.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	return lines[len(lines)-1]
}

// jaeger is a running Jaeger all-in-one with in-memory storage, every port
// on loopback.
type jaeger struct {
	otlpGRPC, otlpHTTP string // host:port of the OTLP receivers
	query              string // base URL of the query API
}

// jaegerConfig is a minimal all-in-one configuration: OTLP receivers, a
// memory store, the query API; no telemetry of its own.
const jaegerConfig = `service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    traces:
      level: none
    logs:
      level: warn
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: %[1]s
  jaeger_query:
    # Its own tracing would export to localhost:4317 and hold up shutdown.
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: %[2]s
    grpc:
      endpoint: %[3]s
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: %[4]s
      http:
        endpoint: %[5]s
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
`

func startJaeger(t *testing.T) *jaeger {
	t.Helper()
	bin := jaegerBin(t)
	health, query, queryGRPC := freeAddr(t), freeAddr(t), freeAddr(t)
	j := &jaeger{otlpGRPC: freeAddr(t), otlpHTTP: freeAddr(t), query: "http://" + query}
	cfg := filepath.Join(t.TempDir(), "jaeger.yaml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, jaegerConfig, health, query, queryGRPC, j.otlpGRPC, j.otlpHTTP), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startBin(t, "jaeger", bin, nil, "--config", cfg)
	waitHTTP(t, p, "http://"+health+"/status")
	waitHTTP(t, p, j.query+"/api/services")
	return j
}

// jaegerTrace is a trace as the Jaeger query API answers it.
type jaegerTrace struct {
	TraceID string       `json:"traceID"`
	Spans   []jaegerSpan `json:"spans"`
	// Processes maps processID to the process: its service.
	Processes map[string]struct {
		ServiceName string `json:"serviceName"`
	} `json:"processes"`
}

type jaegerSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		TraceID string `json:"traceID"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	Tags []struct {
		Key   string `json:"key"`
		Value any    `json:"value"`
	} `json:"tags"`
	ProcessID string `json:"processID"`
}

func (s jaegerSpan) tag(key string) (any, bool) {
	for _, t := range s.Tags {
		if t.Key == key {
			return t.Value, true
		}
	}
	return nil, false
}

func (s jaegerSpan) parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

// getTraces calls the query API at path and decodes its traces.
func (j *jaeger) getTraces(ctx context.Context, path string) ([]jaegerTrace, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, j.query+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode == http.StatusNotFound {
		return nil, nil // not there yet
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %d %s", path, resp.StatusCode, body)
	}
	var out struct {
		Data []jaegerTrace `json:"data"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		return nil, fmt.Errorf("GET %s: %w: %s", path, err, body)
	}
	return out.Data, nil
}

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// TestTraceInJaeger runs the stack exporting to a real Jaeger, split into
// processes (the grader over OTLP/gRPC, the others over OTLP/HTTP) and as
// one `osmo serve`, drives one calculator rollout through the gateway with a
// trainer's traceparent, and checks in Jaeger that the whole rollout is one
// trace, the trainer's, in the same services either way: every span carries
// the rollout id and has its parent in the trace (but the gateway's, whose
// parent is the trainer's span), the LLM calls, tool calls and grading sit
// under the rollout span, and the trace context reached the policy.
func TestTraceInJaeger(t *testing.T) {
	j := startJaeger(t)
	mockAddr := startMockPolicy(t)

	common := []string{"OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_TRACES_SAMPLER=parentbased_always_on"}
	overGRPC := append([]string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + j.otlpGRPC, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"}, common...)
	overHTTP := append([]string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + j.otlpHTTP, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"}, common...)
	for _, deployment := range []struct {
		name  string
		start func(t *testing.T) (base string)
	}{
		{"split", func(t *testing.T) string {
			gr, addrs := startListening(t, "grader", overGRPC, "grader", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--grader", "calculator", "--log-level", "warn")
			graderAddr := addrs["grpc"]
			waitGRPC(t, gr, graderAddr)
			roll, addrs := startListening(t, "rollout", overHTTP, "rollout", "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "", "--grader-addr", graderAddr,
				"--workflow", "calculator", "--model", "policy-v1", "--log-level", "warn")
			rolloutAddr := addrs["grpc"]
			waitGRPC(t, roll, rolloutAddr)
			gw, addrs := startListening(t, "gateway", overHTTP, "gateway", "--addr", "127.0.0.1:0", "--rollout-addr", rolloutAddr, "--grader-addr", graderAddr, "--log-level", "warn")
			waitHTTP(t, gw, addrs["http"]+"/health")
			return addrs["http"]
		}},
		{"serve", func(t *testing.T) string {
			srv, addrs := startListening(t, "serve", overGRPC, "serve", "--workflow", "calculator", "--model", "policy-v1", "-p", "0", "-H", "127.0.0.1", "--log-level", "warn")
			waitHTTP(t, srv, addrs["http"]+"/health")
			return addrs["http"]
		}},
	} {
		t.Run(deployment.name, func(t *testing.T) {
			ctl := startG1Controller(t, controller.Options{PolicyURL: "http://" + mockAddr + "/v1"})
			checkRolloutTrace(t, j, ctl, deployment.start(t), "jaeger-"+deployment.name)
		})
	}

	// A G2 rollout whose agent is another language's program: it sends no
	// trace context of its own, and its LLM calls must still land in the
	// trainer's trace, as must the grading and both callbacks.
	t.Run("g2-exec", func(t *testing.T) {
		s := startG2(t, nil, overGRPC, "--exec", strings.Join(python("python-stdlib/agent.py")(t), " "), "--grader", "multiply")
		const id = "jaeger-g2"
		traceID, trainerSpan := randomHex(t, 16), randomHex(t, 8)
		body := s.ctl.StartBody(id, []map[string]any{{"role": "user", "content": "What is 6 times 7?"}})
		body["label"] = "42"
		body["agent_timeout_sec"] = 60
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		code, _, data, err := s.ctl.StartWithHeader(ctx, s.base, serverKey, http.Header{"Traceparent": {"00-" + traceID + "-" + trainerSpan + "-01"}}, body)
		if err != nil || code != http.StatusAccepted {
			t.Fatalf("POST /rollout: %d %s %v", code, data, err)
		}
		comp, grade := s.callbacks(t, id)
		if sample := grade.Samples["exec"]; comp.Status != "success" || sample.Reward == nil || *sample.Reward != 1 {
			t.Fatalf("completion %s\ngrader callback %s", comp.Raw, grade.Raw)
		}
		chats := s.ctl.Chats()
		if len(chats) < 2 {
			t.Fatalf("%d LLM calls, want a tool call and an answer", len(chats))
		}
		for i, c := range chats {
			if tp := c.Header.Get("Traceparent"); !strings.HasPrefix(tp, "00-"+traceID+"-") {
				t.Errorf("LLM call %d reached the controller with traceparent %q, want trace %s", i, tp, traceID)
			}
		}
		checkTrace(t, ctx, j, traceSpec{
			id: id, traceID: traceID, trainerSpan: trainerSpan,
			gatewayOp: "POST /rollout",
			ops: map[string]string{
				"POST /rollout":               "osmo-gateway",
				"rollout":                     "osmo-rollout",
				"invoke_agent exec":           "osmo-rollout",
				"deliver_completion_callback": "osmo-rollout",
				"deliver_grader_callback":     "osmo-rollout",
				"chat openai/osmosis-rollout": "osmo-llmproxy",
				"run_grader multiply":         "osmo-grader",
			},
			underRollout: []string{"chat ", "invoke_agent ", "grade", "run_grader ", "deliver_"},
		})
	})
}

// checkRolloutTrace drives rollout id through the gateway at base and
// checks its trace in Jaeger.
func checkRolloutTrace(t *testing.T, j *jaeger, ctl *controller.Controller, base, id string) {
	// The trainer's own span, which Jaeger never receives.
	traceID, trainerSpan := randomHex(t, 16), randomHex(t, 8)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	code, body, err := ctl.Init(ctx, base, "", controller.InitRequest{
		RolloutID:        id,
		Messages:         []map[string]any{{"role": "user", "content": "What is 6 * 7?"}},
		CompletionParams: map[string]any{"temperature": 0.5, "max_tokens": 128},
		Metadata:         map[string]any{"ground_truth": "42"},
		Header:           http.Header{"Traceparent": {"00-" + traceID + "-" + trainerSpan + "-01"}},
	})
	if err != nil || code != http.StatusAccepted {
		t.Fatalf("init: %d %s %v", code, body, err)
	}
	comp, err := ctl.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if comp.Status != "COMPLETED" || comp.Reward == nil || *comp.Reward != 1 {
		t.Fatalf("completion: %s", comp.Raw)
	}

	// The policy saw the trainer's trace on every LLM call.
	chats := ctl.Chats()
	if len(chats) < 2 {
		t.Fatalf("%d LLM calls, want a tool call and an answer", len(chats))
	}
	for i, c := range chats {
		if tp := c.Header.Get("Traceparent"); !strings.HasPrefix(tp, "00-"+traceID+"-") {
			t.Errorf("LLM call %d reached the policy with traceparent %q, want trace %s", i, tp, traceID)
		}
	}

	tr := checkTrace(t, ctx, j, traceSpec{
		id: id, traceID: traceID, trainerSpan: trainerSpan,
		gatewayOp: "POST /v1/rollout/init",
		ops: map[string]string{ // operation -> service
			"POST /v1/rollout/init":      "osmo-gateway",
			"rollout":                    "osmo-rollout",
			"invoke_agent calculator":    "osmo-rollout",
			"execute_tool multiply":      "osmo-rollout",
			"deliver_completion":         "osmo-rollout",
			"POST /v1/rollout/completed": "osmo-rollout",
			"chat policy-v1":             "osmo-llmproxy",
			"run_grader calculator":      "osmo-grader",
		},
		underRollout: []string{"chat ", "execute_tool ", "grade", "run_grader calculator", "deliver_completion"},
	})
	for _, s := range tr.Spans {
		service := tr.Processes[s.ProcessID].ServiceName
		if strings.HasPrefix(s.OperationName, "chat ") {
			for key, want := range map[string]any{
				"gen_ai.operation.name":      "chat",
				"gen_ai.provider.name":       "openai",
				"gen_ai.request.model":       "policy-v1",
				"osmo.llm.requested_model":   "openai/osmosis-rollout",
				"gen_ai.request.temperature": 0.5,
				"gen_ai.request.max_tokens":  float64(128),
				"osmo.sample.id":             "calculator",
				"span.kind":                  "client",
			} {
				if got, _ := s.tag(key); got != want {
					t.Errorf("chat span: %s = %v (%T), want %v", key, got, got, want)
				}
			}
			for _, key := range []string{"gen_ai.response.id", "gen_ai.response.finish_reasons", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"} {
				if _, ok := s.tag(key); !ok {
					t.Errorf("chat span lacks %s", key)
				}
			}
		}
		if s.OperationName == "grade" && service == "osmo-grader" {
			if got, _ := s.tag("osmo.reward"); got != float64(1) {
				t.Errorf("grader's grade span: osmo.reward = %v, want 1", got)
			}
		}
	}
}

// traceSpec is what the trace of one finished rollout must hold.
type traceSpec struct {
	id, traceID string
	// trainerSpan is the trainer's span, which Jaeger never receives: only
	// the gateway's gatewayOp span may hang from it.
	trainerSpan, gatewayOp string
	// ops are operations the trace must have, each with its service.
	ops map[string]string
	// underRollout are operations (or prefixes of them) that must descend
	// from the rollout span.
	underRollout []string
}

// checkTrace waits until Jaeger holds the whole trace of spec.id (spans
// arrive in batches from several processes) and checks that it is one
// connected trace: every span carries the rollout id and has its parent in
// the trace (but the gateway's, child of the trainer's span), the
// underRollout operations sit under the rollout span, and Jaeger's tag
// search finds the trace from every service.
func checkTrace(t *testing.T, ctx context.Context, j *jaeger, spec traceSpec) jaegerTrace {
	t.Helper()
	missing := func(tr jaegerTrace) []string {
		var out []string
		for op, svc := range spec.ops {
			found := false
			for _, s := range tr.Spans {
				if s.OperationName == op && tr.Processes[s.ProcessID].ServiceName == svc {
					found = true
				}
			}
			if !found {
				out = append(out, svc+": "+op)
			}
		}
		graded := 0
		for _, s := range tr.Spans {
			if s.OperationName == "grade" {
				graded++
			}
		}
		if graded < 2 {
			out = append(out, "grade (rollout and grader)")
		}
		slices.Sort(out)
		return out
	}
	var (
		tr   jaegerTrace
		lack []string
	)
	for {
		traces, err := j.getTraces(ctx, "/api/traces/"+spec.traceID)
		if err != nil {
			t.Fatal(err)
		}
		if len(traces) == 1 {
			tr = traces[0]
			if lack = missing(tr); len(lack) == 0 {
				break
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("trace %s never got complete in Jaeger; missing %q; spans: %s", spec.traceID, lack, describe(tr))
		case <-time.After(200 * time.Millisecond):
		}
	}

	spans := map[string]jaegerSpan{}
	for _, s := range tr.Spans {
		spans[s.SpanID] = s
	}
	service := func(s jaegerSpan) string { return tr.Processes[s.ProcessID].ServiceName }
	var rolloutSpan jaegerSpan
	for _, s := range tr.Spans {
		if s.OperationName == "rollout" {
			rolloutSpan = s
		}
		if v, _ := s.tag("osmo.rollout.id"); v != spec.id {
			t.Errorf("%s span %q has osmo.rollout.id %v, want %q", service(s), s.OperationName, v, spec.id)
		}
		p := s.parent()
		switch {
		case p == spec.trainerSpan:
			if s.OperationName != spec.gatewayOp || service(s) != "osmo-gateway" {
				t.Errorf("%s span %q is a child of the trainer's span; only the gateway's %s span should be", service(s), s.OperationName, spec.gatewayOp)
			}
		case p == "":
			t.Errorf("%s span %q has no parent", service(s), s.OperationName)
		default:
			if _, ok := spans[p]; !ok {
				t.Errorf("%s span %q has parent %s, which is not in the trace", service(s), s.OperationName, p)
			}
		}
	}
	descends := func(s jaegerSpan, ancestor string) bool {
		for range len(spans) {
			p := s.parent()
			if p == ancestor {
				return true
			}
			next, ok := spans[p]
			if !ok {
				return false
			}
			s = next
		}
		return false
	}
	for _, s := range tr.Spans {
		for _, op := range spec.underRollout {
			if strings.HasPrefix(s.OperationName, op) && !descends(s, rolloutSpan.SpanID) {
				t.Errorf("%s span %q is not under the rollout span", service(s), s.OperationName)
			}
		}
	}

	// Jaeger's tag search finds the trace from any of the services.
	tags := url.QueryEscape(`{"osmo.rollout.id":"` + spec.id + `"}`)
	for _, svc := range []string{"osmo-gateway", "osmo-rollout", "osmo-llmproxy", "osmo-grader"} {
		found, err := j.getTraces(ctx, "/api/traces?service="+svc+"&lookback=1h&limit=20&tags="+tags)
		if err != nil {
			t.Fatal(err)
		}
		if len(found) != 1 || found[0].TraceID != spec.traceID {
			ids := []string{}
			for _, f := range found {
				ids = append(ids, f.TraceID)
			}
			t.Errorf("tag search in %s for osmo.rollout.id=%s found traces %v, want just %s", svc, spec.id, ids, spec.traceID)
		}
	}
	return tr
}

// describe lists a trace's spans for failure messages.
func describe(tr jaegerTrace) string {
	var b strings.Builder
	for _, s := range tr.Spans {
		fmt.Fprintf(&b, "\n  %s: %s (%s <- %s)", tr.Processes[s.ProcessID].ServiceName, s.OperationName, s.SpanID, s.parent())
	}
	return b.String()
}
