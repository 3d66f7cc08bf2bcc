package deploy_test

import (
	"flag"
	"io"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"
	natsserver "github.com/nats-io/nats-server/v2/server"
)

// isNATS reports whether a compose service runs the NATS server image.
func isNATS(s types.ServiceConfig) bool { return strings.HasPrefix(s.Image, "nats:") }

// natsConfigFiles writes the compose configs a service mounts (inline
// content) into files of the test's own and maps each mount target to its
// file.
func natsConfigFiles(t *testing.T, p *types.Project, s types.ServiceConfig) map[string]string {
	t.Helper()
	files := map[string]string{}
	dir := t.TempDir()
	for i, ref := range s.Configs {
		c, ok := p.Configs[ref.Source]
		if !ok {
			t.Fatalf("service %s mounts config %s, which is not declared", s.Name, ref.Source)
		}
		if c.Content == "" {
			t.Fatalf("config %s has no inline content", ref.Source)
		}
		target := ref.Target
		if target == "" {
			target = "/" + ref.Source // compose's default mount point
		}
		f := filepath.Join(dir, strconv.Itoa(i)+"-"+path.Base(target))
		if err := os.WriteFile(f, []byte(c.Content), 0o600); err != nil {
			t.Fatal(err)
		}
		files[path.Clean(target)] = f
	}
	return files
}

// parseNATSArgs parses a nats-server command line with nats-server's own
// flag handling, which reads the config file it names too, as the server
// would start with it.
func parseNATSArgs(t *testing.T, args []string) *natsserver.Options {
	t.Helper()
	fs := flag.NewFlagSet("nats-server", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	noop := func() {}
	opts, err := natsserver.ConfigureOptions(fs, args, noop, noop, noop)
	if err != nil {
		t.Fatalf("nats-server %q: %v", args, err)
	}
	if opts == nil {
		t.Fatalf("nats-server %q only prints something (help, version)", args)
	}
	return opts
}

// composeNATSOptions are the options the compose nats service starts with:
// its command and the config files mounted into it.
func composeNATSOptions(t *testing.T, p *types.Project, s types.ServiceConfig) *natsserver.Options {
	t.Helper()
	files := natsConfigFiles(t, p, s)
	args := make([]string, len(s.Command))
	for i, a := range s.Command {
		args[i] = a
		if f, ok := files[path.Clean(a)]; ok {
			args[i] = f
		}
	}
	return parseNATSArgs(t, args)
}

// natsPortFlags are nats-server's flags that name a port it listens on.
var natsPortFlags = map[string]bool{"p": true, "port": true, "m": true, "http_port": true, "ms": true, "https_port": true}

// natsURLs splits a --nats value into its URLs.
func natsURLs(t *testing.T, v string) []*url.URL {
	t.Helper()
	var urls []*url.URL
	for _, s := range strings.Split(v, ",") {
		u, err := url.Parse(strings.TrimSpace(s))
		if err != nil || (u.Scheme != "nats" && u.Scheme != "tls") || u.Hostname() == "" || u.Port() == "" {
			t.Errorf("--nats %q: %q is no nats://HOST:PORT or tls://HOST:PORT URL (%v)", v, s, err)
			continue
		}
		urls = append(urls, u)
	}
	return urls
}
