package osmo_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/osmotest"
)

func TestValidSampleID(t *testing.T) {
	tests := []struct {
		id string
		ok bool
	}{
		{"a", true},
		{"0", true},
		{"agent", true},
		{"multiply-agent", true},
		{"Agent_1.v2:run@host+x", true},
		{"sample-0123456789abcdef", true},
		{"a..b", true},
		{strings.Repeat("a", 128), true},
		{"", false},
		{".", false},
		{"..", false},
		{".hidden", false},
		{"-lead", false},
		{"_lead", false},
		{"a/b", false},
		{"a\\b", false},
		{"a b", false},
		{" a", false},
		{"a\n", false},
		{"a?b", false},
		{"a#b", false},
		{"a%2Fb", false},
		{"ü", false},
		{strings.Repeat("a", 129), false},
	}
	for _, tt := range tests {
		name := tt.id
		if len(name) > 20 {
			name = fmt.Sprintf("%d chars", len(name))
		}
		t.Run(name, func(t *testing.T) {
			err := osmo.ValidSampleID(tt.id)
			if tt.ok && err != nil {
				t.Errorf("ValidSampleID(%q) = %v, want nil", tt.id, err)
			}
			if !tt.ok {
				if err == nil {
					t.Fatalf("ValidSampleID(%q) = nil, want an error", tt.id)
				}
				if !strings.Contains(err.Error(), fmt.Sprintf("%q", tt.id)) {
					t.Errorf("error %q does not quote the id", err)
				}
			}
		})
	}
}

func TestRegister(t *testing.T) {
	src := emptySource()
	tests := []struct {
		name    string
		id      string
		src     osmo.SampleSource
		wantErr []string
		wantIs  error
	}{
		{name: "valid", id: "agent", src: src},
		{name: "duplicate", id: "taken", src: src, wantErr: []string{`"taken"`, `"roll-7"`}, wantIs: osmo.ErrDuplicateSample},
		{name: "empty id", id: "", src: src, wantErr: []string{"sample id"}},
		{name: "dot dot", id: "..", src: src, wantErr: []string{`".."`}},
		{name: "slash", id: "a/b", src: src, wantErr: []string{`"a/b"`}},
		{name: "129 chars", id: strings.Repeat("x", 129), src: src, wantErr: []string{"1-128 characters"}},
		{name: "leading dash", id: "-agent", src: src, wantErr: []string{`"-agent"`}},
		{name: "nil source", id: "agent", src: nil, wantErr: []string{`"agent"`, "nil source"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := osmotest.NewRollout("roll-7", nil)
			if err := r.Register("taken", src); err != nil {
				t.Fatalf("Register(taken): %v", err)
			}
			err := r.Register(tt.id, tt.src)
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("Register(%q): %v", tt.id, err)
				}
				if got := osmotest.Sources(r); len(got) != 2 || got[1].ID != tt.id || got[1].Source == nil {
					t.Errorf("Sources = %v, want taken then %q", got, tt.id)
				}
				return
			}
			if err == nil {
				t.Fatalf("Register(%q) = nil, want an error", tt.id)
			}
			for _, s := range tt.wantErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not mention %s", err, s)
				}
			}
			if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Errorf("errors.Is(%v, %v) = false", err, tt.wantIs)
			}
			if tt.wantIs == nil && errors.Is(err, osmo.ErrDuplicateSample) {
				t.Errorf("error %v claims a duplicate", err)
			}
			if got := osmotest.Sources(r); len(got) != 1 || got[0].ID != "taken" {
				t.Errorf("a refused Register changed the sources: %v", got)
			}
		})
	}
}

