//go:build unix

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
)

// TestRowsStreamAcrossReplicaKill: a trainer reads the rows of finished
// rollouts from one of two `osmo rollout` replicas over gRPC; that replica
// is SIGKILLed mid-stream; the trainer resumes through the gateway (REST,
// one JSON row per line) after the last row it got, and receives every
// row once, in order, those of a rollout finished while it was away
// included.
func TestRowsStreamAcrossReplicaKill(t *testing.T) {
	policy := "http://" + startMockPolicy(t) + "/v1"
	ctl := startG1Controller(t, controller.Options{PolicyURL: policy, Logger: quietLog()})
	c := startReplicas(t, replicaOptions{n: 2})
	killed, survivor := c.replicas[0], c.replicas[1]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// run finishes a rollout whose calls ask the policy for token ids and
	// returns its rows, as the survivor answers them.
	run := func(id string, a, b int) []string {
		t.Helper()
		msg, err := structpb.NewStruct(map[string]any{"role": "user", "content": fmt.Sprintf("What is %d * %d?", a, b)})
		if err != nil {
			t.Fatal(err)
		}
		params, err := structpb.NewStruct(map[string]any{"return_token_ids": true, "logprobs": true})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := survivor.client.InitRollout(ctx, &rolloutv1.InitRolloutRequest{RolloutId: id, ServerUrl: ctl.URL(),
			Messages: []*structpb.Struct{msg}, CompletionParams: params}); err != nil {
			t.Fatalf("init %s: %v", id, err)
		}
		if _, err := ctl.Wait(ctx, id); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		var keys []string
		waitFor(t, id+"'s rows", func() bool {
			got, err := survivor.client.GetRolloutRows(ctx, &rolloutv1.GetRolloutRowsRequest{RolloutId: id})
			if err != nil {
				return false
			}
			keys = keys[:0]
			for _, r := range got.GetRows() {
				keys = append(keys, fmt.Sprintf("%s/%s/%d", r.GetRolloutId(), r.GetSampleId(), r.GetRow()))
			}
			return true
		})
		if len(keys) == 0 {
			t.Fatalf("%s has no rows", id)
		}
		return keys
	}

	want := append(run("kill-1", 2, 3), run("kill-2", 4, 5)...)

	// All but the last row held, from the replica about to be killed; what
	// it sent before dying may still arrive, and counts as got.
	stream, err := killed.client.StreamRows(ctx, &rolloutv1.StreamRowsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	cursor := ""
	for len(got) < len(want)-1 {
		r, err := stream.Recv()
		if err != nil {
			t.Fatalf("after %d rows: %v", len(got), err)
		}
		got = append(got, fmt.Sprintf("%s/%s/%d", r.GetRolloutId(), r.GetSampleId(), r.GetRow()))
		cursor = r.GetCursor()
	}
	killed.proc.Stop(syscall.SIGKILL, 5*time.Second)
	for {
		r, err := stream.Recv()
		if err != nil {
			break
		}
		got = append(got, fmt.Sprintf("%s/%s/%d", r.GetRolloutId(), r.GetSampleId(), r.GetRow()))
		cursor = r.GetCursor()
	}

	away := run("kill-3", 6, 7)
	want = append(want, away...)
	lines, body := restStream(t, ctx, c.gateway+"/v1/rows:stream?after="+url.QueryEscape(cursor))
	defer body.Close()
	next := func(n int) {
		t.Helper()
		for range n {
			line, ok := <-lines
			if !ok {
				t.Fatalf("the REST stream ended after %d rows", len(got))
			}
			var r struct {
				RolloutID string `json:"rollout_id"`
				SampleID  string `json:"sample_id"`
				Row       int    `json:"row"`
				Error     any    `json:"error"`
			}
			if err := json.Unmarshal([]byte(line), &r); err != nil || r.Error != nil || r.RolloutID == "" {
				t.Fatalf("line %q: %v", line, err)
			}
			got = append(got, fmt.Sprintf("%s/%s/%d", r.RolloutID, r.SampleID, r.Row))
		}
	}
	next(len(want) - len(got))
	later := run("kill-4", 8, 9)
	want = append(want, later...)
	next(len(later))

	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("rows across the kill:\n got %s\nwant %s", strings.Join(got, " "), strings.Join(want, " "))
	}
}

// restStream opens a REST rows stream, retrying while the gateway finds no
// live replica, and sends its lines on the channel until it ends.
func restStream(t *testing.T, ctx context.Context, u string) (<-chan string, interface{ Close() error }) {
	t.Helper()
	var resp *http.Response
	deadline := time.Now().Add(20 * time.Second)
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err = http.DefaultClient.Do(req)
		if err == nil && resp.StatusCode == http.StatusOK {
			break
		}
		if err == nil {
			resp.Body.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: %v %v", u, resp, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 16<<20)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			case <-ctx.Done():
				return
			}
		}
	}()
	return lines, resp.Body
}
