package execagent

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/osmo-rl/osmo"
)

// sample is one program run, registered as the rollout's sample source.
type sample struct {
	id string

	mu      sync.Mutex
	done    bool // the program finished, and its run was judged
	msgs    []json.RawMessage
	extras  map[string]any
	failure error
}

var (
	_ osmo.SampleSource = (*sample)(nil)
	_ osmo.SampleExtras = (*sample)(nil)
)

func (s *sample) succeed(msgs []json.RawMessage, extras map[string]any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done, s.msgs, s.extras = true, msgs, extras
}

// fail records err as the sample's outcome and returns it.
func (s *sample) fail(err error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done, s.failure = true, err
	return err
}

// SampleMessages implements osmo.SampleSource: the "messages" of the
// program's last stdout line, or nil (the proxy-recorded conversation) when
// that line is not a JSON object with "messages".
func (s *sample) SampleMessages() ([]json.RawMessage, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case !s.done:
		return nil, fmt.Errorf("execagent: sample %q: the program has not finished", s.id)
	case s.failure != nil:
		return nil, s.failure
	}
	return s.msgs, nil
}

// SampleExtraFields implements osmo.SampleExtras: the "extra_fields" object
// of the last stdout line, if any.
func (s *sample) SampleExtraFields() map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.extras
}

// parseLastLine reads the sample out of the program's last stdout line. A
// line that is not a JSON object, or an object without "messages", gives nil
// messages: the proxy's record stands for the conversation. Messages are
// kept as the bytes the program wrote. A line that was
// too long to keep is an error rather than a silent fallback, since it most
// likely held the messages.
func parseLastLine(out *lastLine, maxLine int) ([]json.RawMessage, map[string]any, error) {
	if out.lastTooLong {
		return nil, nil, fmt.Errorf("last stdout line is longer than max_line_bytes (%d): raise max_line_bytes to keep it", maxLine)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(out.last, &doc); err != nil || doc == nil {
		return nil, nil, nil
	}
	var extras map[string]any
	if raw, ok := doc["extra_fields"]; ok && string(bytes.TrimSpace(raw)) != "null" {
		if err := json.Unmarshal(raw, &extras); err != nil || extras == nil {
			return nil, nil, fmt.Errorf(`last stdout line: "extra_fields" must be an object, got %.40s`, raw)
		}
	}
	raw, ok := doc["messages"]
	if !ok {
		return nil, extras, nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil || items == nil {
		return nil, nil, fmt.Errorf(`last stdout line: "messages" must be an array of objects, got %.40s`, raw)
	}
	for i, item := range items {
		if item[0] != '{' {
			return nil, nil, fmt.Errorf(`last stdout line: "messages" must be an array of objects: messages[%d] is %.40s`, i, item)
		}
	}
	return items, extras, nil
}
