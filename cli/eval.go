package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sync/errgroup"
	"golang.org/x/term"

	"github.com/osmo-rl/osmo/internal/eval"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/server"
)

// exitInterrupted is the exit code of a run stopped by Ctrl-C (128 +
// SIGINT), as shells report it.
const exitInterrupted = 130

// exitError ends the process with its code.
type exitError struct {
	code int
	err  error
	// quiet: the error was already reported (as JSON): Main only exits.
	quiet bool
}

func (e exitError) Error() string { return e.err.Error() }
func (e exitError) Unwrap() error { return e.err }

func runEval(ctx context.Context, e *env, args []string) error {
	switch {
	case len(args) > 0 && args[0] == "run":
		return runEvalRun(ctx, e, args[1:])
	case len(args) > 0 && (args[0] == "-h" || args[0] == "--help"):
		return runEvalRun(ctx, e, args) // run is the only subcommand: its flags
	}
	return usagef("usage: osmo eval run FILE.toml [flags]")
}

// backendFlags say where an eval's model and rollout server are.
type backendFlags struct {
	mock      bool
	server    string
	serverKey string
	lf        logFlags
}

func (b *backendFlags) register(fs *flag.FlagSet, e *env) {
	fs.BoolVar(&b.mock, "mock", false, "route the model's calls to the built-in mock policy: works offline, no key")
	fs.StringVar(&b.server, "server", "", "an Osmosis-compatible rollout server to drive (`URL`); default: osmo's own, started in this process")
	secretVar(fs, &b.serverKey, "server-key", e.getenv("OSMO_API_KEY"), "bearer `TOKEN` for --server (env OSMO_API_KEY)")
	b.lf.register(fs)
	// Logs are for trouble: the run's own output is the progress and the
	// summary.
	b.lf.level = "warn"
	fs.Lookup("log-level").DefValue = b.lf.level
}

// backendSpec is what an eval's backends run.
type backendSpec struct {
	workflow, entrypoint, grader string
	maxConcurrent                int
	// env and secrets reach the rollout's own process: an Osmosis
	// rollout server's, or an exec agent's.
	env, secrets map[string]string
	// osmosisRollout starts rolloutDir's server (its entrypoint) in
	// place of osmo's own rollout server; its output goes to
	// runDir/logs.txt, redacted.
	osmosisRollout bool
	// rows has osmo's own rollout server ask the policy for tokens (the
	// config's [rows] enabled).
	rows               bool
	rolloutDir, runDir string
	redact             *eval.Redactor
	verbose            bool
	// engines are [llm] engines: osmo's own rollout server routes every
	// call over them.
	engines []string
}

