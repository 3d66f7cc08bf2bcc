package eval

import (
	"bufio"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/parquet-go/parquet-go"
)

// Row is one dataset row, ready to run: its messages (the system prompt,
// if any, then the user prompt), the label only the grader sees, and the
// metadata both see.
type Row struct {
	// Index is the row's position within the rows a run selected
	// (row_index), SourceIndex its position in the dataset file
	// (source_row_index).
	Index, SourceIndex int
	Messages           []map[string]any
	Label              *string
	Metadata           map[string]any
}

// The columns a row is made of; any other column goes into its metadata.
const (
	colSystem      = "system_prompt"
	colUser        = "user_prompt"
	colGroundTruth = "ground_truth"
	colLabel       = "label"
	colMetadata    = "metadata"
)

// DatasetError is a dataset that cannot run, naming the file and, where it
// is one row's fault, the row.
type DatasetError struct {
	Path string
	Row  int // -1 when not one row's
	Msg  string
}

func (e *DatasetError) Error() string {
	if e.Row >= 0 {
		return fmt.Sprintf("%s: row %d: %s", e.Path, e.Row, e.Msg)
	}
	return fmt.Sprintf("%s: %s", e.Path, e.Msg)
}

// maxLine bounds one JSONL line (a long conversation fits).
const maxLine = 64 << 20

// Dataset is a dataset file's rows as read, before any is checked: a run
// checks the rows it selects, as the Osmosis SDK does, so a bad row it
// does not run cannot stop it.
type Dataset struct {
	Path string
	raws []map[string]any
}

// Len is the number of rows in the file.
func (d *Dataset) Len() int { return len(d.raws) }

// ReadDataset reads a .jsonl, .csv or .parquet file's rows.
func ReadDataset(path string) (*Dataset, error) {
	var raws []map[string]any
	var err error
	switch ext := strings.ToLower(filepath.Ext(path)); ext {
	case ".jsonl":
		raws, err = readJSONL(path)
	case ".csv":
		raws, err = readCSV(path)
	case ".parquet":
		raws, err = readParquet(path)
	default:
		return nil, &DatasetError{Path: path, Row: -1, Msg: fmt.Sprintf("unknown format %q: want .jsonl, .csv or .parquet", ext)}
	}
	if err != nil {
		var de *DatasetError
		if errors.As(err, &de) {
			return nil, err
		}
		return nil, &DatasetError{Path: path, Row: -1, Msg: err.Error()}
	}
	if len(raws) == 0 {
		return nil, &DatasetError{Path: path, Row: -1, Msg: "the dataset has no rows"}
	}
	return &Dataset{Path: path, raws: raws}, nil
}

// Select checks and returns the rows a run runs: the file offsets rows
// selects (see ParseRows; each must exist), else offset and limit (0: all).
func (d *Dataset) Select(rows string, offset, limit int) ([]Row, error) {
	var idx []int
	switch {
	case rows != "":
		rows, err := ParseRows(rows)
		if err != nil {
			return nil, err
		}
		for _, i := range rows {
			if i >= len(d.raws) {
				return nil, &DatasetError{Path: d.Path, Row: -1, Msg: fmt.Sprintf("--rows selects row %d but the file has %d rows (valid indices are 0-%d)", i, len(d.raws), len(d.raws)-1)}
			}
		}
		idx = rows
	default:
		if offset >= len(d.raws) {
			return nil, &DatasetError{Path: d.Path, Row: -1, Msg: fmt.Sprintf("offset %d is past the dataset's %d rows", offset, len(d.raws))}
		}
		end := len(d.raws)
		if limit > 0 {
			end = min(end, offset+limit)
		}
		for i := offset; i < end; i++ {
			idx = append(idx, i)
		}
	}
	out := make([]Row, 0, len(idx))
	for _, src := range idx {
		row, err := normalize(d.raws[src], len(out), src)
		if err != nil {
			return nil, &DatasetError{Path: d.Path, Row: src, Msg: err.Error()}
		}
		out = append(out, row)
	}
	return out, nil
}

func readJSONL(path string) ([]map[string]any, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	var out []map[string]any
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" {
			continue
		}
		var raw map[string]any
		dec := json.NewDecoder(strings.NewReader(text))
		dec.UseNumber()
		if err := dec.Decode(&raw); err != nil || raw == nil {
			return nil, &DatasetError{Path: path, Row: len(out), Msg: fmt.Sprintf("line %d is not a JSON object", line)}
		}
		out = append(out, raw)
	}
	return out, sc.Err()
}

func readCSV(path string) ([]map[string]any, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r := csv.NewReader(f)
	header, err := r.Read()
	if err == io.EOF {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("CSV header: %w", err)
	}
	var out []map[string]any
	for {
		rec, err := r.Read()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, &DatasetError{Path: path, Row: len(out), Msg: err.Error()}
		}
		raw := make(map[string]any, len(header))
		for i, col := range header {
			// An empty cell is no value, as CSV cannot say null; the
			// metadata column stays present (see normalize).
			switch {
			case rec[i] != "":
				raw[col] = rec[i]
			case col == colMetadata:
				raw[col] = nil
			}
		}
		out = append(out, raw)
	}
}

