// Package cli is the osmo command line: one binary whose subcommands run the
// whole stack in one process (serve), each service alone (rollout, grader,
// gateway, llmproxy), the policy double (mockllm), and the user-facing tools
// (demo, bench, health).
//
// Build your own binary with your workflows and graders by calling Main with
// options:
//
//	func main() { cli.Main(cli.WithAgentLoop(myLoop{}, "contains")) }
package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/osmo-rl/osmo/internal/telemetry"
)

// Main runs the command line with os.Args and exits: 0 on success, 2 on a
// usage error (bad input, found before anything ran), 130 when an eval was
// interrupted, 1 on any other failure.
func Main(opts ...Option) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := Run(ctx, os.Args[1:], os.Stdout, os.Stderr, opts...)
	stop()
	if err == nil || errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	// An exit code the command chose wins over the kind of error it wraps.
	code := 1
	ee, chosen := errors.AsType[exitError](err)
	switch {
	case chosen:
		code = ee.code
	case errors.As(err, new(usageError)):
		code = 2
	}
	if !ee.quiet {
		fmt.Fprintln(os.Stderr, "osmo:", err)
	}
	os.Exit(code)
}

// usageError is a command line the program cannot act on.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// env bundles what commands read from the outside world.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string
	reg            *registry
	// flagSets, if set, sees every FlagSet a command makes (tests walk them).
	flagSets func(*flag.FlagSet)
}

type command struct {
	summary string
	run     func(ctx context.Context, e *env, args []string) error
}

func commands() map[string]command {
	return map[string]command{
		"serve":    {"run the whole stack in one process (rollout, grader, gateway, LLM proxy)", runServe},
		"rollout":  {"run the rollout service alone (gRPC)", runRollout},
		"grader":   {"run the grader service alone (gRPC)", runGrader},
		"gateway":  {"run the REST/Connect gateway alone", runGateway},
		"llmproxy": {"run the LLM proxy alone in front of one upstream", runLLMProxy},
		"mockllm":  {"run the deterministic OpenAI-compatible policy double", runMockLLM},
		"demo":     {"run calculator rollouts end to end against the built-in mock policy", runDemo},
		"eval":     {"evaluate a workflow over a dataset against a model: eval run FILE.toml", runEval},
		"test":     {"run dataset rows through a workflow and print each conversation and reward (-i: step through turns)", runTest},
		"bench":    {"measure the LLM proxy against a plain reverse proxy, then rollouts end to end ('bench rollouts': those alone; 'bench plane': the policy plane's engines)", runBench},
		"validate": {"check the registered workflows (or the one named): unique names, tool schemas, config", runValidate},
		"health":   {"check a service's health (gRPC address or http URL); exit 1 if unhealthy", runHealth},
		"version":  {"print the version", runVersion},
	}
}

// Run executes one command line. It is Main without the process exit, for tests.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer, opts ...Option) error {
	e := &env{stdin: os.Stdin, stdout: stdout, stderr: stderr, getenv: os.Getenv, reg: newRegistry(opts)}
	cmds := commands()
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		printUsage(stdout, cmds)
		if len(args) == 0 {
			return usagef("no command given")
		}
		return nil
	}
	cmd, ok := cmds[args[0]]
	if !ok {
		printUsage(stderr, cmds)
		return usagef("unknown command %q", args[0])
	}
	return cmd.run(ctx, e, args[1:])
}

func printUsage(w io.Writer, cmds map[string]command) {
	fmt.Fprintln(w, "Usage: osmo <command> [flags]\n\nCommands:")
	for _, n := range slices.Sorted(maps.Keys(cmds)) {
		fmt.Fprintf(w, "  %-9s %s\n", n, cmds[n].summary)
	}
	fmt.Fprintln(w, "\nRun 'osmo <command> -h' for a command's flags.")
}

