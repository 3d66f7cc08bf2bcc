package gateway

import (
	"net/http/httptest"
	"testing"
)

// TestSpanName: spans are named after routes, never after the ids in a path.
func TestSpanName(t *testing.T) {
	for _, tc := range []struct{ method, path, want string }{
		{"POST", "/v1/rollout/init", "POST /v1/rollout/init"},
		{"GET", "/v1/rollouts/r-1", "GET /v1/rollouts/{rollout_id}"},
		{"POST", "/rollout", "POST /rollout"},
		{"POST", "/rollout/cancel", "POST /rollout/cancel"},
		{"GET", "/rollout/r-1/status", "GET /rollout/{rollout_id}/status"},
		{"GET", "/rollout/a/b/status", "GET"},
		{"POST", "/osmo.rollout.v1.RolloutService/StartRollout", "/osmo.rollout.v1.RolloutService/StartRollout"},
		{"GET", "/health", "GET /health"},
		{"GET", "/secret-123", "GET"},
	} {
		if got := spanName("", httptest.NewRequest(tc.method, tc.path, nil)); got != tc.want {
			t.Errorf("spanName(%s %s) = %q, want %q", tc.method, tc.path, got, tc.want)
		}
	}
}
