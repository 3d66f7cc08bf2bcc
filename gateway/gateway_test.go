package gateway_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo/gateway"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/gen/osmo/rollout/v1/rolloutv1connect"
	"github.com/osmo-rl/osmo/internal/logtest"
)

func TestNewValidatesConfig(t *testing.T) {
	cases := []struct {
		name string
		cfg  gateway.Config
		want string
	}{
		{"no rollout connection", gateway.Config{}, "Config.Rollout is required"},
		{"negative body limit", gateway.Config{Rollout: unusedConn{}, MaxBodyBytes: -1}, "MaxBodyBytes must not be negative"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h, err := gateway.New(c.cfg)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("New = %v, %v; want an error containing %q", h, err, c.want)
			}
		})
	}
}

func TestFailuresAreLoggedWithRolloutID(t *testing.T) {
	var logs logtest.Buffer
	fake := &fakeRollout{errs: map[string]error{"broken": status.Error(codes.Internal, "disk full")}}
	h := newHarness(t, fake, withLogger(slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))))

	header := http.Header{"X-Rollout-Id": {"r-rest"}, "X-Sample-Id": {"s-1"}}
	if resp := h.do(t, http.MethodGet, "/v1/rollouts/broken", "", header); resp.status != http.StatusInternalServerError {
		t.Fatalf("REST status = %d", resp.status)
	}
	ctx, info := connect.NewClientContext(testContext(t))
	info.RequestHeader().Set("X-Rollout-Id", "r-connect")
	client := rolloutv1connect.NewRolloutServiceClient(h.client, h.restURL)
	if _, err := client.GetRollout(ctx, &rolloutv1.GetRolloutRequest{RolloutId: "broken"}); connect.CodeOf(err) != connect.CodeInternal {
		t.Fatalf("Connect err = %v", err)
	}

	want := map[string]bool{"r-rest": false, "r-connect": false}
	recs, err := logs.Records()
	if err != nil {
		t.Fatalf("log records: %v", err)
	}
	for _, rec := range recs {
		id, _ := rec["rollout_id"].(string)
		if _, ok := want[id]; !ok {
			continue
		}
		want[id] = true
		if rec["level"] != "WARN" || rec["code"] != "Internal" || rec["rpc"] != rolloutv1.RolloutService_GetRollout_FullMethodName {
			t.Errorf("record = %v, want WARN Internal for GetRollout", rec)
		}
		if id == "r-rest" && rec["sample_id"] != "s-1" {
			t.Errorf("record = %v, want sample_id s-1", rec)
		}
	}
	for id, seen := range want {
		if !seen {
			t.Errorf("no log record with rollout_id %s", id)
		}
	}
}

// unusedConn satisfies grpc.ClientConnInterface for tests that never call.
type unusedConn struct{}

func (unusedConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	return status.Error(codes.Internal, "unused")
}

func (unusedConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, status.Error(codes.Internal, "unused")
}