// flagSet returns a FlagSet that reports errors instead of exiting.
func flagSet(e *env, name string) *flag.FlagSet {
	fs := flag.NewFlagSet("osmo "+name, flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	if e.flagSets != nil {
		e.flagSets(fs)
	}
	return fs
}

// parse parses args and turns flag errors into usage errors.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err.Error()}
	}
	return nil
}

// logFlags are the logging flags every long-running command takes.
type logFlags struct {
	level  string
	format string
}

func (l *logFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&l.level, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&l.format, "log-format", "json", "log format: json or text")
}

func (l *logFlags) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(l.level)); err != nil {
		return nil, usagef("--log-level: %v", err)
	}
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: readableDurations}
	// Records logged with a traced context carry trace_id and span_id.
	switch strings.ToLower(l.format) {
	case "json":
		return slog.New(telemetry.LogHandler(slog.NewJSONHandler(w, opts))), nil
	case "text":
		return slog.New(telemetry.LogHandler(slog.NewTextHandler(w, opts))), nil
	}
	return nil, usagef("--log-format: want json or text, got %q", l.format)
}

// readableDurations writes time.Duration attributes as Go duration strings
// ("911.209085ms", "1m30s") in both formats; the JSON handler would write
// integer nanoseconds.
func readableDurations(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}

// Version is set at build time with -ldflags "-X github.com/osmo-rl/osmo/cli.Version=...".
var Version = "dev"

func runVersion(_ context.Context, e *env, _ []string) error {
	fmt.Fprintln(e.stdout, "osmo", Version)
	return nil
}

// DefaultGCPercent is the GOGC of osmo processes whose environment sets
// none: Go's own default, named so that `osmo bench` can state it
// (docs/deploy.md, "Memory and the garbage collector", says why osmo
// keeps it).
const DefaultGCPercent = 100

// Service names on spans. `osmo serve` gives each component its own, so a
// trace shows the same services whether the stack runs in one process or
// split; a split command's own name can be changed with OTEL_SERVICE_NAME.
const (
	serviceGateway  = "osmo-gateway"
	serviceRollout  = "osmo-rollout"
	serviceLLMProxy = "osmo-llmproxy"
	serviceGrader   = "osmo-grader"
)

// start builds a command's logger, and its tracing for service from the
// process environment, which the OpenTelemetry SDK reads; failed exports
// are logged. The returned func flushes the last spans (within 10s): call
// it once everything that makes spans has stopped.
func (l *logFlags) start(ctx context.Context, e *env, service string) (*slog.Logger, *telemetry.Telemetry, func(), error) {
	log, err := l.logger(e.stderr)
	if err != nil {
		return nil, nil, nil, err
	}
	tel, err := telemetry.Setup(ctx, service)
	if err != nil {
		return nil, nil, nil, usageError{err.Error()}
	}
	tel.LogErrorsTo(log)
	if tel.Enabled() {
		log.Info("tracing on", "service", tel.ServiceName(), "exporter", cmp.Or(e.getenv("OTEL_TRACES_EXPORTER"), "otlp"),
			"endpoint", cmp.Or(e.getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), e.getenv("OTEL_EXPORTER_OTLP_ENDPOINT")),
			"capture_content", tel.CaptureContent())
	}
	return log, tel, func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := tel.Shutdown(sctx); err != nil {
			log.Warn("tracing: the last spans were not all exported", "error", err)
		}
	}, nil
}

// tracing is what the components of a command trace with; the providers
// are nil when tracing is off, which the components read as "do not trace".
type tracing struct {
	gateway, rollout, proxy, grader trace.TracerProvider
	prop                            propagation.TextMapPropagator
	content                         bool
}

// stackTracing gives every component of `osmo serve` its own service.
func stackTracing(tel *telemetry.Telemetry) tracing {
	return tracing{
		gateway: tel.ServiceTracerProvider(serviceGateway),
		rollout: tel.ServiceTracerProvider(serviceRollout),
		proxy:   tel.ServiceTracerProvider(serviceLLMProxy),
		grader:  tel.ServiceTracerProvider(serviceGrader),
		prop:    tel.Propagator(),
		content: tel.CaptureContent(),
	}
}