func TestSourcesOrderAndCopy(t *testing.T) {
	r := osmotest.NewRollout("r", nil)
	ids := []string{"zeta", "alpha", "mid", "beta"}
	for i, id := range ids {
		msgs := []osmo.Message{{"role": "assistant", "content": fmt.Sprint(i)}}
		if err := r.Register(id, osmo.SampleSourceFunc(func() ([]json.RawMessage, error) { return osmo.EncodeMessages(msgs) })); err != nil {
			t.Fatalf("Register(%q): %v", id, err)
		}
	}
	got := osmotest.Sources(r)
	if len(got) != len(ids) {
		t.Fatalf("%d sources, want %d", len(got), len(ids))
	}
	for i, s := range got {
		if s.ID != ids[i] {
			t.Errorf("source %d is %q, want %q", i, s.ID, ids[i])
		}
		m, err := osmotest.Messages(s.Source)
		if err != nil || len(m) != 1 || m[0]["content"] != fmt.Sprint(i) {
			t.Errorf("source %q messages %v, %v; want its own", s.ID, m, err)
		}
	}
	got[0] = osmotest.Source{ID: "overwritten"}
	if again := osmotest.Sources(r); again[0].ID != "zeta" {
		t.Errorf("changing the returned slice changed the rollout: %q", again[0].ID)
	}
}

