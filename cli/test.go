package cli

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"

	"github.com/osmo-rl/osmo/internal/eval"
)

// runTest runs dataset rows through a workflow, one at a time, and prints
// each conversation and reward: the loop of debugging one agent before an
// eval. With -i it stops before every LLM call and lets the user step.
func runTest(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "test")
	var (
		dataset, workflow, entrypoint, grader, model, baseURL, keyEnv string
		row, limit, offset                                            int
		interactive                                                   bool
		agentTimeout, graderTimeout                                   float64
		bf                                                            backendFlags
	)
	fs.StringVar(&dataset, "d", "", "dataset `FILE` (.jsonl, .csv or .parquet)")
	fs.StringVar(&dataset, "dataset", "", "same as -d")
	fs.StringVar(&workflow, "workflow", e.reg.defaultWorkflow(), `workflow to run, or "exec" with --exec`)
	fs.StringVar(&entrypoint, "exec", "", "with --workflow exec: the agent `CMD`")
	fs.StringVar(&grader, "grader", "", "grader spec (default: the workflow's own)")
	fs.StringVar(&model, "model", "", "model the placeholder model is routed to, as provider/model or model; required with --base-url")
	fs.StringVar(&baseURL, "base-url", e.getenv("OPENAI_BASE_URL"), "the model's OpenAI-compatible base `URL` (env OPENAI_BASE_URL); none: the built-in mock policy")
	fs.StringVar(&keyEnv, "api-key-env", eval.DefaultAPIKeyEnv, "environment variable holding the model's API key")
	fs.IntVar(&row, "row", -1, "run only this row (0-based)")
	fs.IntVar(&limit, "limit", 0, "run at most N rows (0: all)")
	fs.IntVar(&offset, "offset", 0, "skip the first N rows")
	fs.BoolVar(&interactive, "i", false, "interactive: stop before every LLM call (next turn, continue, show messages, show tools, jump to row, quit); the rollout's budget keeps counting while you read")
	fs.BoolVar(&interactive, "interactive", false, "same as -i")
	fs.Float64Var(&agentTimeout, "agent-timeout", eval.DefaultAgentTimeoutS, "seconds a rollout's workflow may run")
	fs.Float64Var(&graderTimeout, "grader-timeout", eval.DefaultGraderTimeoutS, "seconds its grading may take")
	bf.register(fs, e)
	if err := parse(fs, args); err != nil {
		return err
	}
	if dataset == "" {
		return usagef("-d: a dataset file is required")
	}
	if limit < 0 || offset < 0 {
		return usagef("--limit and --offset must not be negative")
	}
	if !(agentTimeout > 0) || !(graderTimeout > 0) {
		return usagef("--agent-timeout and --grader-timeout must be positive")
	}
	d, err := eval.ReadDataset(dataset)
	if err != nil {
		return usageError{err.Error()}
	}
	var spec string
	if row >= 0 {
		spec = strconv.Itoa(row)
	}
	selected, err := d.Select(spec, offset, limit)
	if err != nil {
		return usageError{err.Error()}
	}
	// osmo test keeps no results: a row is named by its place in the
	// file, as --row and the stepper's jump take it.
	for i := range selected {
		selected[i].Index = selected[i].SourceIndex
	}
	if entrypoint != "" {
		workflow = execWorkflow
	}
	if bf.server == "" {
		if err := checkWorkflow(e, workflow); err != nil {
			return err
		}
	}
	if baseURL == "" && !bf.mock {
		fmt.Fprintln(e.stderr, "osmo test: no model endpoint given (--base-url or OPENAI_BASE_URL): using the built-in mock policy")
		bf.mock = true
	}
	if model == "" && !bf.mock {
		return usagef("--model: required with a model endpoint (%s)", baseURL)
	}
	model = strings.TrimPrefix(cmp.Or(model, mockModelName), "openai/")
	plan := eval.Plan{
		N: 1, BatchSize: 1, AgentTimeoutS: agentTimeout, GraderTimeoutS: graderTimeout, PassThreshold: 1,
		PolicyURL: baseURL, Model: model, UpstreamKey: e.getenv(keyEnv),
	}
	stop, _, err := bf.start(ctx, e, backendSpec{workflow: workflow, entrypoint: entrypoint, grader: grader, maxConcurrent: 1}, &plan)
	if err != nil {
		return err
	}
	defer stop()

	if interactive {
		all, err := d.Select("", 0, 0)
		if err != nil {
			return usageError{err.Error()}
		}
		return (&stepper{e: e, plan: plan, rows: selected, all: all}).run(ctx)
	}
	plan.Rows = selected
	plan.OnResult = func(r eval.Result) { printResult(e.stdout, r) }
	rep, err := eval.Run(ctx, plan)
	return reportEnd(e, rep, err, nil, false)
}

