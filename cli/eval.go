package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
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
	fs.StringVar(&b.serverKey, "server-key", e.getenv("OSMO_API_KEY"), "bearer for --server (env OSMO_API_KEY)")
	b.lf.register(fs)
	// Logs are for trouble: the run's own output is the progress and the
	// summary.
	b.lf.level = "warn"
	fs.Lookup("log-level").DefValue = b.lf.level
}

// backends are a running model endpoint and rollout server for an eval.
type backends struct {
	policyURL, model, key string
	serverURL, serverKey  string
	// tracing says whether this process exports traces.
	tracing bool
	log     *slog.Logger
	stop    func()
}

// start brings up what the run needs: the mock policy with --mock, and
// osmo's own rollout server (workflow and grader as named) unless --server
// names one. Their failures to start are the caller's to report.
func (b *backendFlags) start(ctx context.Context, e *env, workflow, entrypoint, grader, baseURL, model, key string, maxConcurrent int) (*backends, error) {
	log, tel, stopTelemetry, err := b.lf.start(ctx, e, serviceRollout)
	if err != nil {
		return nil, err
	}
	out := &backends{policyURL: baseURL, model: model, key: key, serverURL: b.server, serverKey: b.serverKey, log: log, tracing: tel.Enabled()}
	// The servers outlive the run's context: a Ctrl-C still has the
	// in-flight rollouts cancelled on them, and their callbacks received.
	srvCtx, stopServers := context.WithCancel(context.WithoutCancel(ctx))
	var servers errgroup.Group
	out.stop = func() { stopServers(); _ = servers.Wait(); stopTelemetry() }
	fail := func(err error) (*backends, error) { out.stop(); return nil, err }

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
		out.policyURL, out.key = policy.URL()+"/v1", ""
	}
	if out.policyURL == "" {
		return fail(usagef("no model endpoint: set [llm] base_url in the TOML or OPENAI_BASE_URL, or use --mock"))
	}
	if b.server != "" {
		return out, nil
	}
	var sc stackConfig
	sc.httpAddr, sc.rolloutAddr, sc.graderAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	sc.maxBody = defaultMaxMessageBytes
	if err := sc.rollout.register(flagSet(e, "eval"), e); err != nil {
		return fail(err)
	}
	sc.grader.register(flagSet(e, "eval"), "grader-")
	sc.rollout.workflow, sc.rollout.grader = workflow, grader
	if workflow == execWorkflow {
		sc.rollout.exec = entrypoint
	}
	sc.rollout.maxConcurrent = max(sc.rollout.maxConcurrent, maxConcurrent)
	sc.rollout.maxQueued = sc.rollout.maxConcurrent
	sc.tracing = stackTracing(tel)
	st, err := newStack(ctx, e, log, sc)
	if err != nil {
		return fail(err)
	}
	servers.Go(func() error { return st.run(srvCtx) })
	out.serverURL = st.http.URL()
	return out, nil
}

