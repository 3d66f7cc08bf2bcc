package rollout

import (
	"encoding/json"
	"math"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"
)

// jsonStruct writes what encoding/json writes for the struct's map, byte
// for byte.
func TestJSONStructIsEncodingJSON(t *testing.T) {
	for _, s := range []string{
		"", "plain", `quote " and \ backslash`, "new\nline\r\ttab", "\x00\x01\x1f\x7f",
		"<html> & </html>", "é ü 日本語 🙂", "line\u2028sep\u2029", "emoji \U0001F600 end",
	} {
		for _, n := range []float64{0, math.Copysign(0, -1), 1, -1, 0.1, 1.5e-7, 1e-6, 123456789, 1e20, 1e21, 1.7976931348623157e308, 5e-324, 42.42} {
			m := map[string]any{
				"s": s, s: n, "n": n, "b": true, "f": false, "null": nil,
				"list":   []any{s, n, nil, []any{}, map[string]any{}},
				"nested": map[string]any{"z": 1.0, "a": []any{map[string]any{"k": s}}},
			}
			st, err := structpb.NewStruct(m)
			if err != nil {
				t.Fatal(err)
			}
			got, err := jsonStruct{st}.MarshalJSON()
			if err != nil {
				t.Fatal(err)
			}
			want, err := json.Marshal(st.AsMap())
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(want) {
				t.Errorf("%q, %v:\n got %s\nwant %s", s, n, got, want)
			}
		}
	}
	// Invalid UTF-8 (which structpb.NewStruct refuses, but a message
	// decoded from the wire may hold) as U+FFFD.
	bad := "bad \xff utf-8 \xc3"
	got, _ := jsonStruct{&structpb.Struct{Fields: map[string]*structpb.Value{"s": structpb.NewStringValue(bad)}}}.MarshalJSON()
	if want, _ := json.Marshal(map[string]string{"s": bad}); string(got) != string(want) {
		t.Errorf("invalid UTF-8: got %s, want %s", got, want)
	}
	// Numbers JSON cannot hold are null; nil is null.
	st := &structpb.Struct{Fields: map[string]*structpb.Value{
		"nan": structpb.NewNumberValue(math.NaN()), "inf": structpb.NewNumberValue(math.Inf(-1)), "unset": {},
	}}
	if got, _ := (jsonStruct{st}).MarshalJSON(); string(got) != `{"inf":null,"nan":null,"unset":null}` {
		t.Errorf("non-finite numbers: %s", got)
	}
	if got, _ := (jsonStruct{}).MarshalJSON(); string(got) != "null" {
		t.Errorf("nil struct: %s", got)
	}
}
