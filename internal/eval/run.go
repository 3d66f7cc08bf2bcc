package eval

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/osmo-rl/osmo"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/rows"
)

// Plan is one invocation of an eval: what runs, where, and how.
type Plan struct {
	Rows []Row
	// N is how many times each row runs; BatchSize bounds the rollouts in
	// flight. The budgets of each rollout are in seconds.
	N, BatchSize                  int
	AgentTimeoutS, GraderTimeoutS float64
	PassThreshold                 float64

	// Output is the run directory; "" keeps nothing (osmo test).
	Output string
	// RetryFailed runs the failed and skipped attempts again, under new
	// rollout ids.
	RetryFailed bool
	Redact      *Redactor // cleans every result before it is journaled
	// SkipChecks leaves out the model and server checks before running.
	SkipChecks bool
	// TrainingRows keeps each sample's LLM calls in its result and writes
	// the training rows derived from them in RowsMerge mode, with the
	// policy's vocabulary size when known.
	TrainingRows  bool
	RowsMerge     string
	RowsVocabSize int

	// ServerURL is the rollout server, PolicyURL the model's OpenAI base
	// URL, Model the model calls go to; the keys are their bearers.
	ServerURL, ServerKey          string
	PolicyURL, Model, UpstreamKey string
	// JaegerURL, when set, links each result's trace in the report, whose
	// title is Title.
	JaegerURL, Title string

	// What metrics.json's eval_run and progress.json say of the run, under
	// the SDK's names: id, name, dataset_name, model_name (default: Model),
	// rollout_name and total_dataset_rows (default: len(Rows)).
	RunID, RunName, DatasetName, ModelPath, RolloutName string
	TotalDatasetRows                                    int

	// Progress receives the progress display, drawn in place when Live (a
	// terminal), otherwise a line every few seconds.
	Progress io.Writer
	Live     bool
	// OnResult sees every result as it is journaled; BeforeCall holds
	// each LLM call (the interactive stepper). Both may be nil.
	OnResult   func(Result)
	BeforeCall func(ctx context.Context, rolloutID string, body map[string]any) error
	Logger     *slog.Logger
}

// ErrInterrupted is returned when the run's context ended before every
// attempt ran: what finished is kept, and a rerun runs the rest.
var ErrInterrupted = errors.New("eval interrupted")

// Report is what a finished (or interrupted) invocation leaves.
type Report struct {
	Summary Summary
	// Results are every planned attempt's result, old and new, in row and
	// run order.
	Results []Result
	// Ran is the attempts this invocation ran, Total the plan's (rows × n),
	// Pending those without a result, Resumed the results carried from an
	// earlier invocation.
	Ran, Total, Pending, Resumed int
	// TrainingRows are the rows derived from Results (rows.jsonl's); nil
	// with rows off.
	TrainingRows []TrainingRow
	// rowNotes say, by rollout id, what rows each attempt gave.
	rowNotes map[string]string
}

// Output file names.
const (
	ResultsFile = "results.jsonl"
	SummaryFile = "summary.json"
	ReportFile  = "report.html"
)