func readParquet(path string) ([]map[string]any, error) {
	rows, err := parquet.ReadFile[any](path)
	if err != nil {
		return nil, fmt.Errorf("parquet: %w", err)
	}
	out := make([]map[string]any, 0, len(rows))
	for _, r := range rows {
		m, ok := r.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("parquet: a row reads as %T, not a record", r)
		}
		out = append(out, m)
	}
	return out, nil
}

// normalize turns a raw row into a Row, as the Osmosis SDK reads one:
// the prompts become messages and the label is kept apart. A row needs a
// user prompt, unless the dataset has a metadata column: then a prompt or
// a non-empty metadata object will do ({} counts as absent). Unlike the
// SDK, osmo also lays every other column into the metadata, where the
// workflow and the grader both see it.
func normalize(raw map[string]any, index, source int) (Row, error) {
	row := Row{Index: index, SourceIndex: source}
	_, metadataMode := raw[colMetadata]
	if v, ok := raw[colMetadata]; ok && v != nil {
		md, err := asObject(v)
		if err != nil {
			return row, fmt.Errorf("metadata: %w", err)
		}
		if len(md) > 0 {
			row.Metadata = md
		}
	}
	user, ok := text(raw[colUser])
	if !ok && !metadataMode {
		return row, fmt.Errorf("%s: missing (a row needs a user prompt, unless the dataset has a %s column)", colUser, colMetadata)
	}
	if system, ok := text(raw[colSystem]); ok {
		row.Messages = append(row.Messages, map[string]any{"role": "system", "content": system})
	}
	if ok {
		row.Messages = append(row.Messages, map[string]any{"role": "user", "content": user})
	}
	if !ok && row.Metadata == nil {
		return row, fmt.Errorf("has no prompt and no metadata; a row needs at least a %s or a non-empty %s object", colUser, colMetadata)
	}
	if row.Messages == nil {
		row.Messages = []map[string]any{}
	}
	for _, col := range []string{colGroundTruth, colLabel} {
		if v, ok := text(raw[col]); ok {
			row.Label = &v
			break
		}
	}
	// Any other column is metadata, unless the metadata object has it.
	for col, v := range raw {
		switch col {
		case colSystem, colUser, colGroundTruth, colLabel, colMetadata:
			continue
		}
		if row.Metadata == nil {
			row.Metadata = map[string]any{}
		}
		if _, taken := row.Metadata[col]; !taken {
			row.Metadata[col] = plain(v)
		}
	}
	return row, nil
}

// text is a cell as text: strings as they are, numbers and booleans as
// JSON; empty or null is no value.
func text(v any) (string, bool) {
	switch t := v.(type) {
	case nil:
		return "", false
	case string:
		return t, t != ""
	case []byte:
		return string(t), len(t) > 0
	}
	b, err := json.Marshal(plain(v))
	if err != nil {
		return fmt.Sprint(v), true
	}
	return string(b), true
}

// asObject reads a metadata cell: a JSON object, or the text of one (CSV
// and some JSONL writers encode it).
func asObject(v any) (map[string]any, error) {
	switch t := v.(type) {
	case map[string]any:
		return plainMap(t), nil
	case string, []byte:
		s, _ := text(t)
		var m map[string]any
		if err := json.Unmarshal([]byte(s), &m); err != nil || m == nil {
			if len(s) > 40 {
				s = s[:40] + "..."
			}
			return nil, fmt.Errorf("must be a JSON object, got %q", s)
		}
		return m, nil
	}
	return nil, fmt.Errorf("must be a JSON object, got %T", v)
}

// plain turns decoded values (json.Number, Parquet's types) into what
// encoding/json writes back unchanged.
func plain(v any) any {
	switch t := v.(type) {
	case json.Number:
		if i, err := t.Int64(); err == nil {
			return i
		}
		f, _ := t.Float64()
		return f
	case map[string]any:
		return plainMap(t)
	case []any:
		out := make([]any, len(t))
		for i, e := range t {
			out[i] = plain(e)
		}
		return out
	case []byte:
		return string(t)
	}
	return v
}

func plainMap(m map[string]any) map[string]any {
	out := maps.Clone(m)
	for k, v := range out {
		out[k] = plain(v)
	}
	return out
}

// ParseRows reads a row selection such as "3,7,10-20" into ascending,
// distinct row indexes.
func ParseRows(spec string) ([]int, error) {
	seen := map[int]bool{}
	for _, part := range strings.Split(spec, ",") {
		part = strings.TrimSpace(part)
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a {
			return nil, fmt.Errorf("--rows: %q is not an index or a range such as 10-20", part)
		}
		if b-a > 1_000_000 {
			return nil, fmt.Errorf("--rows: range %q is too large", part)
		}
		for i := a; i <= b; i++ {
			seen[i] = true
		}
	}
	return slices.Sorted(maps.Keys(seen)), nil
}