// start brings up what the run needs and points plan at it (its
// PolicyURL and UpstreamKey are the model's unless --mock): the mock
// policy with --mock, and a rollout server: the one --server names, the
// workspace's Osmosis rollout server, or osmo's own (workflow and grader
// as named) in this process. stop stops them; tracing says whether this
// process exports traces.
func (b *backendFlags) start(ctx context.Context, e *env, s backendSpec, plan *eval.Plan) (stop func(), tracing bool, err error) {
	log, tel, stopTelemetry, err := b.lf.start(ctx, e, serviceRollout)
	if err != nil {
		return nil, false, err
	}
	plan.Logger, plan.ServerURL, plan.ServerKey = log, b.server, b.serverKey
	// The servers outlive the run's context: a Ctrl-C still has the
	// in-flight rollouts cancelled on them, and their callbacks received.
	srvCtx, stopServers := context.WithCancel(context.WithoutCancel(ctx))
	var servers errgroup.Group
	stopOsmosis := func() {}
	stop = func() {
		stopOsmosis()
		stopServers()
		_ = servers.Wait()
		stopTelemetry()
	}
	fail := func(err error) (func(), bool, error) { stop(); return nil, false, err }

	if b.mock {
		m, err := mockllm.New(mockllm.Options{Logger: log})
		if err != nil {
			return fail(err)
		}
		policy, err := server.NewHTTP("127.0.0.1:0", m)
		if err != nil {
			return fail(err)
		}
		servers.Go(func() error { return policy.Serve(srvCtx) })
		plan.PolicyURL, plan.UpstreamKey = policy.URL()+"/v1", ""
	}
	if plan.PolicyURL == "" {
		return fail(usagef("no model endpoint: set [llm] base_url in the TOML or OPENAI_BASE_URL, or use --mock"))
	}
	if len(s.engines) > 0 && (b.server != "" || s.osmosisRollout) {
		fmt.Fprintln(e.stderr, "osmo eval: [llm] engines are used by osmo's own rollout server only; this run's calls go to the model endpoint")
	}
	switch {
	case b.server != "":
		return stop, tel.Enabled(), nil
	case s.osmosisRollout:
		url, stopSrv, err := startOsmosisServer(srvCtx, e, s, log)
		if err != nil {
			return fail(err)
		}
		stopOsmosis, plan.ServerURL, plan.ServerKey = stopSrv, url, ""
		return stop, tel.Enabled(), nil
	}
	sc, err := localStackConfig(e, s.workflow)
	if err != nil {
		return fail(err)
	}
	sc.rollout.grader = s.grader
	sc.rollout.policy.urls = s.engines
	sc.rollout.policy.ownsRouting = len(s.engines) > 0
	if s.workflow == execWorkflow {
		sc.rollout.exec = s.entrypoint
		// The agent's model calls go through osmo's proxy: the contract's
		// OPENAI_* variables (the model's key among them) are not the
		// config's to set.
		for _, m := range []map[string]string{s.env, s.secrets} {
			for k, v := range m {
				if u := strings.ToUpper(k); !strings.HasPrefix(u, "OPENAI_") && !strings.HasPrefix(u, "OSMOSIS_") && u != "OSMO_API_KEY" {
					sc.rollout.execEnv = append(sc.rollout.execEnv, k+"="+v)
				}
			}
		}
		slices.Sort(sc.rollout.execEnv)
	}
	sc.rollout.rows = s.rows
	sc.rollout.maxConcurrent = max(sc.rollout.maxConcurrent, s.maxConcurrent)
	sc.rollout.maxQueued = sc.rollout.maxConcurrent
	sc.tracing = stackTracing(tel)
	st, err := newStack(ctx, e, log, sc)
	if err != nil {
		return fail(err)
	}
	servers.Go(func() error { return st.run(srvCtx) })
	plan.ServerURL = st.http.URL()
	return stop, tel.Enabled(), nil
}

// evalRunFlags are `osmo eval run`'s flags beyond the backend's: the
// Osmosis SDK's, and osmo's own.
type evalRunFlags struct {
	name, output, datasetFile, secretsFile string
	rows, jaeger                           string
	limit, n, batch, maxInFlight           int
	fresh, retryFailed, noLive, yes        bool
	verbose, json                          bool
}

func (f *evalRunFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.name, "name", "", "the run's `NAME`: a new run, or the one to resume (default: the last run of this config with the same inputs, else a new STEM-TIME-DIGEST)")
	fs.StringVar(&f.output, "output", "", "`ROOT` the runs are written under, one directory per run (default: WORKSPACE/.osmosis/evals, or .osmosis/evals beside the TOML outside a workspace)")
	fs.StringVar(&f.output, "o", "", "same as --output")
	fs.StringVar(&f.datasetFile, "dataset-file", "", "the dataset `FILE` (.jsonl, .csv or .parquet), in place of the config's dataset")
	fs.StringVar(&f.secretsFile, "secrets-file", "", "dotenv `FILE` (NAME=value lines; - for stdin) holding the values of [secrets] required; the environment is read for the rest")
	// These four are laid over the config only when given.
	fs.IntVar(&f.limit, "limit", 0, "run the first `N` rows only, 0 for all (default: the config's limit)")
	fs.IntVar(&f.n, "n", 0, "`N` runs of each row (default: the config's n, else 1)")
	fs.IntVar(&f.batch, "batch-size", 0, "at most `N` rollouts in flight (default: the config's batch_size, else 8)")
	fs.IntVar(&f.maxInFlight, "max-in-flight", 0, "same as --batch-size (the Osmosis CLI's name)")
	fs.StringVar(&f.jaeger, "jaeger", "", "Jaeger UI `URL` the report links each rollout's trace to (default http://localhost:16686 when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
	fs.StringVar(&f.rows, "rows", "", "run only these rows (0-based offsets in the file), such as 3,7,10-20; overrides the limit")
	fs.BoolVar(&f.fresh, "fresh", false, "start over: the run's earlier results are archived beside it (NAME.archive-TIME), never deleted")
	fs.BoolVar(&f.retryFailed, "retry-failed", false, "run the attempts that failed or were skipped again (those that succeeded are kept)")
	fs.BoolVar(&f.noLive, "no-progress-bar", false, "print a progress line every few seconds even on a terminal")
	fs.BoolVar(&f.yes, "y", false, "accepted for the Osmosis CLI's sake: osmo never asks before running")
	fs.BoolVar(&f.yes, "yes", false, "same as -y")
	fs.BoolVar(&f.json, "json", false, "print the result as one JSON object on stdout, and nothing else there")
	fs.BoolVar(&f.verbose, "verbose", false, "echo the rollout server's output (the run's logs.txt) on stderr")
}

