//go:build unix

package e2e

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/controller"
)

// The SSRF tries of these tests aim osmo at the cloud metadata service.
const (
	ssrfMetadata = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"
	ssrfMapped   = "http://[::ffff:169.254.169.254]/latest/meta-data/"
	ssrfLinkV6   = "http://[fe80::a9fe:a9fe]/latest/meta-data/"
)

// ssrfCallbackKey is the v0.3 trainer's callback key.
const ssrfCallbackKey = "ssrf-callback-key"

// ssrfStack is osmo serve with a trainer of each wire (G1, G2, v0.3) on
// host, all sharing one mock policy.
type ssrfStack struct {
	base string
	srv  *proc
	g1   *controller.Controller
	g2   *controller.G2
	v03  *controller.V03
}

// startSSRF runs the stack; the trainers listen on host (a loopback
// address) and serve gets args.
func startSSRF(t *testing.T, host string, args ...string) *ssrfStack {
	t.Helper()
	policy := "http://" + startMockPolicy(t) + "/v1"
	s := &ssrfStack{}
	var err error
	if s.g1, err = controller.New(host+":0", controller.Options{PolicyURL: policy, Logger: quietLog()}); err != nil {
		t.Skipf("no trainer on %s: %v", host, err)
	}
	serveUntilEnd(t, s.g1.Serve)
	if s.g2, err = controller.NewG2(host+":0", controller.G2Options{PolicyURL: policy, Logger: quietLog()}); err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, s.g2.Serve)
	if s.v03, err = controller.NewV03(host+":0", controller.V03Options{PolicyURL: policy, CallbackKey: ssrfCallbackKey, Logger: quietLog()}); err != nil {
		t.Fatal(err)
	}
	serveUntilEnd(t, s.v03.Serve)
	// A long delivery deadline: a refused callback that was retried would
	// still be pending when the tests look.
	var addrs map[string]string
	s.srv, addrs = startListening(t, "serve", nil, append([]string{"serve", "--workflow", "calculator", "-H", "127.0.0.1", "-p", "0",
		"--delivery-deadline", "5m", "--log-level", "info"}, args...)...)
	s.base = addrs["http"]
	waitHTTP(t, s.srv, s.base+"/health")
	return s
}

// ssrfWire starts rollouts of one wire by hand, so any field can be spoiled.
type ssrfWire struct {
	name, path string
	body       func(s *ssrfStack, id string) map[string]any
	urlFields  []string
	// callback is the field whose URL gets the wire's first callback.
	callback string
}

var ssrfWires = []ssrfWire{
	{
		name: "G1", path: "/v1/rollout/init",
		body: func(s *ssrfStack, id string) map[string]any {
			return map[string]any{
				"rollout_id": id, "server_url": s.g1.URL(),
				"messages":          []any{map[string]any{"role": "user", "content": "What is 6 * 7?"}},
				"completion_params": map[string]any{},
			}
		},
		urlFields: []string{"server_url", "tool_server_url"},
		callback:  "server_url",
	},
	{
		name: "G2", path: "/rollout",
		body: func(s *ssrfStack, id string) map[string]any {
			return s.g2.StartBody(id, []map[string]any{{"role": "user", "content": "What is 6 * 7?"}})
		},
		urlFields: []string{"chat_completions_url", "completion_callback_url", "grader_callback_url"},
		callback:  "completion_callback_url",
	},
	{
		name: "v0.3", path: "/rollout",
		body: func(s *ssrfStack, id string) map[string]any {
			return map[string]any{
				"rollout_id":              id,
				"initial_messages":        []any{map[string]any{"role": "user", "content": "What is 6 * 7?"}},
				"chat_completions_url":    s.v03.ChatCompletionsURL(id),
				"completion_callback_url": s.v03.CompletionURL(id),
				"grader_callback_url":     s.v03.GraderURL(id),
				"controller_api_key":      ssrfCallbackKey,
				"llm_api_key":             "llm-key",
			}
		},
		urlFields: []string{"chat_completions_url", "completion_callback_url", "grader_callback_url"},
		callback:  "completion_callback_url",
	},
}

func (w ssrfWire) id(prefix string) string {
	return prefix + "-" + strings.ReplaceAll(strings.ToLower(w.name), ".", "")
}

// post sends body as JSON and returns the status and decoded answer.
func ssrfPost(t *testing.T, url string, body map[string]any) (int, map[string]any) {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	code, _, m := do(t, "POST", url, "", string(b))
	return code, m
}

