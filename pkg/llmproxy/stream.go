package llmproxy

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/osmo-rl/osmo"
)

// relayStream passes an SSE response through event by event, flushing after
// each, while assembling the record. Headers go out with the first event,
// so a stream that fails before producing anything can still be retried.
// The attempt timer is reset on every line: it bounds silences, not the
// length of a generation.
func (x *exchange) relayStream(actx context.Context, resp *http.Response, t0 time.Time, timer *time.Timer) *upstreamError {
	br := bufio.NewReaderSize(resp.Body, 16<<10)
	ev := new(bytes.Buffer)

	x.call.Stream = true
	acc := streamAcc{start: x.start}
	var (
		started   bool
		rc        *http.ResponseController
		lineStart int
		clientErr error
	)
	// out holds the translated events of a Responses call.
	var out []byte
	// send writes b to the client and flushes it.
	send := func(b []byte) error {
		if _, err := x.w.Write(b); err != nil {
			return err
		}
		if err := rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
			return err
		}
		return nil
	}
	// dispatch sends the buffered event to the client.
	dispatch := func() bool {
		d := acc.event(ev.Bytes(), time.Now())
		data := ev.Bytes()
		if x.resp != nil {
			out = out[:0]
			if !started {
				out = x.resp.streamStart(out, acc.id)
			}
			out = x.resp.streamDelta(out, d)
			data = out
		}
		if !started {
			started = true
			x.upstream += time.Since(t0)
			h := x.w.Header()
			ct := resp.Header.Get("Content-Type")
			if x.resp != nil {
				ct = "text/event-stream; charset=utf-8"
			}
			h.Set("Content-Type", ct)
			h.Set("Cache-Control", "no-cache")
			// Ask buffering front proxies (nginx) to pass events on at once.
			h.Set("X-Accel-Buffering", "no")
			copyHeaders(h, resp.Header)
			x.setServerTiming(h)
			x.w.WriteHeader(resp.StatusCode)
			x.call.StatusCode = resp.StatusCode
			rc = http.NewResponseController(x.w)
		}
		if len(data) > 0 {
			if err := send(data); err != nil {
				clientErr = err
				return false
			}
		}
		ev.Reset()
		lineStart = 0
		return true
	}

	var (
		readErr error
		// unended is what the last event sent lacks of its end: the
		// upstream stopped inside it.
		unended []byte
	)
	for {
		line, err := br.ReadSlice('\n')
		if len(line) > 0 {
			timer.Reset(x.timeout())
			// Events are passed on as they come, so only one event is ever
			// held: that is what the limit bounds, not the whole stream.
			if int64(ev.Len()+len(line)) > x.p.maxResp {
				readErr = errStreamTooLarge
				break
			}
			ev.Write(line)
		}
		if err == bufio.ErrBufferFull {
			continue // a long line; keep collecting it
		}
		if err != nil {
			if b := ev.Bytes(); len(b) > 0 {
				unended = []byte("\n\n")[:2-min(2, trailingNewlines(b))]
				if !dispatch() {
					break
				}
			}
			if err != io.EOF {
				readErr = err
			}
			break
		}
		if l := ev.Bytes()[lineStart:]; len(l) == 1 || (len(l) == 2 && l[0] == '\r') {
			if !dispatch() {
				break
			}
			continue
		}
		lineStart = ev.Len()
	}

	c := x.call
	switch {
	case clientErr != nil:
		c.Error, x.errType = clientWentAway(clientErr)
	case !started && readErr == errStreamTooLarge:
		return &upstreamError{kind: "too_large", detail: fmt.Sprintf("upstream event exceeds the limit of %d bytes", x.p.maxResp)}
	case !started && readErr != nil:
		x.upstream += time.Since(t0)
		return x.readFailure(actx, readErr)
	case !started:
		x.upstream += time.Since(t0)
		return &upstreamError{kind: "malformed", status: resp.StatusCode, detail: "event stream ended before any event", retry: true}
	case readErr == errStreamTooLarge:
		c.Error = fmt.Sprintf("llmproxy: upstream event exceeds the limit of %d bytes; stream cut", x.p.maxResp)
		x.errType = "too_large"
	case readErr != nil:
		cause := context.Cause(actx)
		switch {
		case errors.Is(cause, errAttemptTimeout):
			c.Error = fmt.Sprintf("llmproxy: upstream stream stalled for more than %s; cut", x.timeout())
			x.errType = "timeout"
		case errors.Is(cause, errPauseAbort):
			// The agent already has part of the answer: it cannot be sent
			// again, so the stream ends with a typed error.
			c.Error = "llmproxy: stream cut: " + cause.Error() + "; the answer was partly sent and is not resent"
			x.errType = "policy_paused"
		case cause != nil:
			c.Error = "llmproxy: stream aborted: " + cause.Error()
			x.errType = "aborted"
		default:
			c.Error = "llmproxy: upstream stream broke: " + readErr.Error()
			x.errType = "transport"
		}
	case acc.upstreamErr != "":
		c.Error = "llmproxy: upstream sent an error event: " + acc.upstreamErr
		x.errType = "upstream_error_event"
	case !acc.done && acc.finish == "":
		c.Error = "llmproxy: upstream stream ended without [DONE]"
		x.errType = "incomplete_stream"
	}
	acc.fill(c)
	if x.resp == nil && clientErr == nil && cutStream(x.errType) {
		// The agent gets a typed error event rather than a stream that
		// just stops, which OpenAI's clients would take for a whole
		// answer; they raise this one as an error.
		ev := fmt.Appendf(unended, "data: {\"error\":{\"message\":%q,\"type\":\"upstream_error\",\"param\":null,\"code\":%q}}\n\n", c.Error, x.errType)
		if err := send(ev); err != nil {
			c.Error, x.errType = clientWentAway(err)
		}
	}
	if x.resp != nil && clientErr == nil {
		// A Responses stream ends with its closing events: the items,
		// then response.completed, or response.failed naming the cause.
		if c.Error == "" {
			out = x.resp.streamEnd(out[:0], c)
		} else {
			out = x.resp.streamFail(out[:0], c, x.errType)
		}
		if err := send(out); err != nil {
			c.Error, x.errType = clientWentAway(err)
		}
	}
	return nil
}

