package gateway

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
)

// jsonMarshaler is grpc-gateway's protojson marshaler with the Osmosis wire
// settings, whose decoding errors name the offending field.
type jsonMarshaler struct {
	*runtime.JSONPb
}

func newJSONMarshaler() *jsonMarshaler {
	return &jsonMarshaler{JSONPb: &runtime.JSONPb{
		MarshalOptions: protojson.MarshalOptions{
			UseProtoNames:   true,
			EmitUnpopulated: true,
		},
		UnmarshalOptions: protojson.UnmarshalOptions{
			// Osmosis clients send fields this API does not model.
			DiscardUnknown: true,
		},
	}}
}

// nullOptionals names the response messages whose unset optional fields
// are sent as null, their wire shape listing every key.
var nullOptionals = map[protoreflect.FullName]bool{
	(&rolloutv1.RolloutStatus{}).ProtoReflect().Descriptor().FullName(): true,
}

// Marshal encodes v as protojson with the wire settings.
func (m *jsonMarshaler) Marshal(v any) ([]byte, error) {
	data, err := m.JSONPb.Marshal(v)
	if err != nil {
		return nil, err
	}
	msg, ok := v.(proto.Message)
	if !ok || !nullOptionals[msg.ProtoReflect().Descriptor().FullName()] {
		return data, nil
	}
	return withNullOptionals(msg.ProtoReflect(), data)
}

// withNullOptionals rewrites the JSON object data of msg with every field in
// declaration order, unset optional fields as null.
func withNullOptionals(msg protoreflect.Message, data []byte) ([]byte, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	buf.WriteByte('{')
	fields := msg.Descriptor().Fields()
	n := 0
	for i := range fields.Len() {
		fd := fields.Get(i)
		name := string(fd.Name())
		value, ok := obj[name]
		if !ok {
			if !fd.HasOptionalKeyword() {
				continue
			}
			value = json.RawMessage("null")
		}
		if n > 0 {
			buf.WriteByte(',')
		}
		n++
		key, _ := json.Marshal(name)
		buf.Write(key)
		buf.WriteByte(':')
		buf.Write(value)
	}
	buf.WriteByte('}')
	return buf.Bytes(), nil
}

// NewDecoder reads the whole body, so a failure can be explained against
// the raw JSON.
func (m *jsonMarshaler) NewDecoder(r io.Reader) runtime.Decoder {
	return runtime.DecoderFunc(func(v any) error {
		data, err := io.ReadAll(r)
		if err != nil {
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) {
				return fmt.Errorf("request body exceeds %d bytes", tooLarge.Limit)
			}
			return fmt.Errorf("request body: %w", err)
		}
		if len(bytes.TrimSpace(data)) == 0 {
			// io.EOF: no body; the service validates the empty message.
			return io.EOF
		}
		return m.Unmarshal(data, v)
	})
}

// Unmarshal decodes data into v, a message's failure explained.
func (m *jsonMarshaler) Unmarshal(data []byte, v any) error {
	msg, ok := v.(proto.Message)
	if !ok {
		return m.JSONPb.Unmarshal(data, v)
	}
	if err := m.UnmarshalOptions.Unmarshal(data, msg); err != nil {
		return explainJSON(data, msg.ProtoReflect().Descriptor(), err)
	}
	return nil
}

// explainJSON turns a protojson failure into an error naming the field at
// fault by its path, such as "messages[2]: must be a JSON object, got
// string" (protojson gives a line and column and the camelCase name). The
// raw JSON is walked alongside the descriptor to find the first value the
// field cannot take; when none is found, protojson's reason is kept.
func explainJSON(data []byte, md protoreflect.MessageDescriptor, protoErr error) error {
	if !json.Valid(data) {
		err := json.Unmarshal(data, new(any))
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return fmt.Errorf("%s: invalid JSON: %v (at byte %d)", bodyPath, se, se.Offset)
		}
		return fmt.Errorf("%s: invalid JSON: %v", bodyPath, err)
	}
	if problem := checkMessage(md, data, bodyPath); problem != "" {
		return errors.New(problem)
	}
	return fmt.Errorf("%s: %s", bodyPath, protojsonReason(protoErr))
}