// Run runs the plan's attempts that have no result yet (with RetryFailed,
// the failed ones too), journaling each result before it is acknowledged,
// then writes the summary and the report of every planned attempt. It
// checks the model and the rollout server first, unless nothing is to run.
// When ctx ends it stops starting rollouts, cancels the ones in flight,
// keeps what finished and returns ErrInterrupted.
func Run(ctx context.Context, p Plan) (*Report, error) {
	start := time.Now()
	if p.Logger == nil {
		p.Logger = slog.New(slog.DiscardHandler)
	}
	var journal *Journal
	done := map[Key]Result{}
	if p.Output != "" {
		if err := os.MkdirAll(p.Output, 0o755); err != nil {
			return nil, fmt.Errorf("eval: output: %w", err)
		}
		var err error
		if journal, done, err = OpenJournal(filepath.Join(p.Output, ResultsFile)); err != nil {
			return nil, err
		}
		defer journal.Close()
	}
	var todo []Key
	byRow := map[int]Row{}
	for _, row := range p.Rows {
		byRow[row.Index] = row
		for run := range p.N {
			k := Key{row.Index, run}
			if r, ok := done[k]; !ok || (p.RetryFailed && (r.Status == StatusFailed || r.Status == StatusSkipped)) {
				todo = append(todo, k)
			}
		}
	}

	files := newSDKFiles(p, journal, byRow, start)
	ran := 0
	var runErr error
	if len(todo) > 0 {
		if !p.SkipChecks {
			if err := Preflight(ctx, p.PolicyURL, p.UpstreamKey, p.Model); err != nil {
				return nil, err
			}
			if err := CheckServer(ctx, p.ServerURL); err != nil {
				return nil, err
			}
		}
		r := &runner{plan: p, journal: journal, files: files, done: done, byRow: byRow, starts: map[string]attempt{}}
		ran, runErr = r.run(ctx, todo)
	}

	rep := &Report{Ran: ran, Total: len(p.Rows) * p.N, Results: p.ordered(done)}
	for _, r := range rep.Results {
		if journal.Carried(r) {
			rep.Resumed++
		}
	}
	rep.Pending = rep.Total - len(rep.Results)
	// wall_s is the time spent running the run's attempts: an invocation
	// adds its own to what the earlier ones wrote, and one that ran nothing
	// leaves it as it was.
	wall := priorWallS(p.Output)
	if len(todo) > 0 {
		wall += time.Since(start).Seconds()
	}
	rep.Summary = Summarize(rep.Results, p.PassThreshold, wall)
	// Rows are derived from the journal's calls each time: a resume or a
	// rerun (in another merge mode, say) writes every attempt's rows
	// again. Files an earlier invocation wrote are kept current even with
	// rows off, never left behind the results.
	withRows := p.TrainingRows || (p.Output != "" && hasRowsFiles(p.Output))
	if withRows {
		var rs RowsSummary
		rep.TrainingRows, rs, rep.rowNotes = buildRows(rep.Results, rows.Options{Merge: p.RowsMerge, VocabSize: p.RowsVocabSize})
		rep.Summary.Rows = &rs
	}
	if p.Output != "" {
		var rowsErr error
		if withRows {
			rowsErr = writeRows(p.Output, rep.TrainingRows)
		}
		if err := errors.Join(rowsErr, writeOutputs(p, rep, files)); err != nil {
			return rep, errors.Join(runErr, err)
		}
	}
	return rep, runErr
}

type attempt struct {
	key     Key
	started time.Time
	traceID string
}

// runner drives one invocation's attempts.
type runner struct {
	plan    Plan
	journal *Journal
	files   *sdkFiles // nil without an output directory
	ctl     *controller.V03

	// commits is held for reading by each result being committed and for
	// writing by the end of the run, which sets sealed: a late result is
	// refused rather than journaled behind the summary's back.
	commits sync.RWMutex
	sealed  bool

	// noRecords is set once the rollout server showed it keeps no records
	// to read a sample's calls from (see recordCalls).
	noRecords atomic.Bool

	mu       sync.Mutex
	done     map[Key]Result
	byRow    map[int]Row
	starts   map[string]attempt
	progress *progress
}

