package deploy_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// repoRoot is the repository root, where the Dockerfile and compose file live.
const repoRoot = ".."

// Build arguments the test binary is built with, through the Dockerfile's own
// -ldflags, so `osmo version` proves they reach cli.Version.
const (
	testVersion = "v0.0.0-deploytest"
	testCommit  = "0123abcd"
	testDate    = "2026-01-02T03:04:05Z"
)

// osmoBin is the osmo binary under test, built once in TestMain.
var osmoBin string

func TestMain(m *testing.M) {
	code, err := run(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "deploy tests:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func run(m *testing.M) (int, error) {
	dir, err := os.MkdirTemp("", "osmo-deploy-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	ldflags, err := dockerfileLDFlags(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		return 0, err
	}
	ldflags = strings.NewReplacer("${VERSION}", testVersion, "${COMMIT}", testCommit, "${DATE}", testDate).Replace(ldflags)
	osmoBin = filepath.Join(dir, "osmo")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", ldflags, "-o", osmoBin, "../cmd/osmo")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return 0, fmt.Errorf("go build ../cmd/osmo with the Dockerfile's -ldflags %q: %w", ldflags, err)
	}
	return m.Run(), nil
}

// dockerfileLDFlags returns the -ldflags value of the Dockerfile's go build,
// with its ${ARG} references left in.
func dockerfileLDFlags(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	text := strings.ReplaceAll(string(b), "\\\n", " ")
	m := regexp.MustCompile(`go build [^\n]*-ldflags "([^"]*)"`).FindStringSubmatch(text)
	if m == nil {
		return "", fmt.Errorf("%s: no `go build ... -ldflags \"...\"` found", path)
	}
	return m[1], nil
}

// help is what `osmo <sub> -h` says about a subcommand's flags.
type help struct {
	// flags maps a flag name (no dashes) to its type as the usage prints it:
	// "string", "int", "duration", ..., or "" for a boolean.
	flags map[string]string
}

var (
	helpMu    sync.Mutex
	helpCache = map[string]*help{}
)

// osmoSubcommands lists the subcommands `osmo -h` names.
func osmoSubcommands(t *testing.T) map[string]bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, osmoBin, "-h").Output()
	if err != nil {
		t.Fatalf("osmo -h: %v", err)
	}
	subs := map[string]bool{}
	inCommands := false
	for _, line := range strings.Split(string(out), "\n") {
		switch {
		case strings.HasPrefix(line, "Commands:"):
			inCommands = true
		case inCommands && strings.HasPrefix(line, "  "):
			subs[strings.Fields(line)[0]] = true
		case inCommands && strings.TrimSpace(line) == "":
			if len(subs) > 0 {
				inCommands = false
			}
		}
	}
	if len(subs) == 0 {
		t.Fatalf("osmo -h lists no commands:\n%s", out)
	}
	return subs
}

// helpOf runs `osmo <sub> -h`, which must exit 0, and parses its flags.
func helpOf(t *testing.T, sub string) *help {
	t.Helper()
	helpMu.Lock()
	defer helpMu.Unlock()
	if h, ok := helpCache[sub]; ok {
		return h
	}
	if !osmoSubcommands(t)[sub] {
		t.Fatalf("%q is not an osmo subcommand", sub)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, osmoBin, sub, "-h")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("osmo %s -h: %v\n%s", sub, err, out.String())
	}
	h := &help{flags: map[string]string{}}
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "  -") {
			continue
		}
		f := strings.Fields(line)
		typ := ""
		if len(f) > 1 {
			typ = f[1]
		}
		h.flags[strings.TrimPrefix(f[0], "-")] = typ
	}
	if len(h.flags) == 0 {
		t.Fatalf("osmo %s -h lists no flags:\n%s", sub, out.String())
	}
	helpCache[sub] = h
	return h
}

// helpText is the output of `osmo <sub> -h`.
func helpText(t *testing.T, sub string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, osmoBin, sub, "-h").CombinedOutput()
	if err != nil {
		t.Fatalf("osmo %s -h: %v\n%s", sub, err, out)
	}
	return string(out)
}

