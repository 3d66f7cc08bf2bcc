package deploy_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// dockerfile is the parsed final stage of the Dockerfile.
type dockerfile struct {
	text       string
	entrypoint string
	user       string
	exposed    map[int]bool
	from       []string
}

func readDockerfile(t *testing.T) dockerfile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	d := dockerfile{text: string(b), exposed: map[int]bool{}}
	for _, line := range strings.Split(strings.ReplaceAll(d.text, "\\\n", " "), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || strings.HasPrefix(f[0], "#") {
			continue
		}
		switch strings.ToUpper(f[0]) {
		case "FROM":
			d.from = append(d.from, line)
		case "ENTRYPOINT":
			d.entrypoint = strings.TrimSpace(strings.TrimPrefix(line, f[0]))
		case "USER":
			d.user = f[1]
		case "EXPOSE":
			for _, p := range f[1:] {
				n, err := strconv.Atoi(strings.TrimSuffix(p, "/tcp"))
				if err != nil {
					t.Fatalf("EXPOSE %s: %v", p, err)
				}
				d.exposed[n] = true
			}
		}
	}
	return d
}

// TestDockerfile checks what the compose file and the manifests rely on: the
// entrypoint is the binary (so `command:` and `args:` start with the
// subcommand), the final stage runs as a numeric non-root user, the build is
// static and stamps the version into cli.Version.
func TestDockerfile(t *testing.T) {
	d := readDockerfile(t)
	t.Run("entrypoint is /osmo", func(t *testing.T) {
		if d.entrypoint != `["/osmo"]` {
			t.Fatalf("ENTRYPOINT %s, want [\"/osmo\"]", d.entrypoint)
		}
	})
	t.Run("final stage is distroless static and non-root", func(t *testing.T) {
		last := d.from[len(d.from)-1]
		if !strings.Contains(last, "gcr.io/distroless/static") || !strings.Contains(last, ":nonroot") {
			t.Fatalf("final stage %q, want gcr.io/distroless/static...:nonroot", last)
		}
		uid, _, _ := strings.Cut(d.user, ":")
		if n, err := strconv.Atoi(uid); err != nil || n == 0 {
			t.Fatalf("USER %q: want a numeric non-zero uid, so runAsNonRoot can verify it", d.user)
		}
	})
	t.Run("builder is golang with a module cache, static and trimmed", func(t *testing.T) {
		if !strings.Contains(d.from[0], "golang:${GO_VERSION}") || !strings.Contains(d.text, "ARG GO_VERSION=1.26") {
			t.Fatalf("builder stage %q: want golang:${GO_VERSION} with GO_VERSION=1.26", d.from[0])
		}
		for _, want := range []string{"--mount=type=cache,target=/go/pkg/mod", "CGO_ENABLED=0", "-trimpath", "ARG VERSION", "ARG COMMIT", "ARG DATE", "org.opencontainers.image.version", "org.opencontainers.image.revision"} {
			if !strings.Contains(d.text, want) {
				t.Errorf("Dockerfile lacks %q", want)
			}
		}
	})
	t.Run("exposes the default ports of the subcommands", func(t *testing.T) {
		for _, sub := range []string{"gateway", "rollout", "grader", "llmproxy", "mockllm"} {
			out := []byte(helpText(t, sub))
			for _, m := range regexp.MustCompile(`-(?:addr|grpc-addr|metrics-addr) string\n[^\n]*\(default ":(\d+)"\)`).FindAllSubmatch(out, -1) {
				n, _ := strconv.Atoi(string(m[1]))
				if !d.exposed[n] {
					t.Errorf("osmo %s listens on :%d by default; the Dockerfile does not EXPOSE it", sub, n)
				}
			}
		}
	})
	t.Run("version build arguments reach osmo version", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, osmoBin, "version").Output()
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{testVersion, testCommit, testDate} {
			if !strings.Contains(string(out), want) {
				t.Errorf("osmo version = %q; want it to contain %q", out, want)
			}
		}
	})
}

// TestDockerignore checks the build context keeps what the build needs and
// leaves out secrets, VCS data and caches.
func TestDockerignore(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	var patterns []string
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line != "" && !strings.HasPrefix(line, "#") {
			patterns = append(patterns, line)
		}
	}
	// ignored reports whether a pattern matches path or one of its parents;
	// a leading **/ matches at any depth, as in Docker's matcher.
	ignored := func(path string) bool {
		parts := strings.Split(path, "/")
		for _, p := range patterns {
			if strings.HasPrefix(p, "!") {
				continue
			}
			for i := 1; i <= len(parts); i++ {
				prefix := strings.Join(parts[:i], "/")
				if ok, _ := filepath.Match(p, prefix); ok {
					return true
				}
				if rest, ok := strings.CutPrefix(p, "**/"); ok {
					for j := 0; j < i; j++ {
						if ok, _ := filepath.Match(rest, strings.Join(parts[j:i], "/")); ok {
							return true
						}
					}
				}
			}
		}
		return false
	}
	for _, keep := range []string{"go.mod", "go.sum", "cmd/osmo/main.go", "cli/cli.go", "gen/openapi/osmo.swagger.json", "internal/server/server.go", "doc.go"} {
		if ignored(keep) {
			t.Errorf(".dockerignore drops %s, which the build needs", keep)
		}
	}
	for _, drop := range []string{".git/config", ".env", ".cache/bin/jaeger", "node_modules/x/index.js", "web/node_modules/x", "mockllm.test"} {
		if !ignored(drop) {
			t.Errorf(".dockerignore keeps %s in the build context", drop)
		}
	}
}