func (r *runner) run(ctx context.Context, todo []Key) (int, error) {
	p := r.plan
	ctl, err := controller.NewV03("127.0.0.1:0", controller.V03Options{
		PolicyURL:   p.PolicyURL,
		UpstreamKey: p.UpstreamKey,
		Model:       p.Model,
		CallbackKey: "osmo-eval-" + randomHex(16),
		LLMKey:      "osmo-eval-" + randomHex(16),
		OnTerminal:  r.commit,
		BeforeCall:  p.BeforeCall,
		Logger:      p.Logger,
		// A rollout whose callbacks never come ends as a failure once
		// both budgets and a margin are past.
		CallbackTimeout: time.Duration((p.AgentTimeoutS+p.GraderTimeoutS)*float64(time.Second)) + time.Minute,
	})
	if err != nil {
		return 0, fmt.Errorf("eval: controller: %w", err)
	}
	r.ctl = ctl
	srvCtx, stopSrv := context.WithCancel(context.WithoutCancel(ctx))
	srvDone := make(chan error, 1)
	go func() { srvDone <- ctl.Serve(srvCtx) }()
	defer func() {
		stopSrv()
		<-srvDone
		r.commits.Lock()
		r.sealed = true
		r.commits.Unlock()
	}()

	r.progress = newProgress(p.Progress, p.Live, len(todo), p.PassThreshold)
	defer r.progress.finish()
	// One nonce per invocation: a rerun never reuses a rollout id that a
	// long-lived server may still hold.
	nonce := randomHex(4)
	// The first error that must stop the run cancels the attempts in
	// flight; an attempt whose turn comes after that does not start.
	g, runCtx := errgroup.WithContext(ctx)
	g.SetLimit(p.BatchSize)
	var ran atomic.Int64
	for _, k := range todo {
		if runCtx.Err() != nil {
			break
		}
		g.Go(func() error {
			if runCtx.Err() != nil {
				return nil
			}
			ran.Add(1)
			return r.one(runCtx, nonce, k)
		})
	}
	if err := g.Wait(); err != nil {
		return int(ran.Load()), err
	}
	if ctx.Err() != nil {
		r.awaitCancelled()
		return int(ran.Load()), ErrInterrupted
	}
	return int(ran.Load()), nil
}

