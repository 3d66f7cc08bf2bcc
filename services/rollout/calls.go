package rollout

import (
	"bytes"
	"encoding/json"

	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/jsonscan"
	"github.com/osmo-rl/osmo/internal/structjson"
	"github.com/osmo-rl/osmo/pkg/llmproxy"
)

// recordedCall is an LLM call as a rollout keeps it. An agent sends its
// whole conversation with every call, so a sample's calls would hold its
// history once per turn; instead a call keeps only the request messages
// after those it shares with the sample's previous call (shared counts
// them), and the conversation is expanded where a body needs it whole.
// Call.RequestMessages is nil: the proxy's request body is not held.
type recordedCall struct {
	llmproxy.Call
	shared int
	added  []json.RawMessage
}

// newRecordedCall compacts c against prev, the request messages of the
// sample's previous call, and returns it with the call's own request
// messages (prev's first shared ones and its added ones). The added
// messages are copied out of the request body.
func newRecordedCall(c *llmproxy.Call, prev []json.RawMessage) (*recordedCall, []json.RawMessage) {
	rc := &recordedCall{Call: *c}
	rc.RequestMessages = nil
	msgs := splitArray(c.RequestMessages)
	k := 0
	for k < len(msgs) && k < len(prev) && bytes.Equal(msgs[k], prev[k]) {
		k++
	}
	rc.shared = k
	if rest := msgs[k:]; len(rest) > 0 {
		n := 0
		for _, m := range rest {
			n += len(m)
		}
		buf := make([]byte, 0, n)
		rc.added = make([]json.RawMessage, len(rest))
		for i, m := range rest {
			buf = append(buf, m...)
			rc.added[i] = buf[len(buf)-len(m) : len(buf) : len(buf)]
		}
	}
	// prev is the record's own list (record.convs), so it is extended in
	// place.
	return rc, append(prev[:k], rc.added...)
}

// splitArray returns the objects of a JSON array of objects (the proxy
// checked that a request's messages are one), each as its bytes; nil for
// anything else.
func splitArray(raw []byte) []json.RawMessage {
	i := jsonscan.SkipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil
	}
	var out []json.RawMessage
	depth, start, inString := 0, 0, false
	for i++; i < len(raw); i++ {
		c := raw[i]
		if inString {
			switch c {
			case '\\':
				i++
			case '"':
				inString = false
			}
			continue
		}
		switch c {
		case '"':
			if depth == 0 {
				return nil
			}
			inString = true
		case '{', '[':
			if depth == 0 {
				if c != '{' {
					return nil
				}
				start = i
			}
			depth++
		case '}', ']':
			if depth == 0 {
				return out // the array's end
			}
			if depth--; depth == 0 {
				out = append(out, raw[start:i+1])
			}
		case ' ', '\t', '\n', '\r', ',', ':':
		default:
			if depth == 0 {
				return nil
			}
		}
	}
	return nil
}

// callProtos converts a sample's recorded calls to their stored form, in
// order: each call's request_messages are those after the ones it shares
// with the previous call (shared_request_messages). A call whose messages
// cannot all be converted has none, as the whole list's conversion failing
// had it, and the call after it then holds its whole list.
func callProtos(calls []*recordedCall, d *decoded) []*rolloutv1.LLMCall {
	out := make([]*rolloutv1.LLMCall, 0, len(calls))
	var whole []json.RawMessage // the previous call's request messages
	prevOK := true
	for _, c := range calls {
		p := callProto(c, d)
		own := append(whole[:c.shared:c.shared], c.added...)
		todo, shared := c.added, c.shared
		if !prevOK {
			todo, shared = own, 0
		}
		structs, ok := rawStructs(todo, d)
		if ok {
			p.RequestMessages, p.SharedRequestMessages = structs, int32(shared)
		}
		prevOK = ok
		whole = own
		out = append(out, p)
	}
	return out
}

// rawStructs decodes each message (a JSON object); false if one is not.
func rawStructs(msgs []json.RawMessage, d *decoded) ([]*structpb.Struct, bool) {
	if len(msgs) == 0 {
		return nil, true
	}
	out := make([]*structpb.Struct, len(msgs))
	for i, m := range msgs {
		s, err := d.decode(m)
		if err != nil {
			return nil, false
		}
		out[i] = s
	}
	return out, true
}

// wholeRequests calls f with each call and its whole request messages, in
// order, expanding the shared ones from the calls before it.
func wholeRequests(calls []*rolloutv1.LLMCall, f func(c *rolloutv1.LLMCall, msgs []*structpb.Struct)) {
	var prev []*structpb.Struct
	for _, c := range calls {
		msgs := c.GetRequestMessages()
		if k := min(int(c.GetSharedRequestMessages()), len(prev)); k > 0 {
			msgs = append(prev[:k:k], msgs...)
		}
		f(c, msgs)
		prev = msgs
	}
}

// wholeCalls is calls with every call's request messages whole, as the
// API answers them: copies where a call shares messages, the calls
// themselves where none does.
func wholeCalls(calls []*rolloutv1.LLMCall) []*rolloutv1.LLMCall {
	out := make([]*rolloutv1.LLMCall, 0, len(calls))
	wholeRequests(calls, func(c *rolloutv1.LLMCall, msgs []*structpb.Struct) {
		if c.GetSharedRequestMessages() != 0 {
			c = shallowCopy(c)
			c.RequestMessages, c.SharedRequestMessages = msgs, 0
		}
		out = append(out, c)
	})
	return out
}

// wholeRollout expands r's samples' calls (see wholeCalls) in place; the
// samples must be r's own (a snapshot's copies, or decoded).
func wholeRollout(r *rolloutv1.Rollout) *rolloutv1.Rollout {
	for _, sm := range r.GetSamples() {
		if len(sm.GetLlmCalls()) > 0 {
			sm.LlmCalls = wholeCalls(sm.GetLlmCalls())
		}
	}
	return r
}

// decoded are the messages of one sample decoded so far, each distinct
// JSON once: the messages its calls sent are, byte for byte, mostly those
// of its conversation (the proxy records what the agent posted), and both
// refer to one Struct. Nothing changes a Struct once collected. A nil
// *decoded decodes every message afresh.
type decoded []decodedMessage

type decodedMessage struct {
	raw []byte
	s   *structpb.Struct
}

// decode is structjson.Decode(b), or the Struct of the same JSON decoded
// before. A sample holds tens of messages: a scan, most of it comparing
// lengths, costs less than hashing each.
func (d *decoded) decode(b []byte) (*structpb.Struct, error) {
	if d == nil {
		return structjson.Decode(b)
	}
	for _, e := range *d {
		if bytes.Equal(e.raw, b) {
			return e.s, nil
		}
	}
	s, err := structjson.Decode(b)
	if err == nil {
		*d = append(*d, decodedMessage{raw: b, s: s})
	}
	return s, err
}