// protojsonReason strips protojson's "proto: (line 1:15): " prefix.
func protojsonReason(err error) string {
	msg := err.Error()
	msg = strings.TrimPrefix(msg, "proto:")
	msg = strings.TrimSpace(msg)
	msg = strings.TrimPrefix(msg, "syntax error")
	msg = strings.TrimSpace(msg)
	if strings.HasPrefix(msg, "(line ") {
		if i := strings.Index(msg, "):"); i >= 0 {
			msg = strings.TrimSpace(msg[i+2:])
		}
	}
	return msg
}

// jsonKind names the kind of a valid JSON value as error messages show it.
func jsonKind(raw []byte) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	case 't', 'f':
		return "boolean"
	case 'n':
		return "null"
	default:
		return "number"
	}
}

// bodyPath names the whole body in messages; fields are named by their
// path alone.
const bodyPath = "request body"

func join(path, name string) string {
	if path == bodyPath {
		return name
	}
	return path + "." + name
}

// checkMessage checks a JSON value against a message type and returns a
// description of the first problem, or "".
func checkMessage(md protoreflect.MessageDescriptor, raw []byte, path string) string {
	if want, ok := wellKnownJSON(md); ok {
		return checkWellKnown(md, want, raw, path)
	}
	if kind := jsonKind(raw); kind != "object" {
		return fmt.Sprintf("%s: must be a JSON object, got %s", path, kind)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return fmt.Sprintf("%s: %v", path, err)
	}
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		// protojson accepts the proto name and the JSON (camelCase) name.
		value, ok := obj[string(fd.Name())]
		if !ok {
			value, ok = obj[fd.JSONName()]
		}
		if !ok {
			continue
		}
		if problem := checkField(fd, value, join(path, string(fd.Name()))); problem != "" {
			return problem
		}
	}
	return ""
}

// checkField checks the JSON value of one field, lists and maps element by
// element.
func checkField(fd protoreflect.FieldDescriptor, raw []byte, path string) string {
	kind := jsonKind(raw)
	if kind == "null" {
		return "" // null leaves any field unset
	}
	switch {
	case fd.IsList():
		if kind != "array" {
			return fmt.Sprintf("%s: must be a JSON array, got %s", path, kind)
		}
		var elems []json.RawMessage
		if err := json.Unmarshal(raw, &elems); err != nil {
			return fmt.Sprintf("%s: %v", path, err)
		}
		for i, elem := range elems {
			if problem := checkValue(fd, elem, fmt.Sprintf("%s[%d]", path, i)); problem != "" {
				return problem
			}
		}
		return ""
	case fd.IsMap():
		if kind != "object" {
			return fmt.Sprintf("%s: must be a JSON object, got %s", path, kind)
		}
		var entries map[string]json.RawMessage
		if err := json.Unmarshal(raw, &entries); err != nil {
			return fmt.Sprintf("%s: %v", path, err)
		}
		keys := make([]string, 0, len(entries))
		for k := range entries {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			entryPath := fmt.Sprintf("%s[%q]", path, k)
			if problem := checkMapKey(fd.MapKey(), k, entryPath); problem != "" {
				return problem
			}
			if problem := checkValue(fd.MapValue(), entries[k], entryPath); problem != "" {
				return problem
			}
		}
		return ""
	default:
		return checkValue(fd, raw, path)
	}
}

// checkValue checks one value of fd's type: the field, or an element of a
// list or map, where null is a wrong value.
func checkValue(fd protoreflect.FieldDescriptor, raw []byte, path string) string {
	if jsonKind(raw) == "null" {
		if isNullable(fd) {
			return ""
		}
		return fmt.Sprintf("%s: must be %s, got null", path, expected(fd))
	}
	if fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind {
		return checkMessage(fd.Message(), raw, path)
	}
	return checkScalar(fd, raw, path)
}

// isNullable reports the two types whose JSON form includes null.
func isNullable(fd protoreflect.FieldDescriptor) bool {
	switch {
	case fd.Message() != nil:
		return fd.Message().FullName() == "google.protobuf.Value"
	case fd.Enum() != nil:
		return fd.Enum().FullName() == "google.protobuf.NullValue"
	}
	return false
}

