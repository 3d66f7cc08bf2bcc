package rollout_test

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/netguard"
	"github.com/osmo-rl/osmo/internal/netguard/netguardtest"
	"github.com/osmo-rl/osmo/services/rollout"
)

// The SSRF tries: URLs a hostile trainer names to make the service reach
// the cloud metadata service.
const (
	metadataLiteral = "http://169.254.169.254/latest/meta-data"
	mappedLiteral   = "http://[::ffff:169.254.169.254]/latest/meta-data"
	v6LinkLocal     = "http://[fe80::a9fe:a9fe%25eth0]:80/v1"
	// metadataName resolves to 169.254.169.254 (outboundHarness's resolver).
	metadataName = "metadata.test"
)

// wireStart is a start request of one wire, as JSON for the gateway, with
// every URL on the harness's trainers but for field, set to u.
type wireStart struct {
	name, path string
	body       func(h *harness, id string) map[string]any
	// fields are the URL fields of the wire.
	fields []string
}

var wireStarts = []wireStart{
	{
		name: "g1", path: "/v1/rollout/init",
		body: func(h *harness, id string) map[string]any {
			return map[string]any{
				"rollout_id": id, "server_url": h.g1.URL(),
				"messages":          []any{map[string]any{"role": "user", "content": "What is 6 * 7?"}},
				"completion_params": map[string]any{},
			}
		},
		fields: []string{"server_url", "tool_server_url"},
	},
	{
		name: "g2", path: "/rollout",
		body: func(h *harness, id string) map[string]any {
			return h.g2.StartBody(id, []map[string]any{{"role": "user", "content": "What is 6 * 7?"}})
		},
		fields: []string{"chat_completions_url", "completion_callback_url", "grader_callback_url"},
	},
	{
		name: "v0.3", path: "/rollout",
		body: func(h *harness, id string) map[string]any {
			return map[string]any{
				"rollout_id": id, "initial_messages": []any{map[string]any{"role": "user", "content": "What is 6 * 7?"}},
				"chat_completions_url":    h.v03.ChatCompletionsURL(id),
				"completion_callback_url": h.v03.CompletionURL(id),
				"grader_callback_url":     h.v03.GraderURL(id),
				"controller_api_key":      v03CtlKey,
				"llm_api_key":             v03LLMKey,
			}
		},
		fields: []string{"chat_completions_url", "completion_callback_url", "grader_callback_url"},
	},
}

// TestOutboundLiteralsRefusedAtAdmission: a URL whose host is a denied IP
// literal is refused with 422 naming its field, on every wire.
func TestOutboundLiteralsRefusedAtAdmission(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	for _, w := range wireStarts {
		for _, field := range w.fields {
			for _, u := range []string{metadataLiteral, mappedLiteral, v6LinkLocal} {
				t.Run(w.name+"/"+field+"/"+u, func(t *testing.T) {
					body := w.body(h, "ssrf-admit")
					body[field] = u
					code, answer := postJSON(t, h.rest+w.path, body)
					var m map[string]any
					_ = json.Unmarshal([]byte(answer), &m)
					detail, _ := m["detail"].(string)
					if code != http.StatusUnprocessableEntity || !strings.HasPrefix(detail, field+":") || !strings.Contains(detail, "denied") {
						t.Fatalf("got %d %s, want 422 naming %s", code, answer, field)
					}
				})
			}
		}
	}
}

// outboundHarness is a harness whose service resolves metadata.test to
// 169.254.169.254 and trainer.test to loopback, and follows the delivery
// deadline of 3s.
func outboundHarness(t *testing.T) *harness {
	r := netguardtest.Resolver(map[string]netip.Addr{
		metadataName + ".": netip.MustParseAddr("169.254.169.254"),
	})
	return newHarness(t, harnessOpts{cfg: func(c *rollout.Config) {
		c.Outbound = netguard.Default().WithResolver(r)
	}})
}

// onMetadata is u with its host replaced by metadataName, port kept.
func onMetadata(t *testing.T, u string) string {
	t.Helper()
	p, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	p.Host = net.JoinHostPort(metadataName, p.Port())
	return p.String()
}

// TestOutboundNamesRefusedAtDial: a host name admission cannot judge is
// accepted, and the connection to the address it resolves to is refused:
// the policy call fails the rollout, a callback fails at once (not retried
// over the delivery deadline), each with the reason.
func TestOutboundNamesRefusedAtDial(t *testing.T) {
	h := outboundHarness(t)
	for _, w := range wireStarts {
		for _, field := range w.fields {
			if field == "tool_server_url" {
				continue // the service never calls it
			}
			t.Run(w.name+"/"+field, func(t *testing.T) {
				id := "ssrf-dial-" + strings.ReplaceAll(w.name, ".", "") + "-" + field
				body := w.body(h, id)
				body[field] = onMetadata(t, body[field].(string))
				code, answer := postJSON(t, h.rest+w.path, body)
				if code != http.StatusAccepted && code != http.StatusOK {
					t.Fatalf("start: %d %s, want it accepted", code, answer)
				}
				start := time.Now()
				r := h.waitDone(t, id)
				took := time.Since(start)
				const reason = "outbound address 169.254.169.254 denied (169.254.0.0/16"
				switch field {
				case "server_url", "chat_completions_url":
					if !strings.Contains(r.GetErrorMessage(), reason) {
						t.Errorf("rollout error %q does not give the reason", r.GetErrorMessage())
					}
				default:
					if ce := r.GetCallbackError(); !strings.Contains(ce, reason) || !strings.Contains(ce, "not retried") {
						t.Errorf("callback error %q: want the reason, not retried", ce)
					}
					if took > 2*time.Second {
						t.Errorf("the refused callback took %s: retried toward the 3s deadline", took)
					}
				}
			})
		}
	}
}

// TestOutboundRedirectNotFollowed: a callback endpoint that redirects to
// the metadata address fails the callback at once, with one request made.
func TestOutboundRedirectNotFollowed(t *testing.T) {
	h := newHarness(t, harnessOpts{})
	var hits atomic.Int32
	redirector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		http.Redirect(w, r, metadataLiteral+"/iam/security-credentials/", http.StatusTemporaryRedirect)
	}))
	defer redirector.Close()
	for _, w := range wireStarts {
		t.Run(w.name, func(t *testing.T) {
			hits.Store(0)
			id := "ssrf-redirect-" + strings.ReplaceAll(w.name, ".", "")
			body := w.body(h, id)
			cbField := "completion_callback_url"
			if w.name == "g1" {
				cbField = "server_url" // its completion goes to {server_url}/v1/rollout/completed
			}
			body[cbField] = redirector.URL + "/callback"
			code, answer := postJSON(t, h.rest+w.path, body)
			if code != http.StatusAccepted && code != http.StatusOK {
				t.Fatalf("start: %d %s", code, answer)
			}
			r := h.waitDone(t, id)
			if ce := r.GetCallbackError(); !strings.Contains(ce, "to another host, 169.254.169.254, not followed") {
				t.Errorf("callback error %q: want the redirect refused", ce)
			}
			if w.name != "g1" && hits.Load() != 1 {
				t.Errorf("the redirecting endpoint was asked %d times, want once", hits.Load())
			}
		})
	}
}
