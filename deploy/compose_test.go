package deploy_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	composecli "github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"

	"github.com/osmo-rl/osmo/internal/natsstore"
	"github.com/osmo-rl/osmo/internal/server"
)

// osmoImage is the image the compose file gives osmo's own services when
// OSMO_IMAGE is unset.
const osmoImage = "osmo:local"

// composeProject loads a copy of the repository's docker-compose.yml with
// compose-go, every profile enabled, as `docker compose` would in a checkout:
// with dotEnv the copy sits beside a .env made from .env.example; without, no
// .env exists. Interpolation sees only that .env, never the test's
// environment, so the result does not depend on the machine.
func composeProject(t *testing.T, dotEnv bool) *types.Project {
	t.Helper()
	dir := t.TempDir()
	copyFile(t, filepath.Join(repoRoot, "docker-compose.yml"), filepath.Join(dir, "docker-compose.yml"))
	opts := []composecli.ProjectOptionsFn{
		composecli.WithWorkingDirectory(dir),
		composecli.WithName("osmo"),
		composecli.WithProfiles([]string{"*"}),
	}
	if dotEnv {
		copyFile(t, filepath.Join(repoRoot, ".env.example"), filepath.Join(dir, ".env"))
		opts = append(opts, composecli.WithEnvFiles(filepath.Join(dir, ".env")), composecli.WithDotEnv)
	}
	po, err := composecli.NewProjectOptions([]string{filepath.Join(dir, "docker-compose.yml")}, opts...)
	if err != nil {
		t.Fatalf("compose options: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := po.LoadProject(ctx)
	if err != nil {
		t.Fatalf("load docker-compose.yml (dotenv=%v): %v", dotEnv, err)
	}
	return p
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// isOsmo reports whether a compose service runs the osmo image.
func isOsmo(s types.ServiceConfig) bool { return s.Image == osmoImage }

// composeCmd parses an osmo service's command against the binary's usage.
func composeCmd(t *testing.T, s types.ServiceConfig) cmdline {
	t.Helper()
	if len(s.Command) == 0 {
		t.Fatalf("service %s has no command", s.Name)
	}
	c, err := parseCmdline(s.Command, helpOf(t, s.Command[0]))
	if err != nil {
		t.Fatalf("service %s: %v", s.Name, err)
	}
	return c
}

// exposedPorts are the container ports a service declares (expose and ports).
func exposedPorts(t *testing.T, s types.ServiceConfig) map[int]bool {
	t.Helper()
	ports := map[int]bool{}
	for _, e := range s.Expose {
		n, err := strconv.Atoi(e)
		if err != nil {
			t.Fatalf("service %s: expose %q: %v", s.Name, e, err)
		}
		ports[n] = true
	}
	for _, p := range s.Ports {
		ports[int(p.Target)] = true
	}
	return ports
}

// hostPortRE finds host:port references in a command argument or an
// environment value: bare ":9090", "grader:9091", "dns:///grader:9091",
// "http://jaeger:4317". Group 2 is the host, group 3 the port.
var hostPortRE = regexp.MustCompile(`(^|/)([A-Za-z0-9.-]*):(\d{1,5})\b`)

// localHosts name the container itself.
var localHosts = map[string]bool{"": true, "0.0.0.0": true, "127.0.0.1": true, "localhost": true}

// hostPortRef is one host:port a service mentions.
type hostPortRef struct{ where, host, port string }

// hostPortRefs returns every host:port a service's command, healthcheck and
// environment mention.
func hostPortRefs(s types.ServiceConfig) []hostPortRef {
	var refs []hostPortRef
	add := func(where, text string) {
		for _, m := range hostPortRE.FindAllStringSubmatch(text, -1) {
			refs = append(refs, hostPortRef{where + ": " + text, m[2], m[3]})
		}
	}
	for _, a := range s.Command {
		add("command", a)
	}
	if s.HealthCheck != nil {
		for _, a := range s.HealthCheck.Test {
			add("healthcheck", a)
		}
	}
	for k, v := range s.Environment {
		if v != nil {
			add("environment "+k, *v)
		}
	}
	return refs
}

// TestComposeFile checks docker-compose.yml as `docker compose` loads it:
// real osmo subcommands and flags, ports and addresses that agree,
// health checks, start order, tracing, restarts, shutdown, the shared state
// in NATS and keys.
func TestComposeFile(t *testing.T) {
	bare := composeProject(t, false)
	withEnv := composeProject(t, true)

	t.Run("services and profiles", func(t *testing.T) {
		want := map[string][]string{
			"gateway": nil, "rollout": nil, "grader": nil, "nats": nil, "jaeger": nil,
			"mockllm": {"demo"}, "llmproxy": {"proxy"},
		}
		for name, profiles := range want {
			s, err := bare.GetService(name)
			if err != nil {
				t.Errorf("service %s: %v", name, err)
				continue
			}
			if !slices.Equal(s.Profiles, profiles) {
				t.Errorf("service %s: profiles %v, want %v", name, s.Profiles, profiles)
			}
		}
		if len(bare.Services) != len(want) {
			t.Errorf("services %v, want exactly %d", bare.ServiceNames(), len(want))
		}
	})

	t.Run("osmo commands are real subcommands with accepted flags", func(t *testing.T) {
		for _, s := range bare.Services {
			if !isOsmo(s) {
				continue
			}
			c := composeCmd(t, s)
			if s.Build == nil || s.Build.Context != bare.WorkingDir || s.Build.Dockerfile != "Dockerfile" {
				t.Errorf("service %s: build %+v, want the Dockerfile in the project directory", s.Name, s.Build)
			}
			if c.sub == "demo" || c.sub == "bench" || c.sub == "health" || c.sub == "version" {
				t.Errorf("service %s runs the one-shot subcommand %q", s.Name, c.sub)
			}
			// Every address the service listens on is spelled out, so the
			// ports below are all of them (a default like --metrics-addr
			// :9464 would listen unseen).
			h := helpOf(t, c.sub)
			for _, f := range listenFlags {
				if _, has := h.flags[f]; has && f != "p" && f != "port" {
					if _, set := c.last(f); !set {
						t.Errorf("service %s: osmo %s listens by --%s; set it explicitly", s.Name, c.sub, f)
					}
				}
			}
		}
	})

	t.Run("third-party images are pinned", func(t *testing.T) {
		for _, s := range bare.Services {
			if isOsmo(s) {
				continue
			}
			_, tag, ok := strings.Cut(s.Image, ":")
			if !ok || tag == "latest" || !regexp.MustCompile(`^\d+\.\d+\.\d+`).MatchString(tag) {
				t.Errorf("service %s: image %q, want a pinned x.y.z tag", s.Name, s.Image)
			}
		}
		if j, _ := bare.GetService("jaeger"); !strings.HasPrefix(j.Image, "jaegertracing/jaeger:2.") {
			t.Errorf("jaeger image %q, want jaegertracing/jaeger:2.x", j.Image)
		}
		// The NATS the services share is the version osmo embeds and the
		// tests run (go.mod's).
		if n, _ := bare.GetService("nats"); n.Image != "nats:"+natsVersion(t)+"-alpine" {
			t.Errorf("nats image %q, want nats:%s-alpine (go.mod's nats-server; Alpine for the health check's wget)", n.Image, natsVersion(t))
		}
	})

	t.Run("listen ports are declared and published ports are local by default", func(t *testing.T) {
		for _, s := range bare.Services {
			declared := exposedPorts(t, s)
			for _, p := range s.Ports {
				if p.HostIP != "127.0.0.1" {
					t.Errorf("service %s publishes %d on %q; want 127.0.0.1 unless OSMO_PUBLISH_HOST says otherwise", s.Name, p.Target, p.HostIP)
				}
				if p.Published != strconv.Itoa(int(p.Target)) {
					t.Errorf("service %s publishes container port %d as %s; want the same number on the host", s.Name, p.Target, p.Published)
				}
			}
			var listen map[string]int
			switch {
			case isOsmo(s):
				var err error
				if listen, err = listenPorts(composeCmd(t, s)); err != nil {
					t.Fatalf("service %s: %v", s.Name, err)
				}
			case isNATS(s):
				opts := composeNATSOptions(t, bare, s)
				listen = map[string]int{"port": opts.Port, "http_port": opts.HTTPPort}
				if opts.HTTPSPort != 0 || opts.Cluster.Port != 0 || opts.LeafNode.Port != 0 || opts.Websocket.Port != 0 {
					t.Errorf("service %s listens on more than its client and monitoring ports: %+v", s.Name, opts)
				}
			default:
				continue
			}
			listening := map[int]bool{}
			for flag, port := range listen {
				listening[port] = true
				if !declared[port] {
					t.Errorf("service %s listens on %d (--%s) but does not expose it", s.Name, port, flag)
				}
			}
			for port := range declared {
				if !listening[port] {
					t.Errorf("service %s exposes %d but no listen flag names it", s.Name, port)
				}
			}
		}
	})

	t.Run("addresses name services and ports that exist", func(t *testing.T) {
		for _, s := range bare.Services {
			for _, ref := range hostPortRefs(s) {
				where, host, port := ref.where, ref.host, ref.port
				target := host
				if localHosts[host] {
					target = s.Name
				}
				other, err := bare.GetService(target)
				if err != nil {
					if host != "host.docker.internal" {
						t.Errorf("service %s, %s: host %q is no service", s.Name, where, host)
					}
					continue
				}
				n, _ := strconv.Atoi(port)
				if !exposedPorts(t, other)[n] {
					t.Errorf("service %s, %s: %s does not listen on %d", s.Name, where, target, n)
				}
			}
		}
		gw, _ := bare.GetService("gateway")
		c := composeCmd(t, gw)
		// The rollout service has replicas: dns:/// resolves them all.
		for flag, want := range map[string]string{"rollout-addr": "dns:///rollout:9090", "grader-addr": "grader:9091"} {
			if got, _ := c.last(flag); got != want {
				t.Errorf("gateway --%s=%q, want %q", flag, got, want)
			}
		}
		r, _ := bare.GetService("rollout")
		if got, _ := composeCmd(t, r).last("grader-addr"); got != "grader:9091" {
			t.Errorf("rollout --grader-addr=%q, want grader:9091", got)
		}
		for _, name := range []string{"rollout", "grader"} {
			s, _ := bare.GetService(name)
			if got, _ := composeCmd(t, s).last("nats"); got != "nats://nats:4222" {
				t.Errorf("%s --nats=%q, want nats://nats:4222", name, got)
			}
		}
		for _, pair := range [][2]string{{"rollout", "grpc-addr"}, {"grader", "grpc-addr"}} {
			s, _ := bare.GetService(pair[0])
			if got, _ := composeCmd(t, s).last(pair[1]); got != ":"+map[string]string{"rollout": "9090", "grader": "9091"}[pair[0]] {
				t.Errorf("%s --%s=%q does not match the address the others dial", pair[0], pair[1], got)
			}
		}
	})

	t.Run("every osmo service has an osmo health check on its own port", func(t *testing.T) {
		for _, s := range bare.Services {
			if !isOsmo(s) {
				continue
			}
			hc := s.HealthCheck
			if hc == nil || hc.Disable || len(hc.Test) < 4 {
				t.Errorf("service %s: no health check", s.Name)
				continue
			}
			if hc.Test[0] != "CMD" || hc.Test[1] != "/osmo" || hc.Test[2] != "health" {
				t.Errorf("service %s: health check %q, want [CMD /osmo health ADDR] (the image has no shell)", s.Name, hc.Test)
				continue
			}
			hcCmd, err := parseCmdline(hc.Test[2:], helpOf(t, "health"))
			if err != nil || len(hcCmd.args) != 1 {
				t.Errorf("service %s: health check %q: %v", s.Name, hc.Test, err)
				continue
			}
			listen, _ := listenPorts(composeCmd(t, s))
			m := hostPortRE.FindStringSubmatch(hcCmd.args[0])
			if m == nil || m[2] != "127.0.0.1" {
				t.Errorf("service %s: health check target %q, want 127.0.0.1:PORT or http://127.0.0.1:PORT/health", s.Name, hcCmd.args[0])
				continue
			}
			port, _ := strconv.Atoi(m[3])
			var main int
			for _, f := range []string{"addr", "grpc-addr", "p", "port"} {
				if p, ok := listen[f]; ok {
					main = p
				}
			}
			if port != main {
				t.Errorf("service %s: health check probes %d, the service serves on %d", s.Name, port, main)
			}
			if hc.Interval == nil || hc.Timeout == nil || hc.Retries == nil || *hc.Retries == 0 {
				t.Errorf("service %s: health check without interval, timeout or retries", s.Name)
			}
		}
	})

	t.Run("start order waits for healthy dependencies", func(t *testing.T) {
		for _, s := range bare.Services {
			if !isOsmo(s) {
				continue
			}
			c := composeCmd(t, s)
			for _, flag := range []string{"rollout-addr", "grader-addr", "nats"} {
				v, ok := c.last(flag)
				if !ok {
					continue
				}
				m := hostPortRE.FindStringSubmatch(v)
				if m == nil {
					t.Errorf("service %s --%s=%q names no host:port", s.Name, flag, v)
					continue
				}
				dep := m[2]
				d, ok := s.DependsOn[dep]
				if !ok || d.Condition != types.ServiceConditionHealthy {
					t.Errorf("service %s dials %s (--%s) but does not depend on it being healthy: %+v", s.Name, dep, flag, s.DependsOn)
				}
			}
			for dep, d := range s.DependsOn {
				other, err := bare.GetService(dep)
				if err != nil {
					t.Errorf("service %s depends on unknown %s", s.Name, dep)
					continue
				}
				if d.Condition == types.ServiceConditionHealthy && other.HealthCheck == nil {
					t.Errorf("service %s waits for %s to be healthy, which has no health check", s.Name, dep)
				}
			}
		}
	})

	t.Run("traces go to jaeger over OTLP", func(t *testing.T) {
		jaeger, _ := bare.GetService("jaeger")
		names := map[string]string{}
		for _, s := range bare.Services {
			if !isOsmo(s) {
				continue
			}
			env := func(k string) string {
				if v := s.Environment[k]; v != nil {
					return *v
				}
				return ""
			}
			endpoint, protocol, name := env("OTEL_EXPORTER_OTLP_ENDPOINT"), env("OTEL_EXPORTER_OTLP_PROTOCOL"), env("OTEL_SERVICE_NAME")
			wantPort := map[string]int{"grpc": 4317, "http/protobuf": 4318}[protocol]
			if endpoint != fmt.Sprintf("http://jaeger:%d", wantPort) {
				t.Errorf("service %s: OTEL_EXPORTER_OTLP_ENDPOINT=%q with OTEL_EXPORTER_OTLP_PROTOCOL=%q; want http://jaeger:4317 with grpc or :4318 with http/protobuf", s.Name, endpoint, protocol)
			}
			if !exposedPorts(t, jaeger)[wantPort] {
				t.Errorf("jaeger does not expose OTLP port %d", wantPort)
			}
			if !strings.HasPrefix(name, "osmo-") {
				t.Errorf("service %s: OTEL_SERVICE_NAME=%q, want osmo-<service>", s.Name, name)
			}
			if prev, dup := names[name]; dup {
				t.Errorf("services %s and %s share OTEL_SERVICE_NAME %q", prev, s.Name, name)
			}
			names[name] = s.Name
		}
	})

	t.Run("restarts, shutdown grace and a hardened container", func(t *testing.T) {
		for _, s := range bare.Services {
			if s.Restart != types.RestartPolicyUnlessStopped && s.Restart != types.RestartPolicyAlways && s.Restart != types.RestartPolicyOnFailure {
				t.Errorf("service %s: restart %q", s.Name, s.Restart)
			}
			if !isOsmo(s) {
				continue
			}
			// A rollout drains (the rollouts, then their callbacks: twice
			// --drain-timeout), then its servers stop gracefully (bounded by
			// server.ShutdownTimeout); SIGKILL must come after both.
			need := 2*drainTimeout(t, composeCmd(t, s)) + server.ShutdownTimeout
			if s.StopGracePeriod == nil || time.Duration(*s.StopGracePeriod) < need {
				t.Errorf("service %s: stop_grace_period %v, want at least %v (drain + graceful stop)", s.Name, s.StopGracePeriod, need)
			}
			if !s.ReadOnly || !slices.Contains(s.SecurityOpt, "no-new-privileges:true") {
				t.Errorf("service %s: want read_only and no-new-privileges", s.Name)
			}
		}
	})

	t.Run("the shared state is in NATS JetStream on a named volume", func(t *testing.T) {
		// No osmo service keeps state of its own: the rollout replicas and
		// the grader share NATS, so no --state (the embedded server's
		// files) and no volume.
		for _, s := range bare.Services {
			if !isOsmo(s) {
				continue
			}
			if v, ok := composeCmd(t, s).last("state"); ok {
				t.Errorf("service %s --state=%q: with --nats the state is in NATS", s.Name, v)
			}
			if len(s.Volumes) != 0 {
				t.Errorf("service %s mounts %+v; osmo services keep their state in NATS", s.Name, s.Volumes)
			}
		}
		r, _ := bare.GetService("rollout")
		if n := r.GetScale(); n < 2 {
			t.Errorf("rollout runs %d replica(s), want at least 2 sharing the state", n)
		}
		for _, name := range []string{"gateway", "grader", "nats"} {
			if s, _ := bare.GetService(name); s.GetScale() != 1 {
				t.Errorf("service %s runs %d replicas, want 1", name, s.GetScale())
			}
		}

		n, _ := bare.GetService("nats")
		opts := composeNATSOptions(t, bare, n)
		if !opts.JetStream {
			t.Error("nats runs without JetStream")
		}
		if opts.MaxPayload < natsstore.DefaultMaxPayload {
			t.Errorf("nats max_payload %d, want at least %d (a finished rollout's record)", opts.MaxPayload, natsstore.DefaultMaxPayload)
		}
		var vol string
		for _, v := range n.Volumes {
			if v.Type == types.VolumeTypeVolume && path.Clean(v.Target) == path.Clean(opts.StoreDir) {
				vol = v.Source
			}
		}
		if vol == "" {
			t.Fatalf("nats store_dir %q is no named volume: %+v", opts.StoreDir, n.Volumes)
		}
		if _, ok := bare.Volumes[vol]; !ok {
			t.Errorf("volume %s is not declared at the top level", vol)
		}
		if len(bare.Volumes) != 1 {
			t.Errorf("volumes %v, want only %s", bare.Volumes, vol)
		}
		if n.StopGracePeriod == nil || time.Duration(*n.StopGracePeriod) < 10*time.Second {
			t.Errorf("nats stop_grace_period %v, want time to flush its files", n.StopGracePeriod)
		}
		if !n.ReadOnly || !slices.Contains(n.SecurityOpt, "no-new-privileges:true") {
			t.Error("nats: want read_only and no-new-privileges")
		}

		// Its health check asks the monitoring port whether JetStream is up.
		hc := n.HealthCheck
		if hc == nil || len(hc.Test) < 3 || hc.Test[0] != "CMD" {
			t.Fatalf("nats health check %+v, want [CMD wget ... URL]", hc)
		}
		u, err := url.Parse(hc.Test[len(hc.Test)-1])
		if err != nil || u.Hostname() != "127.0.0.1" || u.Port() != strconv.Itoa(opts.HTTPPort) || u.Path != "/healthz" || u.Query().Get("js-enabled-only") != "true" {
			t.Errorf("nats health check %q, want http://127.0.0.1:%d/healthz?js-enabled-only=true", hc.Test, opts.HTTPPort)
		}
	})

	t.Run("keys come from an optional .env", func(t *testing.T) {
		for _, name := range []string{"gateway", "rollout", "grader", "llmproxy"} {
			s, _ := bare.GetService(name)
			if len(s.EnvFiles) != 1 || filepath.Base(s.EnvFiles[0].Path) != ".env" || bool(s.EnvFiles[0].Required) {
				t.Errorf("service %s: env_file %+v, want .env with required: false", name, s.EnvFiles)
			}
		}
		// Without a .env (the project above loaded without one) no key is
		// set; with the example copied to .env, the rollout gets its key.
		r, _ := bare.GetService("rollout")
		if v := r.Environment["OSMO_API_KEY"]; v != nil && *v != "" {
			t.Errorf("without .env the rollout has OSMO_API_KEY=%q", *v)
		}
		// The gateway checks the key and forwards it; the services check it
		// again (the grader's /v1/grade included). Each listens beyond
		// loopback, where osmo refuses to start without a key.
		for _, name := range []string{"gateway", "rollout", "grader"} {
			r, _ = withEnv.GetService(name)
			if v := r.Environment["OSMO_API_KEY"]; v == nil || *v == "" {
				t.Errorf("with .env from .env.example the %s has no OSMO_API_KEY", name)
			}
		}
		for _, name := range []string{"mockllm"} {
			s, _ := withEnv.GetService(name)
			if _, leaked := s.Environment["OSMO_API_KEY"]; leaked {
				t.Errorf("service %s receives OSMO_API_KEY, which it does not need", name)
			}
		}
	})

	t.Run(".env.example documents only settings something reads", func(t *testing.T) {
		compose, err := os.ReadFile(filepath.Join(repoRoot, "docker-compose.yml"))
		if err != nil {
			t.Fatal(err)
		}
		ex, err := os.ReadFile(filepath.Join(repoRoot, ".env.example"))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(ex), "\n") {
			key, _, ok := strings.Cut(strings.TrimSpace(strings.TrimPrefix(line, "# ")), "=")
			if !ok || !regexp.MustCompile(`^[A-Z][A-Z0-9_]+$`).MatchString(key) {
				continue
			}
			switch {
			case strings.Contains(string(compose), "${"+key):
			case strings.HasPrefix(key, "OSMOSIS_ROLLOUT_"), strings.HasPrefix(key, "OTEL_"):
			case key == "OSMO_API_KEY" || key == "OSMO_UPSTREAM_API_KEY":
				// Read by osmo itself; `osmo <sub> -h` names them.
				out := helpText(t, map[string]string{"OSMO_API_KEY": "rollout", "OSMO_UPSTREAM_API_KEY": "llmproxy"}[key])
				if !strings.Contains(out, "env "+key) {
					t.Errorf(".env.example sets %s, which osmo does not read", key)
				}
			default:
				t.Errorf(".env.example sets %s, which neither docker-compose.yml nor osmo reads", key)
			}
		}
	})
}