func runEvalRun(ctx context.Context, e *env, args []string) (err error) {
	fs := flagSet(e, "eval run")
	var (
		f  evalRunFlags
		bf backendFlags
	)
	f.register(fs)
	bf.register(fs, e)
	// The file may come before the flags, as the Osmosis CLI takes it.
	var file string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		file, args = args[0], args[1:]
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if file == "" && fs.NArg() > 0 {
		file = fs.Arg(0)
	}
	// With --json, a run that ends before its result is printed (a bad
	// config, a missing secret, a server that does not start) says why in
	// the Osmosis CLI's error envelope, on stderr.
	printed := false
	defer func() {
		if err != nil && f.json && !printed {
			err = jsonError(e.stderr, "eval run", err)
		}
	}()
	if file == "" {
		return usagef("usage: osmo eval run FILE.toml [flags]")
	}
	cfg, err := eval.LoadConfig(file)
	if err != nil {
		return usageError{err.Error()}
	}
	ev := &cfg.Evaluation
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, o := range []struct {
		name   string
		v, min int
		dst    *int
	}{{"n", f.n, 1, &ev.N}, {"batch-size", f.batch, 1, &ev.BatchSize}, {"max-in-flight", f.maxInFlight, 1, &ev.BatchSize}, {"limit", f.limit, 0, &ev.Limit}} {
		if !given[o.name] {
			continue
		}
		if o.v < o.min {
			return usagef("--%s: must be at least %d, got %d", o.name, o.min, o.v)
		}
		*o.dst = o.v
	}
	layout, err := cfg.Resolve(f.datasetFile, f.output)
	if err != nil {
		return usageError{err.Error()}
	}
	osmosisRollout := layout.RolloutDir != "" && bf.server == ""
	if !osmosisRollout && bf.server == "" {
		if err := checkWorkflow(e, cfg.Experiment.Rollout); err != nil {
			if layout.Workspace != "" {
				return usagef("%v (and the workspace %s has no rollouts/%s/)", err, layout.Workspace, cfg.Experiment.Rollout)
			}
			return err
		}
	}
	dataset, err := eval.ReadDataset(layout.DatasetPath)
	if err != nil {
		return usageError{err.Error()}
	}
	selected, err := dataset.Select(f.rows, ev.Offset, ev.Limit)
	if err != nil {
		return usageError{err.Error()}
	}

	// The model's key may be one of the secrets; with the mock policy it
	// is not needed.
	var optional []string
	if bf.mock {
		optional = []string{cfg.LLM.APIKeyEnv}
	}
	secrets, err := eval.ResolveSecrets(cfg.Secrets, f.secretsFile, e.stdin, e.getenv, optional)
	if err != nil {
		return usageError{err.Error()}
	}
	redact := eval.NewRedactor(slices.Collect(maps.Values(secrets))...)
	inputs, err := evalInputs(e, cfg, layout, dataset, selected)
	if err != nil {
		return err
	}
	rd, err := eval.OpenRun(eval.OpenRunOptions{
		Root: layout.OutputRoot, Name: f.name, Stem: cfg.Stem(), Inputs: inputs,
		Provenance: evalProvenance(cfg), Fresh: f.fresh || cfg.Fresh,
	})
	if err != nil {
		return usageError{err.Error()}
	}
	defer rd.Close()
	if rd.Archived != "" {
		fmt.Fprintf(e.stderr, "osmo eval: archived the earlier results to %s\n", rd.Archived)
	}
	if len(cfg.Advanced) > 0 {
		fmt.Fprintf(e.stderr, "osmo eval: [advanced] keys are recorded but not used by a local run: %s\n", strings.Join(slices.Sorted(maps.Keys(cfg.Advanced)), ", "))
	}
	if len(cfg.Env) > 0 && !osmosisRollout && cfg.Experiment.Rollout != execWorkflow && bf.server == "" {
		fmt.Fprintf(e.stderr, "osmo eval: [env] reaches a rollout's own process; workflow %q runs inside osmo and does not see it\n", cfg.Experiment.Rollout)
	}

	plan := eval.Plan{
		Rows: selected, N: ev.N, BatchSize: ev.BatchSize,
		AgentTimeoutS: *ev.AgentTimeoutS, GraderTimeoutS: *ev.GraderTimeoutS, PassThreshold: *ev.PassThreshold,
		Output: rd.Path, RetryFailed: f.retryFailed || cfg.RetryFailed,
		PolicyURL: cmp.Or(cfg.LLM.BaseURL, e.getenv("OPENAI_BASE_URL"), firstHTTP(cfg.LLM.Engines)), Model: cfg.Model(),
		UpstreamKey: cmp.Or(secrets[cfg.LLM.APIKeyEnv], e.getenv(cfg.LLM.APIKeyEnv)),
		Title:       rd.Name, Progress: e.stderr, Live: !f.noLive && isTerminal(e.stderr), Redact: redact,
		RunID: rd.Manifest.LocalRunID, RunName: rd.Name, DatasetName: cfg.Experiment.Dataset, ModelPath: cfg.Experiment.ModelPath,
		RolloutName: cfg.Experiment.Rollout, TotalDatasetRows: dataset.Len(),
		TrainingRows: cfg.Rows.On(), RowsMerge: cfg.Rows.Merge, RowsVocabSize: cfg.Rows.VocabSize,
	}
	stop, tracing, err := bf.start(ctx, e, backendSpec{
		workflow: cfg.Experiment.Rollout, entrypoint: cmp.Or(layout.Entrypoint, cfg.Experiment.Entrypoint), grader: cfg.Experiment.Grader,
		maxConcurrent: ev.BatchSize, env: cfg.Env, secrets: secrets, osmosisRollout: osmosisRollout, rows: cfg.Rows.On(), rolloutDir: layout.RolloutDir,
		runDir: rd.Path, redact: redact, verbose: f.verbose, engines: cfg.LLM.Engines,
	}, &plan)
	if err != nil {
		return err
	}
	defer stop()
	// The report links traces to the flag's Jaeger, else the local one
	// when this process exports traces.
	plan.JaegerURL = f.jaeger
	if f.jaeger == "" && tracing {
		plan.JaegerURL = "http://localhost:16686"
	}

	what := cfg.Experiment.Rollout
	if osmosisRollout {
		what = "rollouts/" + what + "/" + layout.Entrypoint
	}
	verb := "new run"
	if !rd.Created {
		verb = "resuming run"
	}
	fmt.Fprintf(e.stderr, "osmo eval: %s %s: %d rows × %d runs of %s against %s (%s), %d at a time; results in %s\n",
		verb, rd.Name, len(selected), ev.N, what, cfg.Model(), plan.PolicyURL, ev.BatchSize, rd.Path)
	rep, err := eval.Run(ctx, plan)
	printed = rep != nil
	return reportEnd(e, rep, err, rd, f.json)
}