func TestRegisterConcurrent(t *testing.T) {
	const (
		writers = 16
		each    = 25
	)
	r := osmotest.NewRollout("r", nil)
	var wg sync.WaitGroup
	errs := make(chan error, writers*each)
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				if err := r.Register(fmt.Sprintf("w%d-%d", w, i), emptySource()); err != nil {
					errs <- err
				}
				_ = osmotest.Sources(r)
			}
		})
	}
	// Every writer also races for one shared name: exactly one wins.
	var wins sync.Map
	for w := range writers {
		wg.Go(func() {
			err := r.Register("shared", emptySource())
			switch {
			case err == nil:
				wins.Store(w, true)
			case !errors.Is(err, osmo.ErrDuplicateSample):
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("Register: %v", err)
	}
	n := 0
	wins.Range(func(any, any) bool { n++; return true })
	if n != 1 {
		t.Errorf("%d goroutines registered \"shared\", want 1", n)
	}
	got := osmotest.Sources(r)
	if len(got) != writers*each+1 {
		t.Fatalf("%d sources, want %d", len(got), writers*each+1)
	}
	seen := map[string]bool{}
	// Each writer's own ids keep their relative order.
	last := map[string]int{}
	for _, s := range got {
		if seen[s.ID] {
			t.Errorf("source %q twice", s.ID)
		}
		seen[s.ID] = true
		var w, i int
		if _, err := fmt.Sscanf(s.ID, "w%d-%d", &w, &i); err == nil {
			key := fmt.Sprint(w)
			if prev, ok := last[key]; ok && i != prev+1 {
				t.Errorf("writer %d: source %d after %d", w, i, prev)
			}
			last[key] = i
		}
	}
}

func TestNewSampleID(t *testing.T) {
	format := regexp.MustCompile(`^sample-[0-9a-f]{16}$`)
	seen := map[string]bool{}
	for range 1000 {
		id := osmo.NewSampleID()
		if !format.MatchString(id) {
			t.Fatalf("NewSampleID() = %q, want sample-<16 hex digits>", id)
		}
		if err := osmo.ValidSampleID(id); err != nil {
			t.Fatalf("NewSampleID() = %q, refused by ValidSampleID: %v", id, err)
		}
		if seen[id] {
			t.Fatalf("NewSampleID() repeated %q", id)
		}
		seen[id] = true
	}
}

// fakeRuntime records what a Rollout asks of its runtime.
type fakeRuntime struct {
	log    *slog.Logger
	client *http.Client

	mu        sync.Mutex
	events    []string
	data      []map[string]any
	endpoint  []string
	toolCalls []string
}

func (f *fakeRuntime) Endpoint(sampleID string) osmo.Endpoint {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.endpoint = append(f.endpoint, sampleID)
	return osmo.Endpoint{
		BaseURL:    "http://127.0.0.1:1/r/roll/s/" + sampleID + "/v1",
		APIKey:     "token",
		Headers:    map[string]string{"x-rollout-id": "roll", "x-sample-id": sampleID},
		HTTPClient: f.client,
	}
}

func (f *fakeRuntime) Logger() *slog.Logger { return f.log }

func (f *fakeRuntime) LogEvent(name string, data map[string]any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, name)
	f.data = append(f.data, data)
}

func (f *fakeRuntime) RecordToolCall(sampleID string, latency time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.toolCalls = append(f.toolCalls, fmt.Sprintf("%s %v", sampleID, latency))
}

func TestRuntimeDelegation(t *testing.T) {
	var buf bytes.Buffer
	rt := &fakeRuntime{log: slog.New(slog.NewTextHandler(&buf, nil)).With("rollout_id", "roll"), client: &http.Client{}}
	r := osmotest.NewRollout("roll", rt)

	if got := r.Logger(); got != rt.log {
		t.Errorf("Logger() = %p, want the runtime's %p", got, rt.log)
	}
	r.Logger().Info("hello")
	if !strings.Contains(buf.String(), "rollout_id=roll") || !strings.Contains(buf.String(), "hello") {
		t.Errorf("runtime log = %q", buf.String())
	}

	r.LogEvent("tool_call", map[string]any{"name": "multiply"})
	r.LogEvent("done", nil)
	if len(rt.events) != 2 || rt.events[0] != "tool_call" || rt.events[1] != "done" || rt.data[0]["name"] != "multiply" || rt.data[1] != nil {
		t.Errorf("LogEvent reached the runtime as %v %v", rt.events, rt.data)
	}

	ep := r.Endpoint("agent-1")
	if len(rt.endpoint) != 1 || rt.endpoint[0] != "agent-1" {
		t.Errorf("Endpoint asked the runtime for %v, want [agent-1]", rt.endpoint)
	}
	if !strings.HasSuffix(ep.BaseURL, "/s/agent-1/v1") || ep.Headers["x-sample-id"] != "agent-1" || ep.APIKey != "token" || ep.HTTPClient != rt.client {
		t.Errorf("Endpoint = %+v, want the runtime's", ep)
	}

	r.RecordToolCall("agent-1", 3*time.Millisecond)
	if len(rt.toolCalls) != 1 || rt.toolCalls[0] != "agent-1 3ms" {
		t.Errorf("RecordToolCall reached the runtime as %v, want [agent-1 3ms]", rt.toolCalls)
	}
}

// A Rollout without a runtime (a workflow's own tests) still logs, with
// rollout_id, and ignores events. This test swaps the default logger, so it
// must not run in parallel with others.
func TestRolloutWithoutRuntime(t *testing.T) {
	var buf bytes.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&buf, nil)))
	t.Cleanup(func() { slog.SetDefault(prev) })

	for _, r := range []*osmo.Rollout{osmotest.NewRollout("lonely", nil), {ID: "lonely"}} {
		buf.Reset()
		log := r.Logger()
		if log == nil {
			t.Fatal("Logger() = nil")
		}
		log.Info("still here")
		if !strings.Contains(buf.String(), "rollout_id=lonely") || !strings.Contains(buf.String(), "still here") {
			t.Errorf("default log = %q, want the message with rollout_id=lonely", buf.String())
		}
		r.LogEvent("ignored", map[string]any{"k": 1})
		if ep := r.Endpoint("agent"); ep.BaseURL != "" || ep.APIKey != "" || ep.Headers != nil || ep.HTTPClient != nil {
			t.Errorf("Endpoint without a runtime = %+v, want zero", ep)
		}
		if err := r.Register("agent", emptySource()); err != nil {
			t.Errorf("Register: %v", err)
		}
	}
}

func TestRolloutFromContext(t *testing.T) {
	r := osmotest.NewRollout("r", nil)
	tests := []struct {
		name string
		ctx  context.Context
		want *osmo.Rollout
	}{
		{"background", context.Background(), nil},
		{"installed", osmotest.ContextWithRollout(context.Background(), r), r},
		{"nil rollout installed", osmotest.ContextWithRollout(context.Background(), nil), nil},
		{"inner wins", osmotest.ContextWithRollout(osmotest.ContextWithRollout(context.Background(), osmotest.NewRollout("outer", nil)), r), r},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := osmo.RolloutFromContext(tt.ctx)
			if tt.want == nil {
				if !errors.Is(err, osmo.ErrNoRollout) || got != nil {
					t.Errorf("RolloutFromContext = %v, %v; want ErrNoRollout", got, err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("RolloutFromContext = %p, %v; want %p", got, err, tt.want)
			}
		})
	}
}
