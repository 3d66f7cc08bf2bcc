package gateway

import (
	"encoding/json"
	"net/http/httptest"
	"regexp"
	"testing"

	"github.com/osmo-rl/osmo/gen/openapi"
)

// TestSpanName: spans are named after routes, never after the ids in a path.
func TestSpanName(t *testing.T) {
	for _, tc := range []struct{ method, path, want string }{
		{"POST", "/v1/rollout/init", "POST /v1/rollout/init"},
		{"GET", "/v1/rollouts/r-1", "GET /v1/rollouts/{rollout_id}"},
		{"GET", "/v1/rollouts/r-1/rows", "GET /v1/rollouts/{rollout_id}/rows"},
		{"GET", "/v1/rollouts//rows", "GET"},
		{"GET", "/v1/rows:stream", "GET /v1/rows:stream"},
		{"POST", "/rollout", "POST /rollout"},
		{"POST", "/rollout/cancel", "POST /rollout/cancel"},
		{"GET", "/rollout/r-1/status", "GET /rollout/{rollout_id}/status"},
		{"GET", "/rollout/a/b/status", "GET"},
		{"POST", "/osmo.rollout.v1.RolloutService/StartRollout", "/osmo.rollout.v1.RolloutService/StartRollout"},
		{"GET", "/health", "GET /health"},
		{"GET", "/secret-123", "GET"},
		{"GET", "/v1/rollouts/a%2Fb", "GET /v1/rollouts/{rollout_id}"},
		{"GET", "/rollout/a%2Fb/status", "GET /rollout/{rollout_id}/status"},
		{"GET", "/v1/rollouts/", "GET"},
		{"GET", "/rollout//status", "GET"},
		{"POST", "/osmo.rollout.v1.RolloutService/", "POST"},
	} {
		if got := spanName("", httptest.NewRequest(tc.method, tc.path, nil)); got != tc.want {
			t.Errorf("spanName(%s %s) = %q, want %q", tc.method, tc.path, got, tc.want)
		}
	}
}

// TestRouteOfOpenAPI: every path of the REST API maps to its own template,
// so a route added to the API and not to routeOf fails here.
func TestRouteOfOpenAPI(t *testing.T) {
	var doc struct {
		Paths map[string]map[string]any `json:"paths"`
	}
	if err := json.Unmarshal(openapi.JSON(), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Paths) == 0 {
		t.Fatal("the OpenAPI document has no paths")
	}
	param := regexp.MustCompile(`\{[^}]+\}`)
	for tmpl, ops := range doc.Paths {
		path := param.ReplaceAllString(tmpl, "id-1")
		for method := range ops {
			r := httptest.NewRequest(method, path, nil)
			if got := routeOf(r); got != tmpl {
				t.Errorf("routeOf(%s %s) = %q, want %q", method, path, got, tmpl)
			}
		}
	}
}
