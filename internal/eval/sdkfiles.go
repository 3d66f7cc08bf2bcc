package eval

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The Osmosis SDK's run-directory files (PROTOCOL.md, "Run directory"),
// written with the SDK's fields, so a run directory reads the same
// whichever wrote it.
const (
	// EventsFile is the SDK's terminal journal (see Journal).
	EventsFile = "events.jsonl"
	// IndexFile and SummaryLinesFile are the same lines: the last event of
	// every attempt, with trajectory_filename and resumed.
	IndexFile        = "index.jsonl"
	SummaryLinesFile = "summary.jsonl"
	// ProgressFile holds total_runs, sampled_rows and total_dataset_rows.
	ProgressFile = "progress.json"
	// MetricsFile holds eval_run (the run's identity and state) and the
	// platform's summary.
	MetricsFile = "metrics.json"
	// TrajectoriesDir holds row_<r>_run_<n>.json: the ATIF trajectory of
	// each attempt's last result.
	TrajectoriesDir = "trajectories"
	// TrialsDir holds a directory per rollout id, whose trajectory.json a
	// Python rollout server writes under _OSMOSIS_ROLLOUT_ARTIFACT_ROOT, or
	// osmo when none did.
	TrialsDir      = "rollout_trials"
	trajectoryFile = "trajectory.json"
)

// event is a line of events.jsonl, the SDK's TerminalRecord: its keys
// sorted, as the SDK writes them.
type event struct {
	DurationMS     float64  `json:"duration_ms"`
	ErrorType      string   `json:"error_type,omitempty"`
	Reward         *float64 `json:"reward,omitempty"`
	RolloutID      string   `json:"rollout_id"`
	RowIndex       int      `json:"row_index"`
	RunIndex       int      `json:"run_index"`
	SourceRowIndex *int     `json:"source_row_index,omitempty"`
	Status         string   `json:"status"`
	Tokens         *int     `json:"tokens,omitempty"`
}

// eventOf is r's event. Only a failed attempt has an error_type.
func eventOf(r Result) event {
	src, tokens := r.SourceRowIndex, r.Tokens
	e := event{
		DurationMS: r.LatencyMS, Reward: r.Reward, RolloutID: r.RolloutID, RowIndex: r.RowIndex, RunIndex: r.RunIndex,
		SourceRowIndex: &src, Status: r.Status, Tokens: &tokens,
	}
	if r.Status == StatusFailed {
		e.ErrorType = cmp.Or(r.ErrCategory, "unknown")
	}
	return e
}

// result is the result an event says, when results.jsonl has no detail.
func (e event) result() Result {
	r := Result{
		RowIndex: e.RowIndex, RunIndex: e.RunIndex, SourceRowIndex: e.RowIndex, RolloutID: e.RolloutID, Status: e.Status,
		ErrCategory: e.ErrorType, Reward: e.Reward, LatencyMS: e.DurationMS, Messages: []map[string]any{},
	}
	if e.SourceRowIndex != nil {
		r.SourceRowIndex = *e.SourceRowIndex
	}
	if e.Tokens != nil {
		r.Tokens = *e.Tokens
	}
	return r
}

// decodeEvent reads an events.jsonl line as strictly as the SDK does.
func decodeEvent(line []byte) (event, error) {
	var e event
	var required struct {
		RowIndex  *int    `json:"row_index"`
		RunIndex  *int    `json:"run_index"`
		RolloutID *string `json:"rollout_id"`
		Status    *string `json:"status"`
	}
	if err := json.Unmarshal(line, &e); err != nil {
		return e, fmt.Errorf("not a terminal record: %v", err)
	}
	_ = json.Unmarshal(line, &required)
	switch {
	case required.RowIndex == nil || required.RunIndex == nil || required.RolloutID == nil || required.Status == nil:
		return e, errors.New("not a terminal record: row_index, run_index, rollout_id and status are required")
	case !singleSegment(e.RolloutID):
		return e, fmt.Errorf("rollout_id %q is not one path segment", e.RolloutID)
	case e.Status != StatusSuccess && e.Status != StatusFailed && e.Status != StatusSkipped:
		return e, fmt.Errorf("status %q is not success, failed or skipped", e.Status)
	}
	return e, nil
}