func runEvalRun(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "eval run")
	var (
		output, rows, jaeger       string
		limit, n, batch            optionalInt
		fresh, retryFailed, noLive bool
		jsonOut                    bool
		bf                         backendFlags
	)
	fs.StringVar(&output, "output", "", "`DIR` of results.jsonl, summary.json and report.html (default: FILE.eval beside the TOML, so a rerun resumes)")
	fs.Var(&limit, "limit", "run the first `N` rows only, 0 for all (default: [evaluation] limit)")
	fs.Var(&n, "n", "`N` runs of each row (default: [evaluation] n, else 1)")
	fs.Var(&batch, "batch-size", "at most `N` rollouts in flight (default: [evaluation] batch_size, else 8)")
	fs.StringVar(&jaeger, "jaeger", "", "Jaeger UI `URL` the report links each rollout's trace to (default http://localhost:16686 when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
	fs.StringVar(&rows, "rows", "", "run only these rows (0-based), such as 3,7,10-20")
	fs.BoolVar(&fresh, "fresh", false, "start over: drop the results of earlier runs")
	fs.BoolVar(&retryFailed, "retry-failed", false, "run the failed and skipped attempts again, under new rollout ids (those that succeeded are kept)")
	fs.BoolVar(&jsonOut, "json", false, "print the result as one JSON object on stdout, and nothing else there")
	fs.BoolVar(&noLive, "no-progress-bar", false, "print a progress line every few seconds even on a terminal")
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
	if file == "" {
		return usagef("usage: osmo eval run FILE.toml [flags]")
	}
	cfg, err := eval.LoadConfig(file)
	if err != nil {
		return usageError{err.Error()}
	}
	ev := &cfg.Evaluation
	switch {
	case n.set && n.v < 1:
		return usagef("--n: must be at least 1, got %d", n.v)
	case batch.set && batch.v < 1:
		return usagef("--batch-size: must be at least 1, got %d", batch.v)
	case limit.set && limit.v < 0:
		return usagef("--limit: must be 0 (all rows) or more, got %d", limit.v)
	}
	n.apply(&ev.N)
	batch.apply(&ev.BatchSize)
	limit.apply(&ev.Limit)
	dataset, err := eval.LoadDataset(cfg.DatasetPath())
	if err != nil {
		return usageError{err.Error()}
	}
	selected, err := selectRows(dataset, rows, 0, ev.Limit)
	if err != nil {
		return err
	}
	if bf.server == "" {
		if err := checkWorkflow(e, cfg.Experiment.Rollout); err != nil {
			return err
		}
	}
	if output == "" {
		output = cfg.DefaultOutput()
	}
	baseURL := cmp.Or(cfg.LLM.BaseURL, e.getenv("OPENAI_BASE_URL"))
	be, err := bf.start(ctx, e, cfg.Experiment.Rollout, cfg.Experiment.Entrypoint, cfg.Experiment.Grader,
		baseURL, cfg.Model(), e.getenv(cfg.LLM.APIKeyEnv), ev.BatchSize)
	if err != nil {
		return err
	}
	defer be.stop()

	live := !noLive && isTerminal(e.stderr)
	fmt.Fprintf(e.stderr, "osmo eval: %s: %d rows × %d runs of %s against %s (%s), %d at a time; results in %s\n",
		filepath.Base(file), len(selected), ev.N, cfg.Experiment.Rollout, cfg.Model(), be.policyURL, ev.BatchSize, output)
	rep, err := eval.Run(ctx, eval.Plan{
		Rows: selected, N: ev.N, BatchSize: ev.BatchSize,
		AgentTimeoutS: *ev.AgentTimeoutS, GraderTimeoutS: *ev.GraderTimeoutS, PassThreshold: *ev.PassThreshold,
		Output: output, Fresh: fresh, RetryFailed: retryFailed,
		ServerURL: be.serverURL, ServerKey: be.serverKey,
		PolicyURL: be.policyURL, Model: cfg.Model(), UpstreamKey: be.key,
		JaegerURL: jaegerURL(jaeger, be.tracing), Title: strings.TrimSuffix(filepath.Base(file), filepath.Ext(file)),
		Progress: e.stderr, Live: live, Logger: be.log,
		// Until a run has a manifest: its id is derived from the output
		// directory (RunID empty), its name is the directory's, the dataset
		// and rollout are named as the TOML names them, and the dataset
		// file's rows are all of it.
		RunName: filepath.Base(output), DatasetName: cfg.Experiment.Dataset, ModelPath: cfg.Experiment.ModelPath,
		RolloutName: cfg.Experiment.Rollout, TotalDatasetRows: len(dataset),
	})
	return reportEnd(e, rep, err, output, jsonOut)
}