// evalInputs is what the run pins in its manifest.
func evalInputs(e *env, cfg *eval.Config, l *eval.Layout, d *eval.Dataset, rows []eval.Row) (eval.Inputs, error) {
	sum, err := eval.FileSHA256(d.Path)
	if err != nil {
		return eval.Inputs{}, usagef("dataset: %v", err)
	}
	src := make([]int, len(rows))
	for i, r := range rows {
		src[i] = r.SourceIndex
	}
	ev := cfg.Evaluation
	in := eval.Inputs{
		ModelPath:   cfg.Experiment.ModelPath,
		Dataset:     eval.DatasetInput{SHA256: sum, SelectedSourceRows: eval.FormatRows(src)},
		N:           ev.N,
		Rollout:     eval.RolloutInput{Name: cfg.Experiment.Rollout, Entrypoint: cmp.Or(l.Entrypoint, cfg.Experiment.Entrypoint)},
		Env:         cfg.Env,
		SecretNames: slices.Sorted(slices.Values(cfg.Secrets)),
		Timeouts:    eval.TimeoutsInput{AgentTimeoutSec: ev.AgentTimeoutS, GraderTimeoutSec: ev.GraderTimeoutS},
		Versions:    eval.Versions(),
		Grader:      cfg.Experiment.Grader,
	}
	if in.Env == nil {
		in.Env = map[string]string{}
	}
	if in.SecretNames == nil {
		in.SecretNames = []string{}
	}
	if l.RolloutDir != "" {
		exclude := ""
		if strings.HasPrefix(l.OutputRoot, l.RolloutDir+string(filepath.Separator)) {
			exclude = l.OutputRoot
		}
		if in.Rollout.SourceDigest, err = eval.SourceDigest(l.RolloutDir, exclude); err != nil {
			return in, usagef("rollouts/%s: %v", cfg.Experiment.Rollout, err)
		}
		return in, nil
	}
	// A workflow of this binary is this binary's code; an exec agent's
	// command is named by its command line (its files are the user's to
	// pin, as osmo cannot know which they are).
	self, err := os.Executable()
	if err == nil {
		in.Rollout.SourceDigest, err = eval.FileSHA256(self)
	}
	if err != nil {
		return in, fmt.Errorf("eval: the digest of this executable: %w", err)
	}
	return in, nil
}

