package eval_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/osmo-rl/osmo/internal/eval"
)

// FuzzDatasetRows feeds dataset files (JSONL when csv is false, CSV when
// true) to loadDataset: every row loads with a user prompt, or the file is
// refused with a *DatasetError naming it. Seeds are in testdata/fuzz.
func FuzzDatasetRows(f *testing.F) {
	f.Add(false, []byte(`{"user_prompt":"What is 6 times 7?","ground_truth":"42","system_prompt":"Be brief."}`+"\n"+`{"user_prompt":"2+2","label":4,"metadata":{"difficulty":"easy"},"split":"test"}`))
	f.Add(false, []byte("\n\n{\"user_prompt\": [1, {\"a\": null}]}\n[1]\n"))
	f.Add(true, []byte("user_prompt,ground_truth,metadata\n\"What is 6, times 7?\",42,\"{\"\"k\"\":1}\"\n"))
	f.Add(true, []byte("system_prompt,user_prompt\nx\n"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, csv bool, data []byte) {
		path := filepath.Join(dir, "rows.jsonl")
		if csv {
			path = filepath.Join(dir, "rows.csv")
		}
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		rows, err := loadDataset(path)
		if err != nil {
			var de *eval.DatasetError
			if !errors.As(err, &de) || de.Path != path || rows != nil {
				t.Fatalf("error %T %v, want a *DatasetError naming %s", err, err, path)
			}
			return
		}
		if len(rows) == 0 {
			t.Fatal("no error and no rows")
		}
		for i, r := range rows {
			if r.Index != i || r.SourceIndex != i {
				t.Fatalf("row %d has index %d, source index %d", i, r.Index, r.SourceIndex)
			}
			// A row runs on a user prompt or, in a dataset with a metadata
			// column, on a non-empty metadata object alone.
			prompt := len(r.Messages) > 0 && r.Messages[len(r.Messages)-1]["role"] == "user"
			if !prompt && len(r.Metadata) == 0 {
				t.Fatalf("row %d has neither a user prompt nor metadata: %v", i, r.Messages)
			}
		}
	})
}