// expected describes the JSON a field takes, for error messages.
func expected(fd protoreflect.FieldDescriptor) string {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		if want, ok := wellKnownJSON(fd.Message()); ok {
			return want.describe
		}
		return "a JSON object"
	case protoreflect.BoolKind:
		return "a boolean"
	case protoreflect.StringKind:
		return "a string"
	case protoreflect.BytesKind:
		return "a base64 string"
	case protoreflect.EnumKind:
		return "an enum name or number"
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return "a number"
	default:
		return "an integer"
	}
}

// wellKnown is the JSON form of a well-known type with a special mapping.
type wellKnown struct {
	kinds    []string // JSON kinds accepted; nil means any
	describe string
	// scalar is set for wrapper types: the value is checked as this field.
	scalar protoreflect.FieldDescriptor
}

func wellKnownJSON(md protoreflect.MessageDescriptor) (wellKnown, bool) {
	if md.ParentFile() == nil || md.ParentFile().Package() != "google.protobuf" {
		return wellKnown{}, false
	}
	switch md.Name() {
	case "Value":
		return wellKnown{describe: "any JSON value"}, true
	case "Struct", "Any", "Empty":
		return wellKnown{kinds: []string{"object"}, describe: "a JSON object"}, true
	case "ListValue":
		return wellKnown{kinds: []string{"array"}, describe: "a JSON array"}, true
	case "Timestamp":
		return wellKnown{kinds: []string{"string"}, describe: `an RFC 3339 timestamp string`}, true
	case "Duration":
		return wellKnown{kinds: []string{"string"}, describe: `a duration string such as "1.5s"`}, true
	case "FieldMask":
		return wellKnown{kinds: []string{"string"}, describe: "a string"}, true
	case "DoubleValue", "FloatValue", "Int64Value", "UInt64Value", "Int32Value",
		"UInt32Value", "BoolValue", "StringValue", "BytesValue":
		value := md.Fields().ByName("value")
		return wellKnown{describe: expected(value), scalar: value}, true
	}
	return wellKnown{}, false
}

func checkWellKnown(md protoreflect.MessageDescriptor, want wellKnown, raw []byte, path string) string {
	if want.scalar != nil {
		return checkScalar(want.scalar, raw, path)
	}
	if kind := jsonKind(raw); want.kinds != nil && !slices.Contains(want.kinds, kind) {
		return fmt.Sprintf("%s: must be %s, got %s", path, want.describe, kind)
	}
	// The kind is right; decoding the value alone finds what else is wrong.
	if err := protojson.Unmarshal(raw, dynamicpb.NewMessage(md)); err != nil {
		return fmt.Sprintf("%s: %s", path, protojsonReason(err))
	}
	return ""
}

// checkScalar checks a JSON value against a scalar field's type as protojson
// takes it: integers and floats as numbers or strings, floats also as
// "NaN", "Infinity" and "-Infinity".
func checkScalar(fd protoreflect.FieldDescriptor, raw []byte, path string) string {
	kind := jsonKind(raw)
	mismatch := func() string {
		return fmt.Sprintf("%s: must be %s, got %s", path, expected(fd), kind)
	}
	switch fd.Kind() {
	case protoreflect.BoolKind:
		if kind != "boolean" {
			return mismatch()
		}
	case protoreflect.StringKind:
		if kind != "string" {
			return mismatch()
		}
		if !utf8.Valid(raw) {
			return fmt.Sprintf("%s: must be valid UTF-8", path)
		}
	case protoreflect.BytesKind:
		if kind != "string" {
			return mismatch()
		}
		s, err := unquote(raw)
		if err != nil || !isBase64(s) {
			return fmt.Sprintf("%s: must be %s", path, expected(fd))
		}
	case protoreflect.EnumKind:
		switch kind {
		case "string":
		case "number":
			if problem := checkInteger(string(bytes.TrimSpace(raw)), 32, true, path); problem != "" {
				return problem
			}
		default:
			return mismatch()
		}
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return checkFloat(fd, raw, kind, path)
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return checkIntegerField(raw, kind, 32, true, path)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return checkIntegerField(raw, kind, 64, true, path)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return checkIntegerField(raw, kind, 32, false, path)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return checkIntegerField(raw, kind, 64, false, path)
	}
	return ""
}