// evalProvenance is what the manifest records beside the inputs: never
// compared, never a reason to refuse a resume.
func evalProvenance(cfg *eval.Config) map[string]any {
	p := map[string]any{"runner": "osmo", "config": cfg.Path, "config_generation": cfg.Generation}
	if v := cfg.Experiment.Branch; v != "" {
		p["config_branch"] = v
	}
	if v := cfg.Experiment.CommitSHA; v != "" {
		p["config_commit_sha"] = v
	}
	if len(cfg.Advanced) > 0 {
		p["advanced"] = cfg.Advanced
	}
	return p
}

// reportEnd prints how a run ended (with asJSON, as one JSON object) and
// picks the exit: 2 when a check before it refused to run, 130 when
// interrupted, 1 when it failed or attempts remain pending. rd is nil when
// the run keeps nothing.
func reportEnd(e *env, rep *eval.Report, err error, rd *eval.RunDir, asJSON bool) error {
	var pe *eval.PreflightError
	if errors.As(err, &pe) {
		return usageError{"the check before running failed: " + pe.Error()}
	}
	if rep != nil && asJSON {
		if jerr := writeEvalJSON(e.stdout, rep, err, rd); jerr != nil {
			return errors.Join(err, jerr)
		}
	} else if rep != nil {
		if rep.Ran == 0 && err == nil {
			fmt.Fprintln(e.stdout, "every sample already has a result: nothing ran (--fresh starts over, --retry-failed reruns failed and skipped ones)")
		}
		fmt.Fprintln(e.stdout, "summary:")
		_ = rep.Summary.WriteTable(e.stdout)
		if rd != nil {
			fmt.Fprintln(e.stdout)
			for _, f := range []string{eval.ResultsFile, eval.SummaryFile, eval.ReportFile, eval.MetricsFile} {
				fmt.Fprintln(e.stdout, filepath.Join(rd.Path, f))
			}
			if rep.Summary.Rows != nil {
				for _, f := range []string{eval.RowsFile, eval.RowsParquetFile} {
					fmt.Fprintln(e.stdout, filepath.Join(rd.Path, f))
				}
			}
		}
	}
	switch {
	case errors.Is(err, eval.ErrInterrupted):
		return exitError{code: exitInterrupted, err: errors.New("interrupted: what finished is kept; run the same command again to run the rest")}
	case err == nil && rep != nil && rep.Pending > 0:
		return exitError{code: 1, err: fmt.Errorf("%d of %d attempts have no result: run the same command again to run them", rep.Pending, rep.Total)}
	}
	return err
}

