package rollout

import (
	"encoding/base64"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/osmo-rl/osmo/internal/jsonenc"
)

// appendJSON writes lc into b[:0], growing it to fit, as encoding/json
// encodes the struct (the field names, omitempty and omitzero of its tags;
// json.Unmarshal reads it back), field by field instead of by reflection.
// Not inline, the request and the callbacks' payloads are left out (a
// private state's are held in process: heldParts).
//
// Every stage write stores the whole lifecycle, the callbacks' payloads
// included. Through json.Marshal each payload, a json.RawMessage of several
// kilobytes, was scanned and compacted again on every write it rode in;
// the payloads are what marshalBody wrote (or what was read back from
// such a write), compact and valid JSON already, and are copied as they
// are. TestLifecycleMarshal holds the two encodings to the
// same decoded lifecycle.
func (lc *lifecycle) appendJSON(b []byte, inline bool) []byte {
	n := 512 + base64.StdEncoding.EncodedLen(len(lc.Response))
	if inline {
		n += base64.StdEncoding.EncodedLen(len(lc.Request))
	}
	for _, s := range lc.stages() {
		if st := s.st; st != nil {
			for _, c := range st.Callbacks {
				n += 128 + len(c.URL) + len(c.Bearer)
				if inline {
					n += len(c.Payload)
				}
			}
		}
	}
	b = slices.Grow(b[:0], n)
	b = append(b, `{"id":`...)
	b = jsonenc.AppendString(b, lc.ID)
	b = append(b, `,"key":`...)
	b = jsonenc.AppendString(b, lc.Key)
	b = append(b, `,"wire":`...)
	b = jsonenc.AppendString(b, lc.Wire)
	b = append(b, `,"workflow":`...)
	b = jsonenc.AppendString(b, lc.Workflow)
	b = append(b, `,"created":`...)
	b = appendTime(b, lc.Created)
	if inline && len(lc.Request) > 0 {
		b = append(b, `,"request":`...)
		b = appendBytes(b, lc.Request)
	}
	if len(lc.Response) > 0 {
		b = append(b, `,"response":`...)
		b = appendBytes(b, lc.Response)
	}
	if len(lc.Trace) > 0 {
		b = append(b, `,"trace":{`...)
		for i, k := range slices.Sorted(maps.Keys(lc.Trace)) {
			if i > 0 {
				b = append(b, ',')
			}
			b = jsonenc.AppendString(b, k)
			b = append(b, ':')
			b = jsonenc.AppendString(b, lc.Trace[k])
		}
		b = append(b, '}')
	}
	b = append(b, `,"phase":`...)
	b = jsonenc.AppendString(b, lc.Phase)
	b = append(b, `,"state":`...)
	b = strconv.AppendInt(b, int64(lc.State), 10)
	if lc.Owner != "" {
		b = append(b, `,"owner":`...)
		b = jsonenc.AppendString(b, lc.Owner)
	}
	if lc.Held != "" {
		b = append(b, `,"held":`...)
		b = jsonenc.AppendString(b, lc.Held)
	}
	if !lc.Started.IsZero() {
		b = append(b, `,"started":`...)
		b = appendTime(b, lc.Started)
	}
	if lc.Cancelled {
		b = append(b, `,"cancelled":true`...)
	}
	if lc.Ran != nil {
		b = append(b, `,"ran":`...)
		b = lc.Ran.append(b, inline)
	}
	if lc.Final != nil {
		b = append(b, `,"final":`...)
		b = lc.Final.append(b, inline)
	}
	if lc.Outcome != nil {
		b = append(b, `,"outcome":`...)
		b = lc.Outcome.append(b)
	}
	if lc.Reward != nil {
		b = append(b, `,"reward":`...)
		b = appendNumber(b, *lc.Reward)
	}
	if !lc.Finished.IsZero() {
		b = append(b, `,"finished":`...)
		b = appendTime(b, lc.Finished)
	}
	if lc.CallbackError != "" {
		b = append(b, `,"callback_error":`...)
		b = jsonenc.AppendString(b, lc.CallbackError)
	}
	return append(b, '}')
}

func (st *owedStage) append(b []byte, inline bool) []byte {
	b = append(b, `{"outcome":`...)
	b = st.Outcome.append(b)
	b = append(b, `,"callbacks":`...)
	if st.Callbacks == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i, c := range st.Callbacks {
			if i > 0 {
				b = append(b, ',')
			}
			b = c.append(b, inline)
		}
		b = append(b, ']')
	}
	b = append(b, `,"done":`...)
	if st.Done == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i, d := range st.Done {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendBool(b, d)
		}
		b = append(b, ']')
	}
	if st.Sending {
		b = append(b, `,"sending":true`...)
	}
	return append(b, '}')
}

func (o *savedOutcome) append(b []byte) []byte {
	b = append(b, `{"state":`...)
	b = strconv.AppendInt(b, int64(o.State), 10)
	if o.Category != "" {
		b = append(b, `,"category":`...)
		b = jsonenc.AppendString(b, string(o.Category))
	}
	if o.Message != "" {
		b = append(b, `,"message":`...)
		b = jsonenc.AppendString(b, o.Message)
	}
	return append(b, '}')
}

func (c *savedCallback) append(b []byte, inline bool) []byte {
	b = append(b, `{"event":`...)
	b = jsonenc.AppendString(b, c.Event)
	b = append(b, `,"route":`...)
	b = jsonenc.AppendString(b, c.Route)
	b = append(b, `,"url":`...)
	b = jsonenc.AppendString(b, c.URL)
	if c.Bearer != "" {
		b = append(b, `,"bearer":`...)
		b = jsonenc.AppendString(b, c.Bearer)
	}
	b = append(b, `,"status":`...)
	b = jsonenc.AppendString(b, c.Status)
	if inline && len(c.Payload) > 0 {
		b = append(b, `,"payload":`...)
		b = append(b, c.Payload...)
	}
	return append(b, '}')
}

// appendTime writes t as time.Time's MarshalJSON does (RFC 3339 with
// nanoseconds). The lifecycle's times are the clock's, well inside the
// years MarshalJSON accepts.
func appendTime(b []byte, t time.Time) []byte {
	b = append(b, '"')
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b, '"')
}

// appendBytes writes p as encoding/json writes a []byte: a base64 string.
func appendBytes(b []byte, p []byte) []byte {
	b = append(b, '"')
	b = base64.StdEncoding.AppendEncode(b, p)
	return append(b, '"')
}