var errStreamTooLarge = errors.New("stream too large")

// trailingNewlines counts the line ends (\n or \r\n) b ends with, up to 2.
func trailingNewlines(b []byte) int {
	n := 0
	for n < 2 {
		switch {
		case bytes.HasSuffix(b, []byte("\r\n")):
			b = b[:len(b)-2]
		case bytes.HasSuffix(b, []byte("\n")):
			b = b[:len(b)-1]
		default:
			return n
		}
		n++
	}
	return n
}

// cutStream reports whether a stream that ended with this error type was
// cut on the policy's side after the agent got part of it: the agent is
// told so. A stream the client left, or the rollout ended (aborted), has
// no one to tell; an upstream error event was passed on as it came, and
// one the upstream ended without [DONE] is passed on as it ended.
func cutStream(errType string) bool {
	switch errType {
	case "policy_paused", "timeout", "transport", "too_large":
		return true
	}
	return false
}

// clientWentAway is the call's error and error type when writing to the
// client failed mid-stream.
func clientWentAway(err error) (msg, errType string) {
	return "llmproxy: client went away mid-stream: " + err.Error(), "client_closed"
}

// streamAcc assembles choice 0 of a stream into one message.
type streamAcc struct {
	start time.Time
	ttft  time.Duration

	id          string
	role        string
	content     strings.Builder
	reasoning   strings.Builder
	tools       []toolCallAcc
	finish      string
	usage       *usage
	promptIDs   []int32
	tokenIDs    []int32
	logprobs    []float64
	tokens      []string
	done        bool
	upstreamErr string
	scratch     []byte
}

type toolCallAcc struct {
	index         int
	id, typ, name string
	// arguments is a byte slice, not a strings.Builder: the accumulators
	// live in a slice that moves when it grows.
	arguments []byte
}

// event takes one SSE event (its raw lines) and returns what it adds to
// choice 0's text.
func (a *streamAcc) event(ev []byte, now time.Time) chunkDelta {
	var data []byte
	multi := false
	for len(ev) > 0 {
		line := ev
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			ev = nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		payload, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		payload = bytes.TrimPrefix(payload, []byte{' '})
		switch {
		case data == nil:
			data = payload
		case !multi:
			// Several data lines form one payload joined by newlines.
			a.scratch = append(append(append(a.scratch[:0], data...), '\n'), payload...)
			data, multi = a.scratch, true
		default:
			a.scratch = append(append(a.scratch, '\n'), payload...)
			data = a.scratch
		}
	}
	if data == nil {
		return chunkDelta{}
	}
	if string(bytes.TrimSpace(data)) == "[DONE]" {
		a.done = true
		return chunkDelta{}
	}
	ch, err := readCompletion(data)
	if err != nil {
		return chunkDelta{} // not ours to judge; the client got the bytes as they were
	}
	return a.chunk(&ch, now)
}