// marshalLine and marshalFile encode v as the SDK writes a JSON line and
// a JSON file: no HTML escaping, a final newline; a file indented by two.
func marshalLine(v any) ([]byte, error) { return marshalIndent(v, "") }
func marshalFile(v any) ([]byte, error) { return marshalIndent(v, "  ") }

func marshalIndent(v any, indent string) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", indent)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// jsonLines is items as JSON lines; nothing here fails to encode.
func jsonLines[T any](items []T) []byte {
	var b bytes.Buffer
	for _, it := range items {
		line, _ := marshalLine(it)
		b.Write(line)
	}
	return b.Bytes()
}

// WriteFileAtomic replaces path with data: a reader sees the old file or
// the new one, never a part, a crash included.
func WriteFileAtomic(path string, data []byte) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("eval: %w", err)
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("eval: %w", err)
	}
	_, err = tmp.Write(data)
	if err == nil {
		err = tmp.Sync()
	}
	if err == nil {
		// CreateTemp makes the file 0600; nothing here is a secret.
		err = tmp.Chmod(0o644)
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("eval: %w", err)
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync() // the rename, durable where the filesystem allows it
		d.Close()
	}
	return nil
}

// indexRow is a line of index.jsonl and summary.jsonl, the SDK's
// build_index_row, its keys in the SDK's order.
type indexRow struct {
	RowIndex           int      `json:"row_index"`
	RunIndex           int      `json:"run_index"`
	RolloutID          string   `json:"rollout_id"`
	TrajectoryFilename string   `json:"trajectory_filename,omitempty"`
	Status             string   `json:"status"`
	Reward             *float64 `json:"reward,omitempty"`
	Tokens             *int     `json:"tokens,omitempty"`
	DurationMS         float64  `json:"duration_ms"`
	ErrorType          string   `json:"error_type,omitempty"`
	Resumed            bool     `json:"resumed,omitempty"`
}

type progressFile struct {
	TotalRuns        int `json:"total_runs"`
	SampledRows      int `json:"sampled_rows"`
	TotalDatasetRows int `json:"total_dataset_rows"`
}

// evalRun is metrics.json's eval_run, the SDK's RunIdentity.
type evalRun struct {
	ID          string  `json:"id"`
	Status      string  `json:"status"`
	Name        string  `json:"name"`
	DatasetName string  `json:"dataset_name"`
	ModelName   string  `json:"model_name"`
	RolloutName string  `json:"rollout_name"`
	DurationMS  float64 `json:"duration_ms"`
	StartedAt   string  `json:"started_at"`
	CompletedAt string  `json:"completed_at,omitempty"`
}

type metricsFile struct {
	EvalRun evalRun         `json:"eval_run"`
	Summary PlatformSummary `json:"summary"`
}

// eval_run statuses: running while results come, then finished when every
// attempt has one, else incomplete.
const (
	runRunning    = "running"
	runFinished   = "finished"
	runIncomplete = "incomplete"
)

