package eval

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"reflect"
	"slices"
	"strings"

	"github.com/osmo-rl/osmo"
)

// Redacted is what a secret's value becomes wherever osmo writes it.
const Redacted = "[REDACTED]"

// SecretsError is a required secret with no value anywhere.
type SecretsError struct {
	Missing []string
	File    string // the --secrets-file that was read, if any
}

func (e *SecretsError) Error() string {
	where := "set them in the environment, or pass --secrets-file FILE with NAME=value lines"
	if e.File != "" {
		where = "add them to " + e.File + " (NAME=value) or set them in the environment"
	}
	return fmt.Sprintf("[secrets] required: no value for %s: %s", strings.Join(e.Missing, ", "), where)
}

// ResolveSecrets finds a value for each name: from the secrets file
// (dotenv lines, NAME=value; "-" reads stdin), then the environment.
// Names in optional may stay unset (the model's key when the mock policy
// stands in for the model).
func ResolveSecrets(names []string, file string, stdin io.Reader, getenv func(string) string, optional []string) (map[string]string, error) {
	fromFile := map[string]string{}
	if file != "" {
		var r io.Reader
		if file == "-" {
			r = stdin
		} else {
			f, err := os.Open(file)
			if err != nil {
				return nil, fmt.Errorf("--secrets-file: %w", err)
			}
			defer f.Close()
			r = f
		}
		var err error
		if fromFile, err = ParseDotenv(r); err != nil {
			return nil, fmt.Errorf("--secrets-file %s: %w", file, err)
		}
	}
	out := make(map[string]string, len(names))
	var missing []string
	for _, n := range names {
		v, ok := fromFile[n]
		if !ok || v == "" {
			v = getenv(n)
		}
		if v == "" {
			if !slices.Contains(optional, n) {
				missing = append(missing, n)
			}
			continue
		}
		out[n] = v
	}
	if len(missing) > 0 {
		return nil, &SecretsError{Missing: missing, File: file}
	}
	return out, nil
}

// ParseDotenv reads NAME=value lines: blank lines and # comments are
// skipped, "export " is allowed before the name, and a value in single or
// double quotes is taken between them.
func ParseDotenv(r io.Reader) (map[string]string, error) {
	out := map[string]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		line = strings.TrimPrefix(line, "export ")
		k, v, ok := strings.Cut(line, "=")
		k = strings.TrimSpace(k)
		if !ok || !envNameRE.MatchString(k) {
			// The line's text may be the secret itself: not repeated.
			return nil, fmt.Errorf("line %d is not NAME=value", n)
		}
		v = strings.TrimSpace(v)
		if len(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		} else if i := strings.Index(v, " #"); i >= 0 {
			v = strings.TrimSpace(v[:i])
		}
		out[k] = v
	}
	return out, sc.Err()
}

// Redactor replaces known secret values with [REDACTED] in what osmo
// writes: only the value goes, as the rest of a line is why it exists.
// Every non-empty value counts, however short: a rule for "placeholders"
// could leak a real short secret. A nil *Redactor redacts nothing.
type Redactor struct {
	values []string // longest first, so one value inside another goes whole
}

// NewRedactor redacts values (empty ones are ignored).
func NewRedactor(values ...string) *Redactor {
	r := &Redactor{}
	for _, v := range values {
		if v != "" {
			r.values = append(r.values, v)
		}
	}
	slices.SortFunc(r.values, func(a, b string) int { return len(b) - len(a) })
	return r
}

// String returns s with every secret replaced.
func (r *Redactor) String(s string) string {
	if r == nil {
		return s
	}
	for _, v := range r.values {
		s = strings.ReplaceAll(s, v, Redacted)
	}
	return s
}

// Values returns the secret values, for writers that redact themselves.
func (r *Redactor) Values() []string {
	if r == nil {
		return nil
	}
	return slices.Clone(r.values)
}

// result returns res with every secret in its text replaced, once, before
// it is journaled, so every file made from it is clean. Values are
// redacted, never the JSON around them: a short secret ("s") must not turn
// "status" into something no reader can parse.
func (r *Redactor) result(res Result) Result {
	if r == nil || len(r.values) == 0 {
		return res
	}
	res.ErrMessage = r.String(res.ErrMessage)
	res.ErrCategory = r.String(res.ErrCategory)
	if res.Messages != nil {
		res.Messages, _ = r.value(res.Messages).([]map[string]any)
	}
	if res.LLMCalls != nil {
		calls := make([]*osmo.LLMCall, len(res.LLMCalls))
		for i, c := range res.LLMCalls {
			cc := *c
			if c.RequestMessages != nil {
				cc.RequestMessages = make([]json.RawMessage, len(c.RequestMessages))
				for j, m := range c.RequestMessages {
					cc.RequestMessages[j] = r.JSON(m)
				}
			}
			cc.ResponseMessage = r.JSON(c.ResponseMessage)
			cc.Error = r.String(c.Error)
			cc.NoTokensReason = r.String(c.NoTokensReason)
			calls[i] = &cc
		}
		res.LLMCalls = calls
	}
	return res
}

// value returns v (decoded JSON) with every string in it redacted.
func (r *Redactor) value(v any) any {
	switch t := v.(type) {
	case string:
		return r.String(t)
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, e := range t {
			out[k] = r.value(e)
		}
		return out
	case []any:
		out := make([]any, len(t))
		for i, e := range t {
			out[i] = r.value(e)
		}
		return out
	case []map[string]any:
		out := make([]map[string]any, len(t))
		for i, e := range t {
			out[i], _ = r.value(e).(map[string]any)
		}
		return out
	}
	return v
}

// JSON returns a JSON document with every secret in its strings replaced;
// data unchanged when none occurs or it is no JSON.
func (r *Redactor) JSON(data []byte) []byte {
	if r == nil || len(r.values) == 0 {
		return data
	}
	var doc any
	if err := json.Unmarshal(data, &doc); err != nil {
		return data
	}
	redacted := r.value(doc)
	if reflect.DeepEqual(redacted, doc) {
		return data // no secret: the document as it was written
	}
	clean, err := json.Marshal(redacted)
	if err != nil {
		return data
	}
	return clean
}
