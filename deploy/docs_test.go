package deploy_test

import (
	"flag"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the generated `osmo <command> -h` blocks of docs/deploy.md")

const deployDoc = "../docs/deploy.md"

// usageBlockRE is a generated reference block of docs/deploy.md: a marker
// comment naming the command, then a text code block holding its output.
var usageBlockRE = regexp.MustCompile("(?s)<!-- osmo ([a-z]+) -h -->\n```text\n(.*?)```")

// TestDocsReference keeps the flag reference of docs/deploy.md exactly what
// the binary prints, for every subcommand that takes flags. Run with
// -update to regenerate it.
func TestDocsReference(t *testing.T) {
	b, err := os.ReadFile(deployDoc)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	documented := map[string]bool{}
	var stale []string
	doc = usageBlockRE.ReplaceAllStringFunc(doc, func(block string) string {
		m := usageBlockRE.FindStringSubmatch(block)
		sub := m[1]
		documented[sub] = true
		want := strings.TrimRight(helpText(t, sub), "\n") + "\n"
		if m[2] != want {
			stale = append(stale, sub)
		}
		return "<!-- osmo " + sub + " -h -->\n```text\n" + want + "```"
	})
	if *update {
		if err := os.WriteFile(deployDoc, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
		stale = nil
	}
	if len(stale) > 0 {
		sort.Strings(stale)
		t.Errorf("docs/deploy.md: the usage of %v changed; run go test ./deploy/ -run TestDocsReference -update", stale)
	}
	for sub := range osmoSubcommands(t) {
		if strings.Contains(helpText(t, sub), "  -") && !documented[sub] {
			t.Errorf("docs/deploy.md has no <!-- osmo %s -h --> reference block", sub)
		}
	}
}

// TestDocsEnvironment checks that docs/deploy.md names every environment
// variable the Go code reads by name (OSMO_*, OSMOSIS_*, OTEL_*).
func TestDocsEnvironment(t *testing.T) {
	b, err := os.ReadFile(deployDoc)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	nameRE := regexp.MustCompile(`"((?:OSMO|OSMOSIS|OTEL)_[A-Z0-9_]+)"`)
	found := map[string]string{}
	walkSources(t, []string{"deploy", "e2e"}, func(path, src string) {
		for _, m := range nameRE.FindAllStringSubmatch(src, -1) {
			found[m[1]] = path
		}
	})
	if len(found) == 0 {
		t.Fatal("found no environment variable names in the sources")
	}
	for name, path := range found {
		if !strings.Contains(doc, "`"+name+"`") {
			t.Errorf("docs/deploy.md does not document %s (read in %s)", name, path)
		}
	}
}

// TestDocsEventLog checks that docs/observability.md lists every event the
// Go code writes to the --log event files: rollout service events
// (log.write), the admission events (s.enqueue(ctx, rec, EVENT, ...)), the
// deliveries (a delivery's event, set as `event: EVENT` or by
// w.callback(EVENT, ...)) and the LogEvent calls of the built-in workflows
// and integrations.
func TestDocsEventLog(t *testing.T) {
	b, err := os.ReadFile("../docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	eventRE := regexp.MustCompile(`(?:\blog\.write|\.LogEvent)\("([A-Za-z0-9_]+)"`)
	otherRE := regexp.MustCompile(`(?:\bs\.enqueue\(ctx, rec, |\bevent:\s*|\.callback\()"([a-z_]+)"`)
	found := map[string]string{}
	walkSources(t, []string{"deploy", "e2e", "third_party", "gen"}, func(path, src string) {
		for _, m := range eventRE.FindAllStringSubmatch(src, -1) {
			found[m[1]] = path
		}
		for _, m := range otherRE.FindAllStringSubmatch(src, -1) {
			found[m[1]] = path
		}
	})
	for _, want := range []string{"init", "start_request", "completion", "completion_callback", "grader_callback", "pre_llm"} {
		if found[want] == "" {
			t.Fatalf("found no %q event in the sources (found %v): the patterns are stale", want, found)
		}
	}
	for name, path := range found {
		if !strings.Contains(doc, "| `"+name+"` |") {
			t.Errorf("docs/observability.md has no row for the --log event %s (written in %s)", name, path)
		}
	}
}

// walkSources calls fn with every non-test Go file of the repository, but
// those under .git, .cache, node_modules and the directories named in skip.
func walkSources(t *testing.T, skip []string, fn func(path, src string)) {
	t.Helper()
	err := filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); n == ".git" || n == ".cache" || n == "node_modules" || slices.Contains(skip, n) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		fn(path, string(src))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// docsDemoInit is the JSON body of the curl init that docs/deploy.md shows
// for the compose demo.
func docsDemoInit(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(deployDoc)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?s)curl -s -X POST localhost:9000/v1/rollout/init.*?-d '(\{[^']*\})'`).FindSubmatch(b)
	if m == nil {
		t.Fatal("docs/deploy.md shows no curl init with a -d '{...}' body")
	}
	return string(m[1])
}