// sdkTime is how the SDK writes a time: UTC, microseconds, Z.
func sdkTime(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000000Z") }

// snapshotEvery bounds how often the snapshots (index, summary.jsonl,
// progress, metrics), each of every result, are rewritten while a run goes.
const snapshotEvery = time.Second

// sdkFiles writes the SDK's projections of a run directory: the snapshots
// and the trajectories, each whole. None decides what a resume reruns.
type sdkFiles struct {
	p       Plan
	journal *Journal
	started time.Time
	rows    map[int]Row

	mu       sync.Mutex
	lastSnap time.Time
	// traj says which rollouts have their trajectory.json.
	traj map[string]bool
}

// newSDKFiles is the writer of p's run directory; nil without one.
func newSDKFiles(p Plan, j *Journal, rows map[int]Row, started time.Time) *sdkFiles {
	if p.Output == "" {
		return nil
	}
	return &sdkFiles{p: p, journal: j, started: started, rows: rows, traj: map[string]bool{}}
}

// committed writes a journaled result's trajectory and, at most every
// snapshotEvery, the snapshots of planned(). A failure is only logged: the
// result is durable already, and every projection is written at the end.
func (f *sdkFiles) committed(out Result, planned func() []Result) {
	if err := f.writeTrajectory(out, true); err != nil {
		f.p.Logger.Warn("eval: writing a trajectory", "rollout_id", out.RolloutID, "error", err)
	}
	f.mu.Lock()
	due := time.Since(f.lastSnap) >= snapshotEvery
	if due {
		f.lastSnap = time.Now()
	}
	f.mu.Unlock()
	if due {
		if err := f.snapshots(planned(), runRunning); err != nil {
			f.p.Logger.Warn("eval: writing the run's snapshots", "error", err)
		}
	}
}

// finish writes every projection of rep, the run's last state.
func (f *sdkFiles) finish(rep *Report) error {
	var errs []error
	for _, r := range rep.Results {
		errs = append(errs, f.writeTrajectory(r, false))
	}
	status := runFinished
	if rep.Pending > 0 {
		status = runIncomplete
	}
	errs = append(errs, f.snapshots(rep.Results, status))
	return errors.Join(errs...)
}

// snapshots writes index.jsonl, summary.jsonl, progress.json and
// metrics.json of results with the run in status.
func (f *sdkFiles) snapshots(results []Result, status string) error {
	rows := make([]indexRow, len(results))
	f.mu.Lock()
	for i, r := range results {
		e := eventOf(r)
		rows[i] = indexRow{
			RowIndex: r.RowIndex, RunIndex: r.RunIndex, RolloutID: r.RolloutID, Status: r.Status,
			Reward: r.Reward, Tokens: e.Tokens, DurationMS: r.LatencyMS, ErrorType: e.ErrorType,
			Resumed: f.journal.Carried(r),
		}
		if f.hasTrajectory(r.RolloutID) {
			rows[i].TrajectoryFilename = trajectoryFile
		}
	}
	f.mu.Unlock()
	slices.SortFunc(rows, func(a, b indexRow) int {
		return cmp.Or(cmp.Compare(a.RowIndex, b.RowIndex), cmp.Compare(a.RunIndex, b.RunIndex))
	})
	index := jsonLines(rows)
	now := time.Now()
	run := evalRun{
		ID: f.p.RunID, Status: status, Name: f.p.RunName,
		DatasetName: f.p.DatasetName, ModelName: cmp.Or(f.p.ModelPath, f.p.Model), RolloutName: f.p.RolloutName,
		DurationMS: float64(now.Sub(f.started)) / float64(time.Millisecond), StartedAt: sdkTime(f.started),
	}
	if status == runFinished {
		run.CompletedAt = sdkTime(now)
	}
	progress, err := marshalFile(progressFile{
		TotalRuns: len(f.p.Rows) * f.p.N, SampledRows: len(f.p.Rows), TotalDatasetRows: cmp.Or(f.p.TotalDatasetRows, len(f.p.Rows)),
	})
	if err != nil {
		return err
	}
	metrics, err := marshalFile(metricsFile{EvalRun: run, Summary: Summarize(results, f.p.PassThreshold, 0).PlatformSummary})
	if err != nil {
		return err
	}
	return errors.Join(
		WriteFileAtomic(filepath.Join(f.p.Output, IndexFile), index),
		WriteFileAtomic(filepath.Join(f.p.Output, SummaryLinesFile), index),
		WriteFileAtomic(filepath.Join(f.p.Output, ProgressFile), progress),
		WriteFileAtomic(filepath.Join(f.p.Output, MetricsFile), metrics),
	)
}

// hasTrajectory reports whether rollout id has its trajectory.json. Caller
// holds mu.
func (f *sdkFiles) hasTrajectory(id string) bool {
	has, known := f.traj[id]
	if !known {
		_, err := os.Stat(filepath.Join(f.p.Output, TrialsDir, id, trajectoryFile))
		has = err == nil
		f.traj[id] = has
	}
	return has
}

// writeTrajectory puts r's trajectory in rollout_trials/<id>/trajectory.json
// and its copy in trajectories/row_<r>_run_<n>.json. One the rollout server
// wrote there (a Python server does, after the grader callback is
// acknowledged) is the one; else osmo writes its own of the conversation.
// At the run's end (fresh false) the copies are brought up to date, but a
// result of an earlier invocation whose copy is there is left alone.
func (f *sdkFiles) writeTrajectory(r Result, fresh bool) error {
	canonical := filepath.Join(f.p.Output, TrialsDir, r.RolloutID, trajectoryFile)
	proj := filepath.Join(f.p.Output, TrajectoriesDir, fmt.Sprintf("row_%d_run_%d.json", r.RowIndex, r.RunIndex))
	if !fresh && f.journal.Carried(r) {
		if _, err := os.Stat(proj); err == nil {
			return nil
		}
	}
	data, err := os.ReadFile(canonical)
	switch {
	case err == nil && validTrajectory(data, r.RolloutID):
	case errors.Is(err, os.ErrNotExist):
		doc := f.trajectory(r)
		if doc == nil { // no conversation: none, as the SDK has none without a sample
			return f.noTrajectory(r.RolloutID, proj)
		}
		if data, err = marshalFile(doc); err != nil {
			return err
		}
		if err := WriteFileAtomic(canonical, data); err != nil {
			return err
		}
	default:
		// Unreadable, or not this rollout's: none, as the SDK reads it; the
		// file is the server's to keep.
		return errors.Join(err, f.noTrajectory(r.RolloutID, proj))
	}
	// The copy is osmo's: no secret value reaches it.
	data = f.p.Redact.JSON(data)
	if old, err := os.ReadFile(proj); err != nil || !bytes.Equal(old, data) {
		if err := WriteFileAtomic(proj, data); err != nil {
			return err
		}
	}
	f.mu.Lock()
	f.traj[r.RolloutID] = true
	f.mu.Unlock()
	return nil
}

// noTrajectory records that rollout id has none and removes an earlier
// attempt's copy at proj.
func (f *sdkFiles) noTrajectory(id, proj string) error {
	f.mu.Lock()
	f.traj[id] = false
	f.mu.Unlock()
	if err := os.Remove(proj); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// atifVersion is the ATIF schema the SDK writes trajectories in.
const atifVersion = "ATIF-v1.7"

// trajectory is r's ATIF trajectory, as the SDK's rollout server makes one
// of a sample's messages (convert_sample_to_trajectory): a step per
// message (an unknown role as user, keeping it under extra.original_role),
// a tool message folded into the agent step before it as an observation,
// and the rollout's id, label, reward and row metadata under
// extra.osmosis. nil when r has no messages.
func (f *sdkFiles) trajectory(r Result) *atifDocument {
	var steps []map[string]any
	for _, m := range r.Messages {
		role, _ := m["role"].(string)
		if role == "tool" || role == "function" {
			steps = attachToolResult(steps, m)
			continue
		}
		source, known := map[string]string{"system": "system", "developer": "system", "assistant": "agent", "user": "user"}[role]
		extra := map[string]any{}
		if !known {
			source = "user"
			extra["original_role"] = role
		}
		step := map[string]any{"step_id": len(steps) + 1, "source": source, "message": TextOf(m["content"])}
		// Only an agent step may carry tool calls and reasoning; any other
		// keeps them in its extra.
		carrier := extra
		if source == "agent" {
			carrier = step
			if model, ok := m["model"].(string); ok && model != "" {
				step["model_name"] = model
			}
		}
		if calls := toolCalls(m["tool_calls"]); calls != nil {
			carrier["tool_calls"] = calls
		}
		if reasoning := m["reasoning_content"]; reasoning != nil {
			if _, ok := reasoning.(string); !ok {
				b, _ := json.Marshal(reasoning)
				reasoning = string(b)
			}
			carrier["reasoning_content"] = reasoning
		}
		if len(extra) > 0 {
			step["extra"] = extra
		}
		steps = append(steps, step)
	}
	if len(steps) == 0 {
		return nil
	}
	osmosis := map[string]any{"rollout_id": r.RolloutID}
	row, ok := f.rows[r.RowIndex]
	if ok && row.Label != nil {
		osmosis["label"] = *row.Label
	}
	if r.Reward != nil {
		osmosis["reward"] = *r.Reward
	}
	if ok && len(row.Metadata) > 0 {
		osmosis["request_metadata"] = row.Metadata
	}
	agent := map[string]any{"name": "osmo", "version": osmoVersion()}
	if f.p.Model != "" {
		agent["model_name"] = f.p.Model
	}
	return &atifDocument{
		SchemaVersion: atifVersion, SessionID: r.RolloutID, TrajectoryID: r.RolloutID, Agent: agent, Steps: steps,
		FinalMetrics: map[string]any{"total_steps": len(steps)}, Extra: map[string]any{"osmosis": osmosis},
	}
}

// atifDocument is an ATIF trajectory, its keys in the SDK's order.
type atifDocument struct {
	SchemaVersion string           `json:"schema_version"`
	SessionID     string           `json:"session_id"`
	TrajectoryID  string           `json:"trajectory_id"`
	Agent         map[string]any   `json:"agent"`
	Steps         []map[string]any `json:"steps"`
	FinalMetrics  map[string]any   `json:"final_metrics"`
	Extra         map[string]any   `json:"extra"`
}

// attachToolResult folds a tool message into the agent step before it.
func attachToolResult(steps []map[string]any, m map[string]any) []map[string]any {
	callID, _ := m["tool_call_id"].(string)
	result := map[string]any{"content": TextOf(m["content"])}
	var target map[string]any
	if n := len(steps); n > 0 && steps[n-1]["source"] == "agent" {
		target = steps[n-1]
	}
	calls, _ := target["tool_calls"].([]map[string]any)
	if callID != "" && slices.ContainsFunc(calls, func(c map[string]any) bool { return c["tool_call_id"] == callID }) {
		result["source_call_id"] = callID
	} else {
		result["extra"] = map[string]any{"tool_call_id": m["tool_call_id"]}
	}
	if target == nil {
		role, _ := m["role"].(string)
		return append(steps, map[string]any{
			"step_id": len(steps) + 1, "source": "system", "message": "",
			"observation": map[string]any{"results": []map[string]any{result}},
			"extra":       map[string]any{"original_role": role},
		})
	}
	obs, _ := target["observation"].(map[string]any)
	if obs == nil {
		target["observation"] = map[string]any{"results": []map[string]any{result}}
	} else {
		obs["results"] = append(obs["results"].([]map[string]any), result)
	}
	return steps
}

// toolCalls are an OpenAI message's tool calls in ATIF's shape.
func toolCalls(raw any) []map[string]any {
	list, _ := raw.([]any)
	var out []map[string]any
	for i, item := range list {
		call, ok := item.(map[string]any)
		if !ok {
			continue
		}
		fn, _ := call["function"].(map[string]any)
		id, _ := call["id"].(string)
		name, _ := fn["name"].(string)
		if id == "" {
			id = "call_" + strconv.Itoa(i)
		}
		if name == "" {
			name = "unknown"
		}
		out = append(out, map[string]any{"tool_call_id": id, "function_name": name, "arguments": arguments(fn["arguments"])})
	}
	return out
}

func arguments(raw any) map[string]any {
	switch a := raw.(type) {
	case map[string]any:
		return a
	case string:
		if a == "" {
			return map[string]any{}
		}
		var parsed map[string]any
		if json.Unmarshal([]byte(a), &parsed) == nil && parsed != nil {
			return parsed
		}
		return map[string]any{"_raw": a}
	}
	return map[string]any{}
}

// TextOf flattens a message's content to text, as the SDK does: text
// parts joined by newlines, anything else as JSON.
func TextOf(content any) string {
	switch c := content.(type) {
	case nil:
		return ""
	case string:
		return c
	case []any:
		texts := make([]string, 0, len(c))
		for _, p := range c {
			part, ok := p.(map[string]any)
			if !ok || part["type"] != "text" {
				texts = nil
				break
			}
			t, _ := part["text"].(string)
			texts = append(texts, t)
		}
		if len(texts) > 0 {
			return strings.Join(texts, "\n")
		}
	}
	b, _ := json.Marshal(content)
	return string(b)
}

// validTrajectory reports whether data is an ATIF document of rollout id,
// by the identity the platform reads: extra.osmosis.rollout_id, else
// session_id, else trajectory_id up to its first "/".
func validTrajectory(data []byte, id string) bool {
	var doc struct {
		SessionID    string `json:"session_id"`
		TrajectoryID string `json:"trajectory_id"`
		Extra        struct {
			Osmosis struct {
				RolloutID string `json:"rollout_id"`
			} `json:"osmosis"`
		} `json:"extra"`
	}
	if json.Unmarshal(data, &doc) != nil {
		return false
	}
	got := doc.Extra.Osmosis.RolloutID
	if got == "" {
		got = doc.SessionID
	}
	if before, _, found := strings.Cut(doc.TrajectoryID, "/"); got == "" && found {
		got = before
	}
	return got != "" && got == id
}

// osmoVersion is this binary's module version ("dev" from a work tree).
func osmoVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}
