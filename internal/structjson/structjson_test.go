package structjson

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// structDocuments are what recorded calls hold, and the cases Decode's
// parser must either get right or leave to protojson.
var structDocuments = []string{
	`{}`, ` { } `, `{"role":"assistant","content":"6 times 7 is 42."}`,
	`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"multiply","arguments":"{\"a\":6,\"b\":7}"}}]}`,
	`{"a":[1,-2.5,0,-0,1e3,1E-3,12345678901234567890,true,false,null,"x",[],{}]}`,
	`{"esc":"\"\\\/\b\f\n\r\t\u0041\u00e9\u4e2d"}`, `{"s":"日本語 🙂"}`,
	`{"a":1}x`, `{"a":1,}`, `{"a" 1}`, `{"a":01}`, `{"a":1.}`, `{"a":.5}`, `{"a":1e}`, `{"a":-}`, `{"a":+1}`,
	`{"a":tru}`, `{"a":truex}`, `{"a":nul}`, `{"a":1e400}`, `{"a":-1e400}`, `{"a":1e-400}`,
	`{"a":1,"a":2}`, `{"a":"\ud83d\ude42"}`, `{"a":"\ud800"}`, `{"a":"\udc00x"}`, `{"a":"\u12"}`, `{"a":"\x"}`,
	"{\"a\":\"\xff\"}", "{\"a\":\"tab\there\"}", "{\"\xff\":1}", `{"a":"unterminated}`, `[1]`, `"s"`, `1`, ``, `{`,
	`{"a":[1,2,]}`, `{"a":[1 2]}`, `{"a":{"b":{"c":[{"d":null}]}}}`,
	strings.Repeat(`{"a":`, 70) + `1` + strings.Repeat(`}`, 70),
	strings.Repeat(`{"a":`, 30) + `1` + strings.Repeat(`}`, 30),
}

// TestDecodeStructIsProtojson: the same Struct as protojson's, or an error
// where protojson has one.
func TestDecodeIsProtojson(t *testing.T) {
	for _, doc := range structDocuments {
		checkDecode(t, []byte(doc))
	}
	// The documents above that are plain take the parser's own path.
	for _, doc := range []string{`{"role":"user","content":"hi"}`, `{"a":[1,{"b":"\u00e9\n"}],"c":null}`} {
		p := Parser{data: []byte(doc)}
		if _, ok := p.document(); !ok {
			t.Errorf("%s: left to protojson", doc)
		}
	}
}

func checkDecode(t *testing.T, doc []byte) {
	t.Helper()
	want := &structpb.Struct{}
	wantErr := protojson.Unmarshal(doc, want)
	got, err := Decode(doc)
	switch {
	case (err != nil) != (wantErr != nil):
		t.Errorf("%q: error %v, protojson's %v", doc, err, wantErr)
	case err == nil && !proto.Equal(got, want):
		t.Errorf("%q: %v, protojson's %v", doc, got, want)
	}
}

// FuzzDecode: for any input, Decode answers what protojson answers.
func FuzzDecode(f *testing.F) {
	for _, doc := range structDocuments {
		f.Add([]byte(doc))
	}
	f.Fuzz(func(t *testing.T, doc []byte) { checkDecode(t, doc) })
}

// BenchmarkDecode: a recorded reply with a tool call, through Decode and
// through protojson.
func BenchmarkDecode(b *testing.B) {
	doc := []byte(structDocuments[3])
	b.Run("Decode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = Decode(doc)
		}
	})
	b.Run("protojson", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = protojson.Unmarshal(doc, &structpb.Struct{})
		}
	})
}
