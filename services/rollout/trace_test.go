package rollout_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/telemetry"
	"github.com/osmo-rl/osmo/services/rollout"
	"github.com/osmo-rl/osmo/workflows/multiply"
)

// traced is a harness whose service, proxy and gRPC server trace into one
// in-memory exporter.
func traced(t *testing.T, o harnessOpts) (*harness, *tracetest.InMemoryExporter, *sdktrace.TracerProvider) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	cfg := o.cfg
	o.cfg = func(c *rollout.Config) {
		c.TracerProvider = tp
		if cfg != nil {
			cfg(c)
		}
	}
	o.grpcServer = telemetry.GRPCServerOptions(tp, nil)
	o.grpcDial = telemetry.GRPCDialOptions(tp, nil)
	return newHarness(t, o), exp, tp
}

// spanTree indexes exported spans.
type spanTree struct {
	t     *testing.T
	spans []tracetest.SpanStub
	byID  map[trace.SpanID]tracetest.SpanStub
}

// waitSpan polls exp until a span named name has ended (the rollout span
// ends just after the completion is delivered), then indexes them all.
func waitSpan(t *testing.T, exp *tracetest.InMemoryExporter, name string) *spanTree {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		spans := exp.GetSpans()
		for _, s := range spans {
			if s.Name == name {
				tr := &spanTree{t: t, spans: spans, byID: map[trace.SpanID]tracetest.SpanStub{}}
				for _, s := range spans {
					tr.byID[s.SpanContext.SpanID()] = s
				}
				return tr
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q span was exported", name)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (tr *spanTree) named(name string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range tr.spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func (tr *spanTree) one(name string) tracetest.SpanStub {
	tr.t.Helper()
	got := tr.named(name)
	if len(got) != 1 {
		tr.t.Fatalf("%d spans named %q, want 1", len(got), name)
	}
	return got[0]
}

// under reports whether s descends from ancestor.
func (tr *spanTree) under(s, ancestor tracetest.SpanStub) bool {
	for range len(tr.spans) {
		p, ok := tr.byID[s.Parent.SpanID()]
		if !ok {
			return false
		}
		if p.SpanContext.SpanID() == ancestor.SpanContext.SpanID() {
			return true
		}
		s = p
	}
	return false
}

func attrMap(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestRolloutTrace follows one calculator rollout: a tool call, grading and
// a callback that succeeds on its second attempt.
func TestRolloutTrace(t *testing.T) {
	g := &spanGrader{fakeGrader: fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
		return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "calculator",
			Grades: []*graderv1.SampleGrade{{SampleId: rollout.SamplesOf(req)[0].GetId(), Reward: osmo.Float(1)}}}, nil
	}}}
	h, exp, tp := traced(t, harnessOpts{
		cfg: func(c *rollout.Config) { c.Grader = g; c.GraderName = "calculator" },
		g1:  controller.Options{FailCompletions: 1},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	ctx, trainer := tp.Tracer("test").Start(ctx, "trainer")
	if _, err := h.client.InitRollout(ctx, h.initReq(t, "t1", 6, 7, "42")); err != nil {
		t.Fatal(err)
	}
	trainer.End()
	if c := h.waitG1(t, "t1"); c.Status != "COMPLETED" || c.Reward == nil || *c.Reward != 1 {
		t.Fatalf("completion %s", c.Raw)
	}
	tr := waitSpan(t, exp, "rollout")

	root := tr.one("rollout")
	server := tr.byID[root.Parent.SpanID()]
	if server.Name != "osmo.rollout.v1.RolloutService/InitRollout" || server.SpanKind != trace.SpanKindServer {
		t.Errorf("the rollout span's parent is %q (%v), want the InitRollout server span", server.Name, server.SpanKind)
	}
	if root.SpanContext.TraceID() != trainer.SpanContext().TraceID() {
		t.Error("the rollout is not in the caller's trace")
	}
	ra := attrMap(root)
	if ra["osmo.rollout.status"].AsString() != "COMPLETED" || ra["osmo.reward"].AsFloat64() != 1 || ra["osmo.workflow"].AsString() != "calculator" ||
		ra["osmo.rollout.llm_calls"].AsInt64() != 2 || ra["osmo.rollout.tool_calls"].AsInt64() != 1 {
		t.Errorf("rollout span attributes %v", ra)
	}
	// Then a row_drift event per drift point of its training rows.
	if len(root.Events) == 0 || root.Events[0].Name != "started" ||
		slices.ContainsFunc(root.Events[1:], func(e sdktrace.Event) bool { return e.Name != "row_drift" }) {
		t.Errorf("rollout span events %v, want started, then row_drift only", root.Events)
	}

	agent := tr.one("invoke_agent calculator")
	if agent.Parent.SpanID() != root.SpanContext.SpanID() || attrMap(agent)["gen_ai.operation.name"].AsString() != "invoke_agent" {
		t.Errorf("agent span %v", agent)
	}
	chats := tr.named("chat openai/osmosis-rollout")
	if len(chats) != 2 {
		t.Fatalf("%d chat spans, want 2", len(chats))
	}
	for _, c := range chats {
		a := attrMap(c)
		if c.SpanKind != trace.SpanKindClient || !tr.under(c, agent) || a["gen_ai.usage.output_tokens"].AsInt64() == 0 || a["gen_ai.request.temperature"].AsFloat64() != 1 {
			t.Errorf("chat span kind %v under the agent %v, attributes %v", c.SpanKind, tr.under(c, agent), a)
		}
		// The proxy's span sits under the agent's HTTP client span.
		if p := tr.byID[c.Parent.SpanID()]; p.Name != "POST /r/{rollout_id}/s/{sample_id}/v1/chat/completions" || p.SpanKind != trace.SpanKindClient {
			t.Errorf("chat span's parent %q %v", p.Name, p.SpanKind)
		}
	}
	tool := tr.one("execute_tool multiply")
	if ta := attrMap(tool); !tr.under(tool, agent) || ta["gen_ai.tool.name"].AsString() != "multiply" || ta["gen_ai.tool.call.id"].AsString() == "" {
		t.Errorf("tool span %v", ta)
	}

	grade := tr.one("grade")
	if grade.SpanKind != trace.SpanKindClient || grade.Parent.SpanID() != root.SpanContext.SpanID() || attrMap(grade)["osmo.reward"].AsFloat64() != 1 {
		t.Errorf("grade span %v", grade)
	}
	// The grader client sends the trace context of what it is given.
	if got := g.spanContext(); got.SpanID() != grade.SpanContext.SpanID() {
		t.Errorf("the grader was called under span %v, want the grade span %v", got.SpanID(), grade.SpanContext.SpanID())
	}

	// One span per attempt, each under the rollout's: the first here, the
	// second from the outbox (which reads the rollout's span from its
	// lifecycle, as another replica would).
	delivers := tr.named("deliver_completion")
	if len(delivers) != 2 {
		t.Fatalf("%d deliver_completion spans, want 2 (one per attempt)", len(delivers))
	}
	for i, d := range delivers {
		if d.Parent.SpanID() != root.SpanContext.SpanID() || attrMap(d)["osmo.attempt"].AsInt64() != int64(i+1) {
			t.Errorf("deliver span %d: parent %v, attributes %v", i, d.Parent.SpanID(), attrMap(d))
		}
	}
	if delivers[0].Status.Code != codes.Error || delivers[1].Status.Code == codes.Error {
		t.Errorf("deliver spans' statuses %v, %v: want the first failed, the second not", delivers[0].Status, delivers[1].Status)
	}
	attempts := tr.named("POST /v1/rollout/completed")
	if len(attempts) != 2 {
		t.Errorf("%d callback attempt spans, want 2", len(attempts))
	}
	for i, a := range attempts {
		if a.Parent.SpanID() != delivers[i].SpanContext.SpanID() {
			t.Errorf("attempt span %d's parent is not its delivery", i)
		}
	}

	for _, s := range tr.spans {
		if s.Name == "trainer" || s.SpanKind == trace.SpanKindClient && s.Name == "osmo.rollout.v1.RolloutService/InitRollout" {
			continue // the caller's own spans
		}
		a := attrMap(s)
		if a["osmo.rollout.id"].AsString() != "t1" {
			t.Errorf("span %q has osmo.rollout.id %q", s.Name, a["osmo.rollout.id"].AsString())
		}
		if tr.under(s, root) && a["osmo.sample.id"].AsString() != "calculator" {
			t.Errorf("span %q under the rollout has osmo.sample.id %q", s.Name, a["osmo.sample.id"].AsString())
		}
	}
}

func TestRolloutTraceFailures(t *testing.T) {
	t.Run("LLM call fails", func(t *testing.T) {
		h, exp, _ := traced(t, harnessOpts{mock: mockOpts("500")})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "f1", 2, 3, "6")); err != nil {
			t.Fatal(err)
		}
		h.waitG1(t, "f1")
		tr := waitSpan(t, exp, "rollout")
		for _, name := range []string{"rollout", "invoke_agent calculator"} {
			s := tr.one(name)
			// The policy's answer is the failure's cause: http_error.
			if s.Status.Code != codes.Error || attrMap(s)["error.type"].AsString() != "http_error" {
				t.Errorf("%s: status %v error.type %v, want http_error", name, s.Status, attrMap(s)["error.type"])
			}
		}
		chat := tr.named("chat openai/osmosis-rollout")
		if len(chat) != 1 || attrMap(chat[0])["error.type"].AsString() != "500" || chat[0].Status.Code != codes.Error {
			t.Errorf("chat spans %v, want one failed with error.type 500", chat)
		}
	})
	t.Run("grading fails", func(t *testing.T) {
		g := &fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
			return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Error: "grader exploded"}, nil
		}}
		h, exp, _ := traced(t, harnessOpts{cfg: func(c *rollout.Config) { c.Grader = g }})
		if _, err := h.client.InitRollout(context.Background(), h.initReq(t, "f2", 2, 3, "6")); err != nil {
			t.Fatal(err)
		}
		h.waitG1(t, "f2")
		tr := waitSpan(t, exp, "rollout")
		grade := tr.one("grade")
		if grade.Status.Code != codes.Error || attrMap(grade)["error.type"].AsString() != "grader_error" || !strings.Contains(grade.Status.Description, "grader exploded") {
			t.Errorf("grade span status %v attributes %v", grade.Status, attrMap(grade))
		}
		if attrMap(tr.one("rollout"))["osmo.error.category"].AsString() != "grader_error" {
			t.Errorf("rollout span %v", attrMap(tr.one("rollout")))
		}
	})
}