// jsonError writes err as the Osmosis CLI's JSON error envelope
// ({"schema_version", "command", "cli_version", "error": {"code",
// "message", "details"}}) and returns it as an exit that prints nothing
// more: code VALIDATION for what was refused before anything ran (exit 2),
// INTERNAL otherwise (exit 1, or the exit err carries).
func jsonError(w io.Writer, command string, err error) error {
	code, exit := "INTERNAL", 1
	var ee exitError
	switch {
	case errors.As(err, new(usageError)):
		code, exit = "VALIDATION", 2
	case errors.As(err, &ee):
		exit = ee.code
	}
	b, merr := json.Marshal(map[string]any{
		"schema_version": 1,
		"command":        command,
		"cli_version":    Version,
		"error":          map[string]any{"code": code, "message": err.Error(), "details": map[string]any{}},
	})
	if merr != nil {
		return err
	}
	fmt.Fprintf(w, "%s\n", b)
	return exitError{code: exit, err: err, quiet: true}
}

// writeEvalJSON prints the run's result as the Osmosis CLI's --json prints
// `osmosis eval run`'s: an operation envelope whose resource holds the
// run, its counts, the platform's summary (metrics, as metrics.json has
// it) and the attempts that did not succeed; osmo adds its own summary
// (summary.json's) and the run's files.
func writeEvalJSON(w io.Writer, rep *eval.Report, runErr error, rd *eval.RunDir) error {
	failedRows := []map[string]any{}
	for _, r := range rep.Results {
		if r.Status == eval.StatusSuccess {
			continue
		}
		fr := map[string]any{"row_index": r.RowIndex, "source_row_index": r.SourceRowIndex, "run_index": r.RunIndex, "rollout_id": r.RolloutID, "error_type": nil}
		if r.Status == eval.StatusFailed {
			fr["error_type"] = cmp.Or(r.ErrCategory, "unknown")
		}
		if rd != nil {
			fr["rollout_dir"] = filepath.Join(rd.Path, eval.TrialsDir, r.RolloutID)
		}
		failedRows = append(failedRows, fr)
	}
	cancelled := errors.Is(runErr, eval.ErrInterrupted)
	incomplete := cancelled || rep.Pending > 0 || runErr != nil
	resource := map[string]any{
		"total_work_items": rep.Total,
		"dispatched":       rep.Ran,
		"succeeded":        rep.Summary.TotalSamples - rep.Summary.Failed - rep.Summary.Skipped,
		"failed":           rep.Summary.Failed,
		"skipped":          rep.Summary.Skipped,
		"resumed":          rep.Resumed,
		"pending":          rep.Pending,
		"cancelled":        cancelled,
		"duration_ms":      rep.Summary.WallS * 1000,
		"metrics":          rep.Summary.PlatformSummary,
		"summary":          rep.Summary,
		"failed_rows":      failedRows,
	}
	status, message := "success", "Evaluation run finished"
	if incomplete {
		status, message = "partial", "Evaluation run interrupted"
	}
	if rd != nil {
		resource["run_name"] = rd.Name
		resource["local_run_id"] = rd.Manifest.LocalRunID
		resource["output_path"] = rd.Path
		files := map[string]string{}
		for k, f := range map[string]string{"results": eval.ResultsFile, "summary": eval.SummaryFile, "report": eval.ReportFile, "events": eval.EventsFile, "index": eval.IndexFile, "metrics": eval.MetricsFile, "progress": eval.ProgressFile} {
			files[k] = filepath.Join(rd.Path, f)
		}
		if rep.Summary.Rows != nil {
			files["rows"], files["rows_parquet"] = filepath.Join(rd.Path, eval.RowsFile), filepath.Join(rd.Path, eval.RowsParquetFile)
		}
		resource["files"] = files
		message += ": " + rd.Path
	}
	if runErr != nil && !cancelled {
		resource["error"] = runErr.Error()
	}
	b, err := json.Marshal(map[string]any{
		"schema_version": 1,
		"status":         status,
		"operation":      "eval.run",
		"resource":       resource,
		"message":        message,
	})
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "%s\n", b)
	return err
}

// checkWorkflow refuses a workflow this binary does not have, before
// anything starts.
func checkWorkflow(e *env, name string) error {
	if name == execWorkflow {
		return nil
	}
	if _, err := e.reg.lookup(name); err != nil {
		return usageError{"[experiment] rollout: " + err.Error()}
	}
	return nil
}

// isTerminal reports whether w is a terminal (a live progress bar is drawn
// there).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// firstHTTP is the first engine named by URL rather than by DNS name.
func firstHTTP(engines []string) string {
	for _, u := range engines {
		if !strings.HasPrefix(u, "dns://") {
			return u
		}
	}
	return ""
}
