package llmproxy

import (
	"context"
	"net/url"
	"strings"
	"sync"
)

// Route says where the calls of one rollout go.
type Route struct {
	// BaseURL is the upstream's OpenAI base URL; the proxy appends
	// /chat/completions. Example: http://vllm:8000/v1.
	BaseURL string
	// APIKey is the bearer sent upstream. Empty forwards the client's
	// Authorization header unchanged.
	APIKey string
	// Model replaces the placeholder model (osmo.PlaceholderModel) in requests.
	// Empty leaves the requested model as it is.
	Model string
	// PinModel sends every call to the policy whatever model it names: to
	// Model, or to the placeholder when Model is empty. Agents the user did
	// not write for osmo name models of their own ("gpt-4.1"); in a rollout
	// every call must reach the current policy, and the name asked for is
	// still recorded (Call.RequestedModel).
	PinModel bool
	// InjectRolloutID adds "rollout_id" to the request body, as the Osmosis
	// remote-rollout (G1) controllers expect.
	InjectRolloutID bool
	// ClientToken, when set, is the bearer a client must present; the proxy
	// then sends APIKey (or nothing) upstream instead of the client's header.
	ClientToken string
	// Context, when set, bounds every call of the route: when it ends (the
	// rollout was cancelled or timed out) in-flight upstream calls are aborted.
	Context context.Context
}

// Router finds the route of a rollout.
type Router interface {
	Route(rolloutID string) (Route, bool)
}

// RouteTable is a concurrency-safe Router keyed by rollout id, with an
// optional default for rollouts it does not know.
type RouteTable struct {
	mu       sync.RWMutex
	routes   map[string]Route
	fallback *Route
}

// NewRouteTable returns an empty table.
func NewRouteTable() *RouteTable { return &RouteTable{routes: map[string]Route{}} }

// StaticRouter sends every rollout to one route.
func StaticRouter(r Route) *RouteTable {
	t := NewRouteTable()
	t.SetDefault(r)
	return t
}

// Set installs the route of rolloutID.
func (t *RouteTable) Set(rolloutID string, r Route) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.routes[rolloutID] = r
}

// Delete removes the route of rolloutID.
func (t *RouteTable) Delete(rolloutID string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.routes, rolloutID)
}

// SetDefault sets the route for rollouts without their own.
func (t *RouteTable) SetDefault(r Route) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.fallback = &r
}

// Route implements Router.
func (t *RouteTable) Route(rolloutID string) (Route, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if r, ok := t.routes[rolloutID]; ok {
		return r, true
	}
	if t.fallback != nil {
		return *t.fallback, true
	}
	return Route{}, false
}

// BaseURLFor is the OpenAI base URL (ending in /v1) that binds a client to
// one rollout and sample through the path, for clients that cannot set
// headers: {proxyURL}/r/{rolloutID}/s/{sampleID}/v1.
func BaseURLFor(proxyURL, rolloutID, sampleID string) string {
	return strings.TrimRight(proxyURL, "/") + "/r/" + url.PathEscape(rolloutID) + "/s/" + url.PathEscape(sampleID) + "/v1"
}