// mockModelName is the model the mock policy answers as.
const mockModelName = "mock-policy"

// printResult prints one row's conversation and how it ended.
func printResult(w io.Writer, r eval.Result) {
	fmt.Fprintf(w, "\n── row %d ──\n", r.RowIndex)
	for _, m := range r.Messages {
		fmt.Fprintf(w, "%-10s %s\n", fmt.Sprint(m["role"])+":", messageLine(m))
	}
	reward := "none"
	if r.Reward != nil {
		reward = strconv.FormatFloat(*r.Reward, 'g', -1, 64)
	}
	fmt.Fprintf(w, "→ %s, reward %s, %d ms, %d tokens", r.Status, reward, int(r.LatencyMS), r.Tokens)
	if r.ErrMessage != "" {
		fmt.Fprintf(w, ", %s: %s", r.ErrCategory, r.ErrMessage)
	}
	fmt.Fprintln(w)
}

// messageLine is a message's content on one line: its text, or the tools it
// calls.
func messageLine(m map[string]any) string {
	text := eval.TextOf(m["content"])
	if calls, ok := m["tool_calls"].([]any); ok && len(calls) > 0 {
		var parts []string
		for _, c := range calls {
			call, _ := c.(map[string]any)
			fn, _ := call["function"].(map[string]any)
			parts = append(parts, fmt.Sprintf("%v(%v)", fn["name"], fn["arguments"]))
		}
		text = strings.TrimSpace(text + " [calls " + strings.Join(parts, ", ") + "]")
	}
	return strings.ReplaceAll(text, "\n", " ⏎ ")
}

// stepper is `osmo test -i`: rows run one at a time, and before each LLM
// call of a row the user says what happens next.
type stepper struct {
	e    *env
	plan eval.Plan
	rows []eval.Row // the rows to walk through, in order
	all  []eval.Row // the dataset, for jumps

	lines chan string // the user's input, line by line

	mu       sync.Mutex
	row      int  // the row running
	turn     int  // its LLM calls so far
	stepping bool // stop before the next call
	jumpTo   int  // the row to run next after a jump; -1 none
	quit     bool
	cancel   context.CancelFunc
}

const stepPrompt = "[n]ext turn  [c]ontinue  [m]essages  [t]ools  [j]ump ROW  [q]uit > "

