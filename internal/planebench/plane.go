package planebench

import (
	"context"
	"net/http"
	"time"

	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// NewPlane builds the plane `osmo bench plane` measures: the proxy over
// the set of engines, every call routed by the set, with the retries of
// `osmo llmproxy`'s defaults (a failed call goes at once to an engine it
// has not tried), its probes running until ctx ends.
func NewPlane(ctx context.Context, engines []string, tr http.RoundTripper, rec llmproxy.Recorder) (Plane, error) {
	set, err := llmproxy.NewEngines(llmproxy.EnginesConfig{URLs: engines, Transport: tr})
	if err != nil {
		return Plane{}, err
	}
	go func() { _ = set.Run(ctx) }()
	p, err := llmproxy.New(llmproxy.Config{
		Router:            llmproxy.StaticRouter(llmproxy.Route{Model: "bench-policy"}),
		Recorder:          rec,
		Retry:             llmproxy.RetryPolicy{MaxRetries: 3, BaseDelay: time.Second, MaxDelay: 30 * time.Second},
		Transport:         tr,
		Engines:           set,
		EnginesOwnRouting: true,
	})
	return Plane{Handler: p, Ended: set.Forget}, err
}
