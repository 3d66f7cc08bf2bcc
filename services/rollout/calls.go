package rollout

import (
	"bytes"
	"encoding/json"
	"slices"

	"github.com/osmo-rl/osmo"
)

// compact makes c, a call as the proxy recorded it, count the leading
// request messages it shares with prev (its sample's previous call's whole
// request) and keep only the rest: an agent sends its whole conversation
// with every call. It returns c's whole request messages.
func compact(c *osmo.LLMCall, prev []json.RawMessage) []json.RawMessage {
	msgs := c.RequestMessages
	k := 0
	for k < len(msgs) && k < len(prev) && bytes.Equal(msgs[k], prev[k]) {
		k++
	}
	// A copy of the rest: the list's array would hold the shared ones too.
	c.SharedRequestMessages, c.RequestMessages = k, slices.Clone(msgs[k:])
	// prev is the record's own list, extended in place.
	return append(prev[:k], c.RequestMessages...)
}

// wholeRequests is the whole request messages of each of a sample's
// calls, expanding the shared ones from the calls before it.
func wholeRequests(calls []*osmo.LLMCall) [][]json.RawMessage {
	out := make([][]json.RawMessage, len(calls))
	var prev []json.RawMessage
	for i, c := range calls {
		k := min(c.SharedRequestMessages, len(prev))
		prev = append(prev[:k:k], c.RequestMessages...)
		out[i] = prev
	}
	return out
}