func (s *stepper) run(ctx context.Context) error {
	s.lines = make(chan string)
	go func() {
		sc := bufio.NewScanner(s.e.stdin)
		for sc.Scan() {
			s.lines <- strings.TrimSpace(sc.Text())
		}
		close(s.lines)
	}()
	s.plan.BeforeCall = s.beforeCall
	s.plan.OnResult = func(r eval.Result) { printResult(s.e.stdout, r) }
	queue := append([]eval.Row(nil), s.rows...)
	for first := true; len(queue) > 0; first = false {
		row := queue[0]
		queue = queue[1:]
		rowCtx, cancel := context.WithCancel(ctx)
		s.mu.Lock()
		s.row, s.turn, s.stepping, s.jumpTo, s.cancel = row.Index, 0, true, -1, cancel
		s.mu.Unlock()
		fmt.Fprintf(s.e.stdout, "\n▶ row %d: %s\n", row.Index, promptOf(row))
		plan := s.plan
		plan.Rows = []eval.Row{row}
		plan.SkipChecks = !first
		_, err := eval.Run(rowCtx, plan)
		cancel()
		s.mu.Lock()
		quit, jump := s.quit, s.jumpTo
		s.mu.Unlock()
		switch {
		case quit || ctx.Err() != nil:
			fmt.Fprintln(s.e.stdout, "quit")
			return nil
		case jump >= 0:
			queue = append([]eval.Row{s.all[jump]}, queue...)
			continue
		case err != nil && !errors.Is(err, eval.ErrInterrupted):
			return reportEnd(s.e, nil, err, nil, false)
		}
	}
	fmt.Fprintln(s.e.stdout, "\nno more rows")
	return nil
}

func promptOf(row eval.Row) string {
	for _, m := range row.Messages {
		if m["role"] == "user" {
			return messageLine(m)
		}
	}
	return ""
}

// beforeCall holds an LLM call of the running row until the user lets it
// go.
func (s *stepper) beforeCall(ctx context.Context, _ string, body map[string]any) error {
	s.mu.Lock()
	s.turn++
	turn, stepping, row := s.turn, s.stepping, s.row
	s.mu.Unlock()
	if !stepping {
		return nil
	}
	msgs, _ := body["messages"].([]any)
	last := ""
	if n := len(msgs); n > 0 {
		if m, ok := msgs[n-1].(map[string]any); ok {
			last = fmt.Sprintf("%v: %s", m["role"], messageLine(m))
		}
	}
	fmt.Fprintf(s.e.stdout, "row %d, turn %d: the agent asks the model, %d messages so far; last %s\n", row, turn, len(msgs), last)
	for {
		fmt.Fprint(s.e.stdout, stepPrompt)
		var line string
		var ok bool
		select {
		case <-ctx.Done():
			return ctx.Err()
		case line, ok = <-s.lines:
		}
		if !ok {
			line = "q" // input closed: nothing more to step with
		}
		cmd, arg, _ := strings.Cut(line, " ")
		switch cmd {
		case "", "n", "next":
			return nil
		case "c", "continue":
			s.mu.Lock()
			s.stepping = false
			s.mu.Unlock()
			return nil
		case "m", "messages":
			for i, m := range msgs {
				if mm, ok := m.(map[string]any); ok {
					fmt.Fprintf(s.e.stdout, "  %d. %-10s %s\n", i+1, fmt.Sprint(mm["role"])+":", messageLine(mm))
				}
			}
		case "t", "tools":
			tools, _ := body["tools"].([]any)
			if len(tools) == 0 {
				fmt.Fprintln(s.e.stdout, "  no tools offered")
			}
			for _, t := range tools {
				tm, _ := t.(map[string]any)
				fn, _ := tm["function"].(map[string]any)
				fmt.Fprintf(s.e.stdout, "  %v: %v\n", fn["name"], fn["description"])
			}
		case "j", "jump":
			n, err := strconv.Atoi(strings.TrimSpace(arg))
			if err != nil || n < 0 || n >= len(s.all) {
				fmt.Fprintf(s.e.stdout, "  jump to which row? 0-%d\n", len(s.all)-1)
				continue
			}
			s.mu.Lock()
			s.jumpTo = n
			s.cancel()
			s.mu.Unlock()
			return errors.New("jumped to another row")
		case "q", "quit":
			s.mu.Lock()
			s.quit = true
			s.cancel()
			s.mu.Unlock()
			return errors.New("quit")
		default:
			fmt.Fprintln(s.e.stdout, "  unknown command")
		}
	}
}
