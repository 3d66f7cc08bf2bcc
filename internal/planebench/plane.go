package planebench

import (
	"net/http"

	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// NewPlane builds the plane `osmo bench plane` measures: the proxy over
// the set of engines.
//
// TO WIRE: when llmproxy.Config takes an engine set (the `--policy URL`
// flags of osmo serve and osmo llmproxy), build the proxy over engines
// here, as singleProxy builds it over one upstream, with tr as its
// Transport and rec as its Recorder. Until then the plane's rows say it
// is not measured.
func NewPlane(engines []string, tr http.RoundTripper, rec llmproxy.Recorder) (http.Handler, error) {
	return nil, ErrNoEngineSet
}