// reportEnd prints how a run ended (with asJSON, as one JSON object) and
// picks the exit: 2 when a check before it refused to run, 130 when
// interrupted, 1 when it failed or attempts remain pending.
func reportEnd(e *env, rep *eval.Report, err error, output string, asJSON bool) error {
	var pe *eval.PreflightError
	if errors.As(err, &pe) {
		return usageError{"the check before running failed: " + pe.Error()}
	}
	if rep != nil && asJSON {
		if jerr := writeEvalJSON(e.stdout, rep, err, output); jerr != nil {
			return errors.Join(err, jerr)
		}
	} else if rep != nil {
		if rep.Ran == 0 && err == nil {
			fmt.Fprintln(e.stdout, "every sample already has a result: nothing ran (--fresh starts over, --retry-failed reruns failed and skipped ones)")
		}
		fmt.Fprintln(e.stdout, "summary:")
		_ = rep.Summary.WriteTable(e.stdout)
		if output != "" {
			fmt.Fprintln(e.stdout)
			for _, f := range []string{eval.ResultsFile, eval.SummaryFile, eval.ReportFile, eval.MetricsFile} {
				fmt.Fprintln(e.stdout, filepath.Join(output, f))
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

// writeEvalJSON prints the run's result as the Osmosis CLI's --json prints
// `osmosis eval run`'s: an operation envelope whose resource holds the
// run, its counts, the platform's summary (metrics, as metrics.json has
// it) and the attempts that did not succeed; osmo adds its own summary
// (summary.json's) and the run's files.
func writeEvalJSON(w io.Writer, rep *eval.Report, runErr error, output string) error {
	succeeded, failed, skipped := 0, 0, 0
	failedRows := []map[string]any{}
	for _, r := range rep.Results {
		switch r.Status {
		case eval.StatusSuccess:
			succeeded++
			continue
		case eval.StatusFailed:
			failed++
		case eval.StatusSkipped:
			skipped++
		}
		fr := map[string]any{"row_index": r.RowIndex, "source_row_index": r.SourceRowIndex, "run_index": r.RunIndex, "rollout_id": r.RolloutID, "error_type": nil}
		if r.Status == eval.StatusFailed {
			fr["error_type"] = cmp.Or(r.ErrCategory, "unknown")
		}
		if output != "" {
			fr["rollout_dir"] = filepath.Join(output, eval.TrialsDir, r.RolloutID)
		}
		failedRows = append(failedRows, fr)
	}
	cancelled := errors.Is(runErr, eval.ErrInterrupted)
	incomplete := cancelled || rep.Pending > 0 || runErr != nil
	resource := map[string]any{
		"total_work_items": rep.Total,
		"dispatched":       rep.Ran,
		"succeeded":        succeeded,
		"failed":           failed,
		"skipped":          skipped,
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
	if output != "" {
		resource["run_name"] = rep.RunName
		resource["local_run_id"] = rep.RunID
		resource["output_path"] = output
		files := map[string]string{}
		for k, f := range map[string]string{"results": eval.ResultsFile, "summary": eval.SummaryFile, "report": eval.ReportFile, "events": eval.EventsFile, "index": eval.IndexFile, "metrics": eval.MetricsFile, "progress": eval.ProgressFile} {
			files[k] = filepath.Join(output, f)
		}
		resource["files"] = files
		message += ": " + output
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

// optionalInt is an int flag that knows whether it was given.
type optionalInt struct {
	v   int
	set bool
}

func (o *optionalInt) String() string {
	if !o.set {
		return ""
	}
	return strconv.Itoa(o.v)
}

func (o *optionalInt) Set(s string) error {
	v, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("not a whole number")
	}
	o.v, o.set = v, true
	return nil
}

// apply puts the flag's value over dst when it was given.
func (o optionalInt) apply(dst *int) {
	if o.set {
		*dst = o.v
	}
}

// jaegerURL is where the report links traces: the flag, else the local
// Jaeger UI when this process exports traces.
func jaegerURL(flagValue string, tracing bool) string {
	if flagValue == "" && tracing {
		return "http://localhost:16686"
	}
	return flagValue
}

// selectRows picks the rows to run: --rows when given (each must exist),
// else offset and limit (0: all).
func selectRows(rows []eval.Row, spec string, offset, limit int) ([]eval.Row, error) {
	if spec != "" {
		idx, err := eval.ParseRows(spec)
		if err != nil {
			return nil, usageError{err.Error()}
		}
		out := make([]eval.Row, 0, len(idx))
		for _, i := range idx {
			if i >= len(rows) {
				return nil, usagef("--rows: row %d is not in the dataset (rows 0-%d)", i, len(rows)-1)
			}
			out = append(out, rows[i])
		}
		return out, nil
	}
	if offset >= len(rows) {
		return nil, usagef("--offset: %d is past the dataset's %d rows", offset, len(rows))
	}
	rows = rows[offset:]
	if limit > 0 && limit < len(rows) {
		rows = rows[:limit]
	}
	return rows, nil
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