// cmdline is an osmo command line split into its subcommand and flags.
type cmdline struct {
	sub   string
	flags map[string][]string // name without dashes -> values in order
	args  []string            // positional arguments
}

func (c cmdline) last(name string) (string, bool) {
	v := c.flags[name]
	if len(v) == 0 {
		return "", false
	}
	return v[len(v)-1], true
}

// parseCmdline checks argv (subcommand first) against `osmo <sub> -h`: the
// subcommand must exist, every flag must be one it accepts, and every value
// must parse as the flag's type. Both --name=value and --name value work.
func parseCmdline(argv []string, h *help) (cmdline, error) {
	if len(argv) == 0 {
		return cmdline{}, errors.New("empty command")
	}
	c := cmdline{sub: argv[0], flags: map[string][]string{}}
	for i := 1; i < len(argv); i++ {
		a := argv[i]
		if !strings.HasPrefix(a, "-") || a == "-" {
			c.args = append(c.args, a)
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		typ, ok := h.flags[name]
		if !ok {
			return c, fmt.Errorf("osmo %s does not accept flag %q", c.sub, a)
		}
		if !hasValue {
			if typ == "" {
				value = "true"
			} else {
				if i+1 >= len(argv) {
					return c, fmt.Errorf("osmo %s: flag %q has no value", c.sub, a)
				}
				i++
				value = argv[i]
			}
		}
		if err := checkFlagValue(typ, value); err != nil {
			return c, fmt.Errorf("osmo %s: flag -%s=%q: %w", c.sub, name, value, err)
		}
		c.flags[name] = append(c.flags[name], value)
	}
	return c, nil
}

func checkFlagValue(typ, value string) error {
	var err error
	switch typ {
	case "":
		_, err = strconv.ParseBool(value)
	case "int":
		_, err = strconv.ParseInt(value, 0, 0)
	case "int64":
		_, err = strconv.ParseInt(value, 0, 64)
	case "uint", "uint64":
		_, err = strconv.ParseUint(value, 0, 64)
	case "float64":
		_, err = strconv.ParseFloat(value, 64)
	case "duration":
		_, err = time.ParseDuration(value)
	}
	return err
}

// listenFlags are the flags by which a subcommand is told where to listen.
var listenFlags = []string{"addr", "grpc-addr", "metrics-addr", "p", "port"}

// listenPorts returns the ports a command line listens on, by flag.
func listenPorts(c cmdline) (map[string]int, error) {
	ports := map[string]int{}
	for _, name := range listenFlags {
		v, ok := c.last(name)
		if !ok {
			continue
		}
		if name == "p" || name == "port" {
			n, err := strconv.Atoi(v)
			if err != nil {
				return nil, fmt.Errorf("-%s=%q: %w", name, v, err)
			}
			ports[name] = n
			continue
		}
		_, p, ok := strings.Cut(v, ":")
		n, err := strconv.Atoi(p)
		if !ok || err != nil {
			return nil, fmt.Errorf("--%s=%q: want [host]:port", name, v)
		}
		ports[name] = n
	}
	return ports, nil
}

// drainTimeout is a rollout command line's --drain-timeout, or its default
// as `osmo rollout -h` prints it.
func drainTimeout(t *testing.T, c cmdline) time.Duration {
	t.Helper()
	if v, ok := c.last("drain-timeout"); ok {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("--drain-timeout=%q: %v", v, err)
		}
		return d
	}
	if c.sub != "rollout" && c.sub != "serve" {
		return 0
	}
	out := []byte(helpText(t, c.sub))
	m := regexp.MustCompile(`(?s)-drain-timeout duration\n[^\n]*\(default ([^)]+)\)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("osmo %s -h shows no --drain-timeout default:\n%s", c.sub, out)
	}
	d, err := time.ParseDuration(string(m[1]))
	if err != nil {
		t.Fatal(err)
	}
	return d
}