// spanGrader is a fakeGrader that remembers the span it was called under.
type spanGrader struct {
	fakeGrader
	mu sync.Mutex
	sc trace.SpanContext
}

func (g *spanGrader) Grade(ctx context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	g.mu.Lock()
	g.sc = trace.SpanContextFromContext(ctx)
	g.mu.Unlock()
	return g.fakeGrader.Grade(ctx, req)
}

func (g *spanGrader) spanContext() trace.SpanContext {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.sc
}

// TestG2WorkflowTrace follows a G2 rollout of the built-in multiply
// workflow (an osmoopenai session with a tool): every span of the sample,
// the workflow's LLM client calls, the proxy's chat spans and the tool
// call, carries osmo.sample.id (the session's name) beside
// osmo.rollout.id, as a G1 rollout's spans do.
func TestG2WorkflowTrace(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	h := newHarness(t, harnessOpts{wf: multiply.New(), cfg: func(c *rollout.Config) { c.TracerProvider = tp }})
	h.start(t, h.startReq(t, "g2-trace"))
	if c := h.waitCompletion(t, "g2-trace"); c.Status != "success" {
		t.Fatalf("completion %s", c.Raw)
	}
	h.waitGrader(t, "g2-trace")
	tr := waitSpan(t, exp, "rollout")
	root := tr.one("rollout")
	agent := tr.one("invoke_agent multiply")
	if !tr.under(agent, root) {
		t.Fatal("the agent span is not under the rollout span")
	}
	clients := tr.named("POST /r/{rollout_id}/s/{sample_id}/v1/chat/completions")
	chats := tr.named("chat openai/osmosis-rollout")
	tools := tr.named("execute_tool multiply")
	if len(clients) < 2 || len(chats) != len(clients) || len(tools) < 1 {
		t.Fatalf("%d LLM client spans, %d chat spans and %d tool spans; want a tool turn and an answer", len(clients), len(chats), len(tools))
	}
	for _, s := range append(append(clients, chats...), tools...) {
		a := attrMap(s)
		if !tr.under(s, agent) {
			t.Errorf("span %q is not under the agent span", s.Name)
		}
		if a["osmo.rollout.id"].AsString() != "g2-trace" || a["osmo.sample.id"].AsString() != multiply.SampleID {
			t.Errorf("span %q has osmo.rollout.id %q and osmo.sample.id %q, want g2-trace and %q",
				s.Name, a["osmo.rollout.id"].AsString(), a["osmo.sample.id"].AsString(), multiply.SampleID)
		}
	}
}

