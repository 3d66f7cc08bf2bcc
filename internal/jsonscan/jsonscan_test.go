package jsonscan

import (
	"encoding/json"
	"reflect"
	"testing"
)

// TestMembersMatchesAsEncodingJSON: Members reads the keys encoding/json
// would put in the same fields, and declines those it would match in
// another way (escaped, in another case, twice).
func TestMembersMatchesAsEncodingJSON(t *testing.T) {
	want := NewKeys("id", "n")
	for doc, ok := range map[string]bool{
		`{"id":"a","n":1,"other":{"id":2}}`: true,
		`{ }`:                               true,
		`{"x":[1,{"id":[]}],"n":null}`:      true,
		`{"ID":"a"}`:                        false,
		`{"\u0069d":"a"}`:                   false,
		`{"id":"a","id":"b"}`:               false,
		`{"n":"1"}`:                         false,
		`[]`:                                false,
	} {
		var id string
		var n int
		end, got := Members([]byte(doc), 0, want, func(k int, b []byte, i int) (int, bool) {
			if k == 0 {
				return String(b, i, &id)
			}
			return Int(b, i, &n)
		})
		if got != ok {
			t.Errorf("Members(%s) = %v, want %v", doc, got, ok)
			continue
		}
		if !ok {
			continue
		}
		if end != len(doc) {
			t.Errorf("Members(%s) ended at %d, want %d", doc, end, len(doc))
		}
		var v struct {
			ID string `json:"id"`
			N  int    `json:"n"`
		}
		if err := json.Unmarshal([]byte(doc), &v); err != nil || v.ID != id || v.N != n {
			t.Errorf("Members(%s) read %q %d; encoding/json %+v %v", doc, id, n, v, err)
		}
	}
}

// TestValuesReadAsEncodingJSON: each reader reads what encoding/json
// reads into the same type, and declines what it would fail on.
func TestValuesReadAsEncodingJSON(t *testing.T) {
	for _, c := range []struct {
		doc  string
		read func(b []byte) (any, bool)
		into any
		ok   bool
	}{
		{`"a\"b\u00e9"`, str, new(string), true},
		{"\"\xff\"", str, new(string), true},
		{`5`, str, new(string), false},
		{`[1,-2,2147483647]`, i32s, new([]int32), true},
		{`[]`, i32s, new([]int32), true},
		{`[2147483648]`, i32s, nil, false},
		{`[1.5]`, i32s, nil, false},
		{`-9223372036854775808`, integer, new(int), true},
		{`1e3`, integer, nil, false},
		{`-0.5e-3`, float, new(float64), true},
		{`1e999`, float, nil, false},
		{`"1"`, float, nil, false},
	} {
		got, ok := c.read([]byte(c.doc))
		if ok != c.ok {
			t.Errorf("%s: read %v, want %v", c.doc, ok, c.ok)
			continue
		}
		if !ok {
			continue
		}
		if err := json.Unmarshal([]byte(c.doc), c.into); err != nil {
			t.Fatal(err)
		}
		if want := reflect.ValueOf(c.into).Elem().Interface(); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: read %#v, encoding/json %#v", c.doc, got, want)
		}
	}
}

func str(b []byte) (any, bool) {
	var s string
	end, ok := String(b, 0, &s)
	return s, ok && end == len(b)
}

func i32s(b []byte) (any, bool) {
	var v []int32
	end, ok := Int32s(b, 0, &v)
	return v, ok && end == len(b)
}

func integer(b []byte) (any, bool) {
	var n int
	end, ok := Int(b, 0, &n)
	return n, ok && end == len(b)
}

func float(b []byte) (any, bool) {
	var f float64
	end, ok := Float(b, 0, &f)
	return f, ok && end == len(b)
}

// TestObjectPassesOverNull: Object reads an object as Members does, and
// passes over a null without calling f; anything else is not read.
func TestObjectPassesOverNull(t *testing.T) {
	want := NewKeys("id")
	for doc, c := range map[string]struct {
		ok    bool
		calls int
	}{
		`null`:       {true, 0},
		`{"id":"a"}`: {true, 1},
		`{"ID":"a"}`: {false, 0},
		`[]`:         {false, 0},
		`"null"`:     {false, 0},
	} {
		calls := 0
		end, ok := Object([]byte(doc), 0, want, func(_ int, b []byte, i int) (int, bool) {
			calls++
			var s string
			return String(b, i, &s)
		})
		if ok != c.ok || calls != c.calls || ok && end != len(doc) {
			t.Errorf("Object(%s) = %d, %v with %d calls; want %v with %d, ending at %d", doc, end, ok, calls, c.ok, c.calls, len(doc))
		}
	}
}