// finished polls GET /v1/rollouts/{id} until the rollout finished (its
// callbacks delivered or given up on) and returns it.
func (s *ssrfStack) finished(t *testing.T, id string, within time.Duration) map[string]any {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		resp, err := http.Get(s.base + "/v1/rollouts/" + url.PathEscape(id))
		if err == nil {
			var m map[string]any
			_ = json.NewDecoder(resp.Body).Decode(&m)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && (m["finished_at"] != nil || m["finishedAt"] != nil) {
				return m
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("rollout %s did not finish within %s:\n%s", id, within, tail(s.srv.Output(), 4000))
	return nil
}

// field is a rollout's string field, under its JSON name either way.
func field(m map[string]any, snake, camel string) string {
	if v, ok := m[snake].(string); ok {
		return v
	}
	v, _ := m[camel].(string)
	return v
}

// TestSSRFLiteralsRefusedAtAdmission: on every wire, each URL field aimed
// at the metadata address (IPv4, IPv4-mapped IPv6) or at IPv6 link-local
// is refused with 422 naming the field, and nothing is started.
func TestSSRFLiteralsRefusedAtAdmission(t *testing.T) {
	s := startSSRF(t, "127.0.0.1")
	for _, w := range ssrfWires {
		for _, f := range w.urlFields {
			for _, u := range []string{ssrfMetadata, ssrfMapped, ssrfLinkV6} {
				body := w.body(s, w.id("ssrf-admit"))
				body[f] = u
				code, m := ssrfPost(t, s.base+w.path, body)
				detail, _ := m["detail"].(string)
				if code != http.StatusUnprocessableEntity || !strings.HasPrefix(detail, f+":") || !strings.Contains(detail, "denied") {
					t.Errorf("%s %s=%s: %d %v, want 422 naming %s", w.name, f, u, code, m, f)
				}
			}
		}
	}
	if n := countLines(s.srv.Output(), "169.254.169.254", "callback attempt"); n != 0 {
		t.Errorf("osmo attempted %d callbacks toward the refused URLs", n)
	}
}

// TestSSRFRedirectNotFollowed: a trainer's callback endpoint on loopback
// answers 307 to the metadata address. On every wire the callback fails at
// once, permanently (asked once, not retried over the 5m delivery
// deadline), with the reason in the rollout's callback_error and the log.
func TestSSRFRedirectNotFollowed(t *testing.T) {
	s := startSSRF(t, "127.0.0.1")
	var redirects atomic.Int32
	g1 := httputil.NewSingleHostReverseProxy(mustURL(t, s.g1.URL()))
	redirector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			g1.ServeHTTP(w, r) // G1's policy calls go to its server_url too
			return
		}
		redirects.Add(1)
		http.Redirect(w, r, ssrfMetadata, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(redirector.Close)
	for _, w := range ssrfWires {
		t.Run(w.name, func(t *testing.T) {
			redirects.Store(0)
			id := w.id("ssrf-redirect")
			body := w.body(s, id)
			body[w.callback] = redirector.URL + "/callbacks/completion"
			if code, m := ssrfPost(t, s.base+w.path, body); code/100 != 2 {
				t.Fatalf("start: %d %v", code, m)
			}
			r := s.finished(t, id, 30*time.Second)
			ce := field(r, "callback_error", "callbackError")
			if !strings.Contains(ce, "redirect from 127.0.0.1") || !strings.Contains(ce, "to another host, 169.254.169.254, not followed") {
				t.Errorf("callback_error %q: want the redirect refused", ce)
			}
			if n := redirects.Load(); n != 1 {
				t.Errorf("the redirecting endpoint was asked %d times, want once", n)
			}
			if countLines(s.srv.Output(), id, "not followed") == 0 {
				t.Errorf("no log line gives the reason:\n%s", tail(s.srv.Output(), 3000))
			}
		})
	}
}

// TestSSRFNameCheckedAtDial: a host name is not judged at admission but
// where the connection is made, on the address the system resolver gives.
// The test cannot make a name resolve to 169.254.169.254 for a process of
// its own, so it denies loopback instead (--deny-outbound), names the
// trainer "localhost", and keeps its trainers on 127.0.0.2: a rollout whose
// policy or callback URL says localhost is accepted, and fails at dial
// time with the reason, its callbacks not retried.
func TestSSRFNameCheckedAtDial(t *testing.T) {
	if ln, err := net.Listen("tcp", "127.0.0.2:0"); err != nil {
		t.Skipf("127.0.0.2 is not usable here: %v", err)
	} else {
		ln.Close()
	}
	s := startSSRF(t, "127.0.0.2", "--deny-outbound", "127.0.0.1/32,::1/128")
	toLocalhost := func(t *testing.T, raw string) string {
		u := mustURL(t, raw)
		u.Host = net.JoinHostPort("localhost", u.Port())
		return u.String()
	}
	for _, w := range ssrfWires {
		for _, f := range w.urlFields {
			if f == "tool_server_url" {
				continue // osmo never calls it; it is for the agent
			}
			t.Run(w.name+"/"+f, func(t *testing.T) {
				id := w.id("ssrf-dial") + "-" + f
				body := w.body(s, id)
				body[f] = toLocalhost(t, body[f].(string))
				if code, m := ssrfPost(t, s.base+w.path, body); code/100 != 2 {
					t.Fatalf("start: %d %v, want it accepted (a name is judged at dial time)", code, m)
				}
				r := s.finished(t, id, 30*time.Second)
				errMsg, ce := field(r, "error_message", "errorMessage"), field(r, "callback_error", "callbackError")
				denied := "denied (127.0.0.1/32 --deny-outbound"
				if !strings.Contains(errMsg+ce, denied) && !strings.Contains(errMsg+ce, "denied (::1/128 --deny-outbound") {
					t.Fatalf("error %q, callback_error %q: want the dial refused with its reason", errMsg, ce)
				}
				if strings.Contains(ce, "gave up after") {
					t.Errorf("callback_error %q: the refused callback was retried", ce)
				}
			})
		}
	}
	if countLines(s.srv.Output(), "outbound address", "denied") == 0 {
		t.Errorf("no log line gives the reason:\n%s", tail(s.srv.Output(), 3000))
	}
}

func mustURL(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}