// TestOutboxFinalStageTrace: a G2 rollout's completion callback fails
// until after grading, so its grader callback is owed while the
// completion waits in the outbox, and the outbox's delivery of the
// completion is what sends it: the grader callback's span is still in the
// rollout's trace, under its span, with its id.
func TestOutboxFinalStageTrace(t *testing.T) {
	g := &fakeGrader{fn: func(req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
		return &graderv1.GradeResponse{RolloutId: req.GetRolloutId(), Grader: "multiply",
			Grades: []*graderv1.SampleGrade{{SampleId: rollout.SamplesOf(req)[0].GetId(), Reward: osmo.Float(1)}}}, nil
	}}
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(telemetry.BaggageAttributes()), sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	h := newHarness(t, harnessOpts{wf: multiply.New(), cfg: func(c *rollout.Config) { c.TracerProvider = tp; c.Grader = g }})
	h.g2.SetDown(true)
	h.start(t, h.startReq(t, "outbox-trace"))
	// Graded, its grader callback owed behind the completion.
	deadline := time.Now().Add(testTimeout)
	for h.g2.FailedCallbacks() == 0 || h.status(t, "outbox-trace").GetStatus() != "success" {
		if time.Now().After(deadline) {
			t.Fatalf("not graded with its completion failing: status %v, %d failed posts", h.status(t, "outbox-trace"), h.g2.FailedCallbacks())
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	h.g2.SetDown(false)
	if c := h.waitCompletion(t, "outbox-trace"); c.Status != "success" {
		t.Fatalf("completion %s", c.Raw)
	}
	h.waitGrader(t, "outbox-trace")
	h.waitDone(t, "outbox-trace")
	tr := waitSpan(t, exp, "rollout")
	root := tr.one("rollout")
	var delivers []tracetest.SpanStub
	for _, name := range []string{"deliver_completion_callback", "deliver_grader_callback"} {
		delivers = append(delivers, tr.named(name)...)
	}
	if len(tr.named("deliver_grader_callback")) != 1 || len(tr.named("deliver_completion_callback")) < 2 {
		t.Fatalf("%d completion and %d grader callback spans, want the failed and the delivered attempts and one",
			len(tr.named("deliver_completion_callback")), len(tr.named("deliver_grader_callback")))
	}
	for _, d := range delivers {
		if d.SpanContext.TraceID() != root.SpanContext.TraceID() || d.Parent.SpanID() != root.SpanContext.SpanID() {
			t.Errorf("%s (attempt %d) is in trace %v under %v, want the rollout's trace %v under its span %v", d.Name,
				attrMap(d)["osmo.attempt"].AsInt64(), d.SpanContext.TraceID(), d.Parent.SpanID(), root.SpanContext.TraceID(), root.SpanContext.SpanID())
		}
		if got := attrMap(d)["osmo.rollout.id"].AsString(); got != "outbox-trace" {
			t.Errorf("%s has osmo.rollout.id %q", d.Name, got)
		}
	}
}
