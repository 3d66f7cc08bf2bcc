package rollout

import (
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/osmo-rl/osmo"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/host"
	"github.com/osmo-rl/osmo/internal/outcome"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// recordedSource leaves its sample's messages to the recorded calls.
type recordedSource struct{}

func (recordedSource) SampleMessages() ([]osmo.Message, error) { return nil, nil }

// turnBodies is the request messages of an agent's calls over turns: a
// system and a user message, then per turn an assistant tool call and its
// result, each call sending the whole conversation so far (as a new body,
// the way the proxy reads one).
func turnBodies(turns int) [][]byte {
	msgs := []string{
		`{"role":"system","content":"` + strings.Repeat("Use the tools when arithmetic is required. ", 8) + `"}`,
		`{"role":"user","content":"What is 12345 * 6789, then times 3, then minus 17?"}`,
	}
	var out [][]byte
	for i := range turns {
		out = append(out, []byte("["+strings.Join(msgs, ",")+"]"))
		msgs = append(msgs,
			fmt.Sprintf(`{"role":"assistant","content":null,"tool_calls":[{"id":"call_%d","type":"function","function":{"name":"multiply","arguments":"{\"a\":%d,\"b\":6789}"}}]}`, i, 12345+i),
			fmt.Sprintf(`{"role":"tool","tool_call_id":"call_%d","content":"%d"}`, i, (12345+i)*6789))
	}
	return out
}

// BenchmarkSampleTurns records the calls of one sample of a rollout with
// the given turns, collects the sample and renders it: its stored record,
// its grader request and its grader callback. held-B/rollout is the heap
// the recorded calls keep while the rollout runs.
func BenchmarkSampleTurns(b *testing.B) {
	for _, turns := range []int{2, 10, 30} {
		b.Run(fmt.Sprintf("turns=%d", turns), func(b *testing.B) {
			bodies := turnBodies(turns)
			answer := json.RawMessage(`{"role":"assistant","content":"The answer is 251426418."}`)
			newRec := func() *record {
				rec := &record{id: "r"}
				for i, body := range bodies {
					body = append([]byte(nil), body...) // each call's own request body
					rec.addCall(&llmproxy.Call{RolloutID: "r", SampleID: "s", ID: fmt.Sprint("c", i), RequestMessages: body, ResponseMessage: answer, StatusCode: 200, Attempts: 1})
				}
				return rec
			}
			// What the recorded calls hold, over many rollouts.
			var before, after runtime.MemStats
			held := make([]*record, 200)
			runtime.GC()
			runtime.ReadMemStats(&before)
			for i := range held {
				held[i] = newRec()
			}
			runtime.GC()
			runtime.ReadMemStats(&after)
			heldPer := float64(after.HeapAlloc-before.HeapAlloc) / float64(len(held))
			runtime.KeepAlive(held)
			held = nil

			var stored, graded, callback int
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				rec := newRec()
				r := host.NewRollout("r", nil)
				_ = r.Register("s", recordedSource{})
				if err := (&Service{}).collect(rec, r); err != nil {
					b.Fatal(err)
				}
				samples := rec.snapshot()
				st, _ := proto.Marshal(&rolloutv1.Rollout{RolloutId: "r", Samples: samples})
				stored = len(st)
				graded = proto.Size(&rolloutv1.Rollout{Samples: samples})
				cb, err := marshalBody(graderBody("r", outcome.Outcome{State: rolloutv1.State_STATE_SUCCEEDED}, samples))
				if err != nil {
					b.Fatal(err)
				}
				callback = len(cb)
			}
			b.ReportMetric(heldPer, "held-B/rollout")
			b.ReportMetric(float64(stored), "stored-B")
			b.ReportMetric(float64(graded), "grade-B")
			b.ReportMetric(float64(callback), "callback-B")
		})
	}
}

// BenchmarkCollectMessages converts a 10-turn sample's messages, as a
// sample source returns them (decoded JSON), to their wire form.
func BenchmarkCollectMessages(b *testing.B) {
	bodies := turnBodies(10)
	var msgs []osmo.Message
	if err := json.Unmarshal(bodies[len(bodies)-1], &msgs); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for range b.N {
		if _, err := toStructs(msgs); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRenderCallback renders the grader callback of a sample of 10
// calls with their start times (the body's one marshal).
func BenchmarkRenderCallback(b *testing.B) {
	rec := &record{id: "r"}
	for i, body := range turnBodies(10) {
		rec.addCall(&llmproxy.Call{RolloutID: "r", SampleID: "s", ID: fmt.Sprint("c", i), RequestMessages: body,
			ResponseMessage: json.RawMessage(`{"role":"assistant","content":"ok"}`), StatusCode: 200, Attempts: 1,
			StartedAt: time.Date(2026, 11, 25, 14, 9, 11, 123400000+i, time.UTC)})
	}
	r := host.NewRollout("r", nil)
	_ = r.Register("s", recordedSource{})
	if err := (&Service{}).collect(rec, r); err != nil {
		b.Fatal(err)
	}
	samples := rec.snapshot()
	b.ReportAllocs()
	var size int
	for range b.N {
		body, err := marshalBody(graderBody("r", outcome.Outcome{State: rolloutv1.State_STATE_SUCCEEDED}, samples))
		if err != nil {
			b.Fatal(err)
		}
		size = len(body)
	}
	b.ReportMetric(float64(size), "body-bytes")
}

// BenchmarkCollectExtra collects a one-call sample of a request with
// extra fields its source adds nothing to.
func BenchmarkCollectExtra(b *testing.B) {
	extra, err := structpb.NewStruct(map[string]any{"dataset": "gsm8k", "split": "train", "row": 1234.0,
		"tags": []any{"math", "arith"}, "source": map[string]any{"name": "x", "version": 3.0}})
	if err != nil {
		b.Fatal(err)
	}
	body := turnBodies(1)[0]
	b.ReportAllocs()
	for range b.N {
		rec := &record{id: "r", extra: extra}
		rec.addCall(&llmproxy.Call{RolloutID: "r", SampleID: "s", RequestMessages: body,
			ResponseMessage: json.RawMessage(`{"role":"assistant","content":"ok"}`), StatusCode: 200})
		r := host.NewRollout("r", nil)
		_ = r.Register("s", recordedSource{})
		if err := (&Service{}).collect(rec, r); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkG1Completion renders a G1 completion whose sample has a
// 10-turn conversation and extra fields.
func BenchmarkG1Completion(b *testing.B) {
	bodies := turnBodies(10)
	var msgs []osmo.Message
	if err := json.Unmarshal(bodies[len(bodies)-1], &msgs); err != nil {
		b.Fatal(err)
	}
	structs, err := toStructs(msgs)
	if err != nil {
		b.Fatal(err)
	}
	extra, err := structpb.NewStruct(map[string]any{"dataset": "gsm8k", "row": 1234.0})
	if err != nil {
		b.Fatal(err)
	}
	rec := &record{id: "r", samples: []*rolloutv1.RolloutSample{{Id: "s", Messages: structs, ExtraFields: extra}}}
	w := &g1Wire{req: &rolloutv1.InitRolloutRequest{ServerUrl: "http://x"}}
	ok := outcome.Outcome{State: rolloutv1.State_STATE_SUCCEEDED}
	b.ReportAllocs()
	for range b.N {
		if _, err := marshalBody(w.finished(rec, ok, ok)[0].body); err != nil {
			b.Fatal(err)
		}
	}
}
