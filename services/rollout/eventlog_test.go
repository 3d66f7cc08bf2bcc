package rollout

import (
	"strings"
	"testing"
)

func TestLogFileName(t *testing.T) {
	long := strings.Repeat("a", 255-len("rollout-.jsonl"))
	for _, id := range []string{"r1", "col_x", "A-b.c_9", long} {
		if got, want := logFileName(id), "rollout-"+id+".jsonl"; got != want {
			t.Errorf("logFileName(%q) = %q, want %q", id, got, want)
		}
	}
	seen := map[string]string{}
	for _, id := range []string{
		"col x", "col_x", "col/x", "col\x00x", "col\xffx", "colé", "col__x",
		long, long + "a", long + "b", strings.Repeat("é", 256), strings.Repeat("界", 256),
		"col_x~" + logFileName("col x")[len("rollout-col_x~"):len("rollout-col_x~")+hashHex],
	} {
		name := logFileName(id)
		if prev, dup := seen[name]; dup {
			t.Errorf("ids %q and %q share %q", prev, id, name)
		}
		seen[name] = id
		if len(name) > maxFileName || !strings.HasPrefix(name, "rollout-") || !strings.HasSuffix(name, ".jsonl") {
			t.Errorf("logFileName(%q) = %q", id, name)
		}
		for _, r := range name {
			if r != '~' && sanitizeFileName(string(r)) != string(r) {
				t.Errorf("logFileName(%q) = %q holds %q", id, name, r)
			}
		}
	}
	if got, want := logFileName("col x"), "rollout-col_x~"; !strings.HasPrefix(got, want) || len(got) != len(want)+hashHex+len(".jsonl") {
		t.Errorf("logFileName(%q) = %q, want %s<%d hex>.jsonl", "col x", got, want, hashHex)
	}
}
