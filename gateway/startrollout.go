package gateway

import (
	"strings"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/structjson"
)

// startRolloutFields are POST /rollout's fields, by either name protojson
// takes (the JSON name or the proto name).
var startRolloutFields = (&rolloutv1.StartRolloutRequest{}).ProtoReflect().Descriptor().Fields()

// decodeStartRollout decodes a POST /rollout body into req (empty) as the
// gateway's protojson options do, and reports false, leaving req to be
// decoded by protojson, for anything it is not sure of: what
// structjson.Parser is not sure of, a field given twice (under either
// name), a value of another type, a number given as a string,
// an extension's name.
//
// Every rollout of the G2 and v0.3 wires starts with this body: protojson
// decodes by reflection, and was a third of the gateway's CPU (the
// rollout service's admission under it included).
// FuzzStartRolloutBody holds the two to the same message on any input.
func decodeStartRollout(data []byte, req *rolloutv1.StartRolloutRequest) bool {
	p := structjson.NewParser(data)
	if p.Next() != '{' {
		return false
	}
	p.Skip()
	var seen uint64
	if p.Next() == '}' {
		p.Skip()
		return p.End()
	}
	for {
		name, ok := p.String()
		if !ok || strings.HasPrefix(name, "[") || p.Next() != ':' {
			return false
		}
		p.Skip()
		fd := startRolloutFields.ByJSONName(name)
		if fd == nil {
			fd = startRolloutFields.ByTextName(name)
		}
		if fd == nil {
			// Unknown: discarded, as the gateway's protojson options say,
			// once read as JSON.
			if _, ok := p.Value(); !ok {
				return false
			}
		} else {
			n := uint64(fd.Number())
			if n >= 64 || seen&(1<<n) != 0 {
				return false
			}
			seen |= 1 << n
			if !startRolloutField(p, fd.Number(), req) {
				return false
			}
		}
		switch end, ok := p.After('}'); {
		case !ok:
			return false
		case end:
			return p.End()
		}
	}
}

// startRolloutField reads field n's value into req. JSON null leaves a
// field unset, but for label, a google.protobuf.Value: null is its null.
func startRolloutField(p *structjson.Parser, n protoreflect.FieldNumber, req *rolloutv1.StartRolloutRequest) bool {
	if n == 6 { // label
		v, ok := p.Value()
		req.Label = v
		return ok
	}
	if p.Next() == 'n' {
		v, ok := p.Value()
		_, null := v.GetKind().(*structpb.Value_NullValue)
		return ok && null
	}
	switch n {
	case 1:
		return stringField(p, &req.RolloutId)
	case 2: // initial_messages
		if p.Next() != '[' {
			return false
		}
		p.Skip()
		if p.Next() == ']' {
			p.Skip()
			return true
		}
		for {
			s, ok := p.Object()
			if !ok {
				return false
			}
			req.InitialMessages = append(req.InitialMessages, s)
			switch end, ok := p.After(']'); {
			case !ok:
				return false
			case end:
				return true
			}
		}
	case 3:
		return stringField(p, &req.ChatCompletionsUrl)
	case 4:
		return stringField(p, &req.CompletionCallbackUrl)
	case 5:
		return optionalString(p, &req.GraderCallbackUrl)
	case 7:
		s, ok := p.Object()
		req.Metadata = s
		return ok
	case 8:
		return optionalString(p, &req.ControllerApiKey)
	case 9:
		return optionalNumber(p, &req.AgentTimeoutSec)
	case 10:
		return optionalNumber(p, &req.GraderTimeoutSec)
	case 11:
		s, ok := p.Object()
		req.ExtraFields = s
		return ok
	case 12:
		return optionalString(p, &req.LlmApiKey)
	}
	return false // a field this reader does not know of
}

func stringField(p *structjson.Parser, s *string) bool {
	v, ok := p.String()
	*s = v
	return ok
}

func optionalString(p *structjson.Parser, s **string) bool {
	v, ok := p.String()
	*s = &v
	return ok
}

// optionalNumber reads a JSON number (protojson also takes a number in a
// string, "NaN" and "Infinity" among them: those are left to it).
func optionalNumber(p *structjson.Parser, f **float64) bool {
	c := p.Next()
	if c != '-' && (c < '0' || c > '9') {
		return false
	}
	v, ok := p.Number()
	*f = &v
	return ok
}
