package rollout

import (
	"encoding/json"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// populated is m with every field set to a value that is not its
// default: a field copySample missed shows in the copy.
func populated(m protoreflect.Message) {
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.IsMap():
			m.Mutable(fd).Map().Set(protoreflect.ValueOfString("k").MapKey(), scalar(fd.MapValue()))
		case fd.IsList():
			l := m.Mutable(fd).List()
			if fd.Message() != nil {
				l.Append(protoreflect.ValueOfMessage(l.NewElement().Message()))
			} else {
				l.Append(scalar(fd))
			}
		case fd.Message() != nil:
			m.Set(fd, protoreflect.ValueOfMessage(m.NewField(fd).Message()))
		default:
			m.Set(fd, scalar(fd))
		}
	}
}

func scalar(fd protoreflect.FieldDescriptor) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("x")
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(0.5)
	case protoreflect.Int32Kind:
		return protoreflect.ValueOfInt32(3)
	case protoreflect.Int64Kind:
		return protoreflect.ValueOfInt64(3)
	case protoreflect.EnumKind:
		return protoreflect.ValueOfEnum(1)
	}
	panic("populated: no value for a field of kind " + fd.Kind().String())
}

// TestCopySampleCopiesEveryField: a copy holds every field of the
// sample, and its optional numbers are its own.
func TestCopySampleCopiesEveryField(t *testing.T) {
	s := &rolloutv1.RolloutSample{}
	populated(s.ProtoReflect())
	c := copySample(s)
	if !proto.Equal(c, s) {
		t.Errorf("copy %v\nwant %v", c, s)
	}
	fields := s.ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		if fd := fields.Get(i); !c.ProtoReflect().Has(fd) {
			t.Errorf("%s not copied", fd.Name())
		}
	}
	if c.Reward == s.Reward || c.AgentReward == s.AgentReward || c.Label == s.Label {
		t.Error("the copy shares an optional field's pointer with the sample")
	}
}

// viaMaps is what a source's messages become through SampleMessages: each
// decoded into a map, then toStructs.
func viaMaps(raw []json.RawMessage) ([]*structpb.Struct, error) {
	msgs := make([]map[string]any, len(raw))
	for i, b := range raw {
		if err := json.Unmarshal(b, &msgs[i]); err != nil {
			return nil, err
		}
	}
	return toStructs(msgs)
}

// sourceMessages are messages of every kind the parser takes and of every
// kind it leaves to protojson.
var sourceMessages = []string{
	`{"role":"user","content":"What is 6 times 7?"}`,
	`{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]}`,
	`{}`, `{"n":[1,2.5,-0,1e300,12345678901234567890,0.1],"t":true,"f":false,"z":null,"o":{"":{}}}`,
	`{"s":"\ud83d\ude00 é \u00e9 \n\t\"\\"}`, `{"lone":"\ud800"}`, `{"bad":"\xff\xfe"}`, "{\"k\xff\":1}",
	`{"dup":1,"dup":2}`, `{"big":1e400}`, ` { "spaced" : [ ] } `, `[1]`, `null`, `"s"`, `{"a":`,
}

// TestSourceStructsAreToStructs: a source's messages read as JSON are the
// Structs its SampleMessages' maps give, or fail where those fail.
func TestSourceStructsAreToStructs(t *testing.T) {
	for _, m := range sourceMessages {
		raw := []json.RawMessage{json.RawMessage(`{"role":"system","content":"x"}`), json.RawMessage(m)}
		got, gotErr := sourceStructs(raw, nil)
		want, wantErr := viaMaps(raw)
		if (gotErr != nil) != (wantErr != nil) {
			t.Errorf("%s: error %v, through maps %v", m, gotErr, wantErr)
			continue
		}
		if len(got) != len(want) {
			t.Errorf("%s: %d Structs, through maps %d", m, len(got), len(want))
			continue
		}
		for i := range got {
			if !proto.Equal(got[i], want[i]) {
				t.Errorf("%s: %v, through maps %v", m, got[i], want[i])
			}
		}
	}
}

// FuzzSourceStructs: any message reads as JSON as it reads through a map.
func FuzzSourceStructs(f *testing.F) {
	for _, m := range sourceMessages {
		f.Add(m)
	}
	f.Fuzz(func(t *testing.T, m string) {
		raw := []json.RawMessage{json.RawMessage(m)}
		got, gotErr := sourceStructs(raw, nil)
		want, wantErr := viaMaps(raw)
		if (gotErr != nil) != (wantErr != nil) {
			t.Fatalf("error %v, through maps %v", gotErr, wantErr)
		}
		if gotErr == nil && !proto.Equal(got[0], want[0]) {
			t.Errorf("%v, through maps %v", got[0], want[0])
		}
	})
}
