package controller_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo/internal/controller"
)

// startG1 runs a G1 controller in front of a mockllm policy until the test
// ends.
func startG1(t *testing.T, o controller.Options) *controller.Controller {
	t.Helper()
	o.PolicyURL = startPolicy(t, nil)
	o.Logger = quiet()
	c, err := controller.New("127.0.0.1:0", o)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, c)
	return c
}

// failShare is how many of n injected-failure draws at fraction 0.2 may
// fail without the test calling the injection broken: the mean is n/5,
// and these bounds are more than six standard deviations away.
func failShare(n int) (lo, hi int) { return n / 10, n * 3 / 10 }

// TestG1FailFraction: with FailFraction 0.2 about a fifth of the completion
// posts answer 503 and are not recorded; the rest are recorded.
func TestG1FailFraction(t *testing.T) {
	c := startG1(t, controller.Options{FailFraction: 0.2})
	const n = 400
	failed := 0
	for i := range n {
		body := fmt.Sprintf(`{"rollout_id":"r%d","status":"COMPLETED","final_messages":[]}`, i)
		switch code, _, _ := post(t, c.URL()+"/v1/rollout/completed", nil, body); code {
		case http.StatusOK:
			if got := len(c.Completions(fmt.Sprintf("r%d", i))); got != 1 {
				t.Fatalf("r%d: answered 200 but %d completions recorded", i, got)
			}
		case http.StatusServiceUnavailable:
			failed++
			if got := len(c.Completions(fmt.Sprintf("r%d", i))); got != 0 {
				t.Fatalf("r%d: answered 503 but %d completions recorded", i, got)
			}
		default:
			t.Fatalf("post %d: %d", i, code)
		}
	}
	if lo, hi := failShare(n); failed < lo || failed > hi {
		t.Errorf("%d of %d completion posts failed, want about a fifth", failed, n)
	}
	if c.FailedCallbacks() != failed {
		t.Errorf("FailedCallbacks = %d, want %d", c.FailedCallbacks(), failed)
	}
	// A malformed completion is refused as such, never counted as injected.
	if code, _, _ := post(t, c.URL()+"/v1/rollout/completed", nil, `{"status":"COMPLETED"}`); code != http.StatusUnprocessableEntity {
		t.Errorf("completion without an id: %d, want 422", code)
	}
	if c.FailedCallbacks() != failed {
		t.Errorf("a malformed post counted as an injected failure")
	}
}

func TestNewRefusesBadFailFraction(t *testing.T) {
	for _, f := range []float64{-0.1, 1.5} {
		if _, err := controller.New("127.0.0.1:0", controller.Options{PolicyURL: "http://x/v1", FailFraction: f}); err == nil || !strings.Contains(err.Error(), "FailFraction") {
			t.Errorf("FailFraction %v: %v, want an error naming it", f, err)
		}
	}
}