func (a *streamAcc) chunk(ch *completion, now time.Time) (d0 chunkDelta) {
	if a.id == "" {
		a.id = ch.ID
	}
	if len(ch.Error) > 0 && string(ch.Error) != "null" {
		a.upstreamErr = snippet(ch.Error)
	}
	if ch.Usage != nil {
		a.usage = ch.Usage
	}
	c := ch.choice0()
	if ids := ch.promptIDs(c); len(ids) > 0 {
		a.promptIDs = ids
	}
	if c == nil {
		return d0
	}
	d := &c.Delta
	if d.Role != "" {
		a.role = d.Role
	}
	reasoning := d.ReasoningContent
	if reasoning == "" {
		reasoning = d.Reasoning
	}
	if a.ttft == 0 && (d.Content != "" || reasoning != "" || len(d.ToolCalls) > 0) {
		a.ttft = now.Sub(a.start)
	}
	a.content.WriteString(d.Content)
	a.reasoning.WriteString(reasoning)
	d0.content, d0.reasoning = d.Content, reasoning
	for _, tc := range d.ToolCalls {
		t := a.tool(tc.Index)
		if tc.ID != "" {
			t.id = tc.ID
		}
		if tc.Type != "" {
			t.typ = tc.Type
		}
		// Names normally arrive whole in the first delta; some servers
		// repeat them, a few split them.
		if n := tc.Function.Name; n != "" && n != t.name {
			t.name += n
		}
		t.arguments = append(t.arguments, tc.Function.Arguments...)
	}
	if c.FinishReason != "" {
		a.finish = c.FinishReason
	}
	a.tokenIDs = append(a.tokenIDs, c.TokenIDs...)
	a.logprobs, a.tokens = c.Logprobs.appendTo(a.logprobs, a.tokens)
	return d0
}

func (a *streamAcc) tool(index int) *toolCallAcc {
	for i := range a.tools {
		if a.tools[i].index == index {
			return &a.tools[i]
		}
	}
	a.tools = append(a.tools, toolCallAcc{index: index})
	return &a.tools[len(a.tools)-1]
}

// fill writes the assembled call into c.
func (a *streamAcc) fill(c *osmo.LLMCall) {
	type function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	}
	type toolCall struct {
		ID       string   `json:"id"`
		Type     string   `json:"type"`
		Function function `json:"function"`
	}
	msg := struct {
		Role             string     `json:"role"`
		Content          *string    `json:"content"`
		ReasoningContent string     `json:"reasoning_content,omitempty"`
		ToolCalls        []toolCall `json:"tool_calls,omitempty"`
	}{Role: a.role, ReasoningContent: a.reasoning.String()}
	if msg.Role == "" {
		msg.Role = "assistant"
	}
	if a.content.Len() > 0 {
		s := a.content.String()
		msg.Content = &s
	}
	slices.SortFunc(a.tools, func(x, y toolCallAcc) int { return cmp.Compare(x.index, y.index) })
	for i := range a.tools {
		t := &a.tools[i]
		typ := t.typ
		if typ == "" {
			typ = "function"
		}
		msg.ToolCalls = append(msg.ToolCalls, toolCall{ID: t.id, Type: typ, Function: function{Name: t.name, Arguments: string(t.arguments)}})
	}
	if b, err := json.Marshal(msg); err == nil {
		c.ResponseMessage = b
	}
	c.ID = a.id
	c.FinishReason = a.finish
	if a.usage != nil {
		c.Usage = a.usage.usage()
	}
	c.PromptTokenIDs = a.promptIDs
	c.CompletionTokenIDs = a.tokenIDs
	c.Logprobs = a.logprobs
	c.CompletionTokenStrings = a.tokens
	c.TimeToFirstTokenMS = float64(a.ttft) / float64(time.Millisecond)
}
