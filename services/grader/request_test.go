package grader

import (
	"reflect"
	"testing"

	"google.golang.org/protobuf/proto"
)

// TestSampleSharesMessageMaps: a message that the sample and its calls
// hold as one Struct reaches the grader as one map, read as the Struct
// reads; the same JSON held as two Structs is two maps.
func TestSampleSharesMessageMaps(t *testing.T) {
	rs := benchRequest().GetSamples()[0]
	s := toSample(rs, nil, nil)
	same := func(a, b map[string]any) bool {
		return reflect.ValueOf(a).UnsafePointer() == reflect.ValueOf(b).UnsafePointer()
	}
	if !same(s.Messages[0], s.LLMCalls[0].RequestMessages[0]) || !same(s.Messages[2], s.LLMCalls[0].ResponseMessage) ||
		!same(s.Messages[2], s.LLMCalls[1].RequestMessages[2]) || !same(s.Messages[4], s.LLMCalls[1].ResponseMessage) {
		t.Error("a message the sample and a call share as one Struct is two maps")
	}
	for i, m := range rs.GetMessages() {
		if !reflect.DeepEqual(s.Messages[i], m.AsMap()) {
			t.Errorf("message %d: %v, want %v", i, s.Messages[i], m.AsMap())
		}
	}
	// The same content, another Struct.
	rs.LlmCalls[0].ResponseMessage = proto.CloneOf(rs.GetMessages()[2])
	s = toSample(rs, nil, nil)
	if same(s.Messages[2], s.LLMCalls[0].ResponseMessage) || !reflect.DeepEqual(s.Messages[2], s.LLMCalls[0].ResponseMessage) {
		t.Error("two Structs of the same message: want two equal maps")
	}
}