func checkIntegerField(raw []byte, kind string, bits int, signed bool, path string) string {
	var text string
	switch kind {
	case "number":
		text = string(bytes.TrimSpace(raw))
	case "string":
		s, err := unquote(raw)
		if err != nil || !isNumberText(s) {
			return fmt.Sprintf("%s: must be an integer, got string", path)
		}
		text = s
	default:
		return fmt.Sprintf("%s: must be an integer, got %s", path, kind)
	}
	return checkInteger(text, bits, signed, path)
}

// isNumberText reports whether s reads as a number, however large.
func isNumberText(s string) bool {
	_, err := strconv.ParseFloat(s, 64)
	return err == nil || errors.Is(err, strconv.ErrRange)
}

// checkInteger checks that a number's text is an integer (in any JSON
// number form, 1e3 or 1.0) that fits the field.
func checkInteger(text string, bits int, signed bool, path string) string {
	typeName := fmt.Sprintf("int%d", bits)
	var err error
	if signed {
		_, err = strconv.ParseInt(text, 10, bits)
	} else {
		typeName = "u" + typeName
		_, err = strconv.ParseUint(text, 10, bits)
	}
	if err == nil {
		return ""
	}
	f, ferr := strconv.ParseFloat(text, 64)
	switch {
	case errors.Is(ferr, strconv.ErrRange):
		return fmt.Sprintf("%s: out of range for %s: %s", path, typeName, text)
	case ferr != nil, math.IsNaN(f), math.IsInf(f, 0), f != math.Trunc(f):
		return fmt.Sprintf("%s: must be an integer, got %s", path, text)
	}
	lo, hi := 0.0, math.Exp2(float64(bits))-1
	if signed {
		lo, hi = -math.Exp2(float64(bits-1)), math.Exp2(float64(bits-1))-1
	}
	if f < lo || f > hi {
		return fmt.Sprintf("%s: out of range for %s: %s", path, typeName, text)
	}
	return ""
}

func checkFloat(fd protoreflect.FieldDescriptor, raw []byte, kind, path string) string {
	var s string
	switch kind {
	case "number":
		s = string(bytes.TrimSpace(raw))
	case "string":
		var err error
		if s, err = unquote(raw); err != nil {
			return fmt.Sprintf("%s: must be a number, got string", path)
		}
		switch s {
		case "NaN", "Infinity", "-Infinity":
			return ""
		}
	default:
		return fmt.Sprintf("%s: must be a number, got %s", path, kind)
	}
	bits := 64
	if fd.Kind() == protoreflect.FloatKind {
		bits = 32
	}
	if _, err := strconv.ParseFloat(s, bits); err != nil {
		if errors.Is(err, strconv.ErrRange) {
			return fmt.Sprintf("%s: out of range for float%d: %s", path, bits, s)
		}
		return fmt.Sprintf("%s: must be a number, got %s", path, kind)
	}
	return ""
}

// checkMapKey checks a map key, which JSON always writes as a string.
func checkMapKey(fd protoreflect.FieldDescriptor, key, path string) string {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		if key != "true" && key != "false" {
			return fmt.Sprintf("%s: map key must be true or false", path)
		}
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return checkInteger(key, 32, true, path)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return checkInteger(key, 64, true, path)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return checkInteger(key, 32, false, path)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return checkInteger(key, 64, false, path)
	}
	return ""
}

func unquote(raw []byte) (string, error) {
	var s string
	err := json.Unmarshal(raw, &s)
	return s, err
}

// isBase64 accepts what protojson accepts for bytes.
func isBase64(s string) bool {
	for _, enc := range []*base64.Encoding{
		base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding,
	} {
		if _, err := enc.DecodeString(s); err == nil {
			return true
		}
	}
	return false
}
