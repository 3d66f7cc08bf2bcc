package rollout

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

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