// awaitCancelled waits, at most 5s, until every rollout this run cancelled
// has posted its grader callback: the server owes them, and a closed
// listener would make it retry them for nothing.
func (r *runner) awaitCancelled() {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		r.mu.Lock()
		pending := 0
		for id, a := range r.starts {
			if _, ok := r.done[a.key]; !ok && len(r.ctl.GraderCallbacks(id)) == 0 {
				pending++
			}
		}
		r.mu.Unlock()
		if pending == 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// one runs attempt k; only an error that must stop the whole run (the
// journal failing, the server gone) is returned.
func (r *runner) one(ctx context.Context, nonce string, k Key) error {
	row := r.byRow[k.Row]
	id := fmt.Sprintf("eval-%s-r%d-n%d", nonce, k.Row, k.Run)
	traceID, spanID := randomHex(16), randomHex(8)
	r.mu.Lock()
	r.starts[id] = attempt{key: k, started: time.Now(), traceID: traceID}
	r.mu.Unlock()
	agent, grader := r.plan.AgentTimeoutS, r.plan.GraderTimeoutS
	res, err := r.ctl.Run(ctx, r.plan.ServerURL, r.plan.ServerKey, controller.V03RunRequest{
		RolloutID:        id,
		Messages:         row.Messages,
		Label:            row.Label,
		Metadata:         row.Metadata,
		AgentTimeoutSec:  &agent,
		GraderTimeoutSec: &grader,
		Header:           http.Header{"Traceparent": {"00-" + traceID + "-" + spanID + "-01"}},
	})
	var protoErr *controller.V03ProtocolError
	switch {
	case ctx.Err() != nil:
		return nil // interrupted: no result, a rerun runs it again
	case errors.As(err, &protoErr) && protoErr.StatusCode >= 400 && protoErr.StatusCode < 500:
		// The server refused this row (422 naming the field, say): that is
		// the row's result, as the SDK records it.
		return r.commitResult(id, Result{Status: StatusFailed, ErrCategory: "rollout_protocol_error", ErrMessage: protoErr.Error()})
	case err != nil:
		// Any other refusal (a 5xx of a server restarting, say) or a
		// transport failure says nothing of the row: the run stops and the
		// attempt stays pending, for a rerun to run.
		return fmt.Errorf("eval: rollout %s: %w", id, err)
	case res.Source == controller.SourceTimeout:
		return r.commitResult(id, Result{Status: StatusFailed, ErrCategory: "callback_timeout", ErrMessage: "the rollout server sent no grader callback in time"})
	}
	return nil // journaled by commit before the callback was acknowledged
}

// commit is the controller's OnTerminal: the grader callback's result is
// journaled before the callback is acknowledged. Its status and error_type
// are the SDK's (_classify_terminal): a failed grader is failed (even when
// it asked to drop the sample), with its err_category or grader_failed; a
// removed sample is skipped, without a reward; a failed completion is
// failed, with its err_category or workflow_failed. A failed attempt keeps
// the reward its sample carried.
func (r *runner) commit(ctx context.Context, res controller.V03Result) error {
	out := Result{Status: StatusSuccess}
	if res.Sample != nil {
		out.Reward = res.Sample.Reward
		out.Messages = res.Sample.Messages
		if r.plan.TrainingRows {
			out.SampleID, out.LLMCalls = sampleCalls(r.plan.Logger, res.RolloutID, res.Sample.Raw)
			if calls, ok := recordCalls(ctx, r.plan.ServerURL, r.plan.ServerKey, res.RolloutID, out.SampleID, &r.noRecords); ok {
				out.LLMCalls = calls
			}
		}
	}
	comp := res.Completion
	switch {
	case res.Status != "success":
		out.Status = StatusFailed
		out.ErrCategory = cmp.Or(deref(res.ErrCategory), "grader_failed")
		out.ErrMessage = deref(res.ErrMessage)
	case res.Sample != nil && res.Sample.RemoveSample:
		out.Status, out.Reward = StatusSkipped, nil
	case comp != nil && comp.Status != "success":
		out.Status = StatusFailed
		out.ErrCategory = cmp.Or(deref(comp.ErrCategory), "workflow_failed")
		out.ErrMessage = cmp.Or(deref(res.ErrMessage), deref(comp.ErrMessage))
	}
	return r.commitResult(res.RolloutID, out)
}

// sampleCalls reads the sample's id and llm_calls, which the v0.3 model
// does not define (osmo's rollout server adds them). Calls that do not
// decode are logged and left out: the sample then has no rows, and says
// so, rather than the result being lost.
func sampleCalls(log *slog.Logger, rolloutID string, raw json.RawMessage) (string, []*osmo.LLMCall) {
	var s struct {
		ID       string          `json:"id"`
		LLMCalls json.RawMessage `json:"llm_calls"`
	}
	if json.Unmarshal(raw, &s) != nil {
		return "", nil
	}
	var calls []*osmo.LLMCall
	if len(s.LLMCalls) > 0 && string(s.LLMCalls) != "null" {
		if err := json.Unmarshal(s.LLMCalls, &calls); err != nil {
			log.Warn("eval: the sample's llm_calls do not decode; it has no training rows", "rollout_id", rolloutID, "error", err)
			return s.ID, nil
		}
	}
	return s.ID, slices.DeleteFunc(calls, func(c *osmo.LLMCall) bool { return c == nil })
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// commitResult completes out with what the runner knows of the attempt,
// journals it and counts it.
func (r *runner) commitResult(id string, out Result) error {
	r.commits.RLock()
	defer r.commits.RUnlock()
	if r.sealed {
		return errors.New("eval: the run has ended; its results are summarized")
	}
	r.mu.Lock()
	a, ok := r.starts[id]
	r.mu.Unlock()
	if !ok {
		return fmt.Errorf("eval: a result for rollout %q, which this run did not start", id)
	}
	out.RowIndex, out.RunIndex, out.RolloutID, out.TraceID = a.key.Row, a.key.Run, id, a.traceID
	out.SourceRowIndex = r.byRow[a.key.Row].SourceIndex
	out.LatencyMS = float64(time.Since(a.started)) / float64(time.Millisecond)
	out.Tokens = r.ctl.Tokens(id)
	if out.Messages == nil {
		// A failed rollout's sample is not sent: keep the conversation its
		// last LLM call carried, for reading.
		out.Messages = r.lastConversation(id)
	}
	out = r.plan.Redact.result(out)
	if r.journal != nil {
		if err := r.journal.Append(out); err != nil {
			return err
		}
	}
	r.mu.Lock()
	r.done[a.key] = out
	r.mu.Unlock()
	if r.files != nil {
		r.files.committed(out, r.planned)
	}
	r.progress.add(out)
	if r.plan.OnResult != nil {
		r.plan.OnResult(out)
	}
	return nil
}

// planned is the results of the plan's attempts so far.
func (r *runner) planned() []Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.plan.ordered(r.done)
}

// ordered is the results in done of the plan's attempts, in row and run
// order.
func (p *Plan) ordered(done map[Key]Result) []Result {
	var out []Result
	for _, row := range p.Rows {
		for run := range p.N {
			if r, ok := done[Key{row.Index, run}]; ok {
				out = append(out, r)
			}
		}
	}
	return out
}

// lastConversation is the messages of id's last LLM call, or an empty list.
func (r *runner) lastConversation(id string) []map[string]any {
	calls := r.ctl.Chats()
	for i := len(calls) - 1; i >= 0; i-- {
		if calls[i].RolloutID != id {
			continue
		}
		var msgs []map[string]any
		if b, err := json.Marshal(calls[i].Body["messages"]); err == nil && json.Unmarshal(b, &msgs) == nil {
			return msgs
		}
	}
	return []map[string]any{}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Preflight checks that the model answers one tiny call: a run against a
// model that cannot answer fails here, with the URL and the answer, and
// not once per row.
func Preflight(ctx context.Context, baseURL, key, model string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	url := strings.TrimRight(baseURL, "/") + "/chat/completions"
	body, _ := json.Marshal(map[string]any{
		"model":      model,
		"messages":   []map[string]string{{"role": "user", "content": "Reply with OK."}},
		"max_tokens": 8,
	})
	status, answer, err := send(ctx, http.MethodPost, url, key, body, 4096)
	switch {
	case err != nil:
		return &PreflightError{URL: url, Msg: err.Error()}
	case status != http.StatusOK:
		return &PreflightError{URL: url, Status: status, Msg: strings.TrimSpace(string(answer))}
	}
	var parsed struct {
		Choices []json.RawMessage `json:"choices"`
	}
	if json.Unmarshal(answer, &parsed) != nil || len(parsed.Choices) == 0 {
		return &PreflightError{URL: url, Status: status, Msg: "the answer is not a chat completion"}
	}
	return nil
}

// PreflightError is a model or server that failed the checks before a run.
type PreflightError struct {
	URL    string
	Status int // 0 when no answer came
	Msg    string
}

func (e *PreflightError) Error() string {
	if e.Status == 0 {
		return fmt.Sprintf("%s did not answer: %s", e.URL, e.Msg)
	}
	return fmt.Sprintf("%s answered %d: %s", e.URL, e.Status, e.Msg)
}

// CheckServer checks that the rollout server answers GET /health.
func CheckServer(ctx context.Context, serverURL string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	url := strings.TrimRight(serverURL, "/") + "/health"
	status, answer, err := send(ctx, http.MethodGet, url, "", nil, 4096)
	switch {
	case err != nil:
		return &PreflightError{URL: url, Msg: "the rollout server is not reachable: " + err.Error()}
	case status != http.StatusOK:
		return &PreflightError{URL: url, Status: status, Msg: "the rollout server is not healthy: " + strings.TrimSpace(string(answer))}
	}
	return nil
}

// send makes an HTTP request, with key as its bearer when set, and returns
// the answer's status and up to limit bytes of its body.
func send(ctx context.Context, method, url, key string, body []byte, limit int64) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(io.LimitReader(resp.Body, limit))
	return resp.StatusCode, answer, nil
}

// priorWallS is the wall_s of the summary an earlier invocation wrote in
// dir; 0 without one.
func priorWallS(dir string) float64 {
	if dir == "" {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(dir, SummaryFile))
	if err != nil {
		return 0
	}
	var s struct {
		WallS float64 `json:"wall_s"`
	}
	if json.Unmarshal(b, &s) != nil {
		return 0
	}
	return s.WallS
}

// writeOutputs writes summary.json, report.html and the SDK's files.
func writeOutputs(p Plan, rep *Report, files *sdkFiles) error {
	summary, err := marshalFile(rep.Summary)
	if err != nil {
		return err
	}
	if err := WriteFileAtomic(filepath.Join(p.Output, SummaryFile), summary); err != nil {
		return err
	}
	var page bytes.Buffer
	if err := renderReport(&page, p, rep); err != nil {
		return fmt.Errorf("eval: report: %w", err)
	}
	return errors.Join(WriteFileAtomic(filepath.Join(p.Output, ReportFile), page.Bytes()), files.finish(rep))
}
