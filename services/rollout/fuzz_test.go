package rollout

import (
	"errors"
	"net/url"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
)

// FuzzWireBodies feeds the request bodies of every wire, decoded as the
// gateway decodes them, to the service's checks: G1's init (kind 0), G2's
// and v0.3's start (1) and the cancel (2). A body is accepted only when
// what the rollout then relies on holds (an id that is one path segment,
// http(s) URLs with a host, usable header values); a refusal names a field
// of the request. Seeds are in testdata/fuzz.
func FuzzWireBodies(f *testing.F) {
	f.Add(uint8(0), []byte(`{"rollout_id":"r-1","server_url":"http://trainer:8080","messages":[{"role":"user","content":"What is 2+2?"}],"completion_params":{"temperature":1.0},"tool_server_url":null,"max_turns":4,"max_tokens_total":8192,"metadata":{"ground_truth":"4"},"api_key":"k","idempotency_key":null}`))
	f.Add(uint8(1), []byte(`{"rollout_id":"r-2","initial_messages":[{"role":"user","content":"hi"}],"chat_completions_url":"http://trainer/v1","completion_callback_url":"http://trainer/callbacks/completion","grader_callback_url":"http://trainer/callbacks/grader","label":"42","controller_api_key":"ctl","agent_timeout_sec":300,"grader_timeout_sec":60,"metadata":{"row":1}}`))
	f.Add(uint8(1), []byte(`{"initial_messages":[],"chat_completions_url":"http://127.0.0.1:9/v1","completion_callback_url":"http://127.0.0.1:9/v1/rollouts/r%2F3/completion","llm_api_key":"","controller_api_key":"c"}`))
	f.Add(uint8(2), []byte(`{"ids":["a",""],"prefix":"p","all":true}`))
	f.Fuzz(func(t *testing.T, kind uint8, body []byte) {
		opts := protojson.UnmarshalOptions{DiscardUnknown: true}
		var msg proto.Message
		var err error
		switch kind % 3 {
		case 0:
			req := &rolloutv1.InitRolloutRequest{}
			if opts.Unmarshal(body, req) != nil {
				return
			}
			msg, err = req, validateInit(req, 1<<10, nil)
			if err == nil {
				checkURL(t, "server_url", req.GetServerUrl())
				checkID(t, req.GetRolloutId())
			}
		case 1:
			req := &rolloutv1.StartRolloutRequest{}
			if opts.Unmarshal(body, req) != nil {
				return
			}
			id := req.GetRolloutId()
			if id == "" {
				id = idFromCompletionURL(req.GetCompletionCallbackUrl())
			}
			msg, err = req, validateStart(req, id, 1<<10, nil, true)
			if err == nil {
				checkID(t, id)
				if strings.ContainsAny(id, "/\\") || id == "." || id == ".." {
					t.Fatalf("accepted rollout id %q, which is not one path segment", id)
				}
				checkURL(t, "chat_completions_url", req.GetChatCompletionsUrl())
				checkURL(t, "completion_callback_url", req.GetCompletionCallbackUrl())
				if req.GraderCallbackUrl != nil {
					checkURL(t, "grader_callback_url", req.GetGraderCallbackUrl())
				}
				if req.LlmApiKey != nil && req.GetLlmApiKey() == "" {
					t.Fatal("accepted an empty llm_api_key")
				}
				for _, key := range []string{req.GetControllerApiKey(), req.GetLlmApiKey()} {
					if strings.ContainsAny(key, "\r\n\x00") {
						t.Fatalf("accepted key %q, which cannot be a header value", key)
					}
				}
			}
		default:
			req := &rolloutv1.CancelRolloutsRequest{}
			if opts.Unmarshal(body, req) != nil {
				return
			}
			msg, err = req, validateCancel(req)
		}
		if err == nil {
			return
		}
		var fe *fielderr.Error
		if !errors.As(err, &fe) {
			t.Fatalf("refused with %T %v, want an error naming a field", err, err)
		}
		top, _, _ := strings.Cut(fe.Field, ".")
		top, _, _ = strings.Cut(top, "[")
		if msg.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(top)) == nil {
			t.Fatalf("refused naming %q, which is not a field of %s", fe.Field, msg.ProtoReflect().Descriptor().Name())
		}
	})
}

func checkID(t *testing.T, id string) {
	t.Helper()
	if strings.TrimSpace(id) == "" || strings.ContainsRune(id, 0) {
		t.Fatalf("accepted rollout id %q", id)
	}
}

func checkURL(t *testing.T, field, raw string) {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		t.Fatalf("accepted %s %q, which is not an http(s) URL with a host", field, raw)
	}
}
