package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/encoding/protojson"

	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/controller"
	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/server"
)

// runDemo starts the mock policy, the whole stack and a controller of the
// remote-rollout protocol (/v1/rollout/init) on loopback, drives n
// calculator rollouts through it and prints each sample with its reward. It
// needs no network and no keys.
func runDemo(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "demo")
	var (
		n       int
		seed    int64
		verbose bool
		timeout time.Duration
		lf      logFlags
	)
	fs.IntVar(&n, "n", 5, "number of rollouts")
	fs.Int64Var(&seed, "seed", 1, "task generator seed")
	fs.BoolVar(&verbose, "v", false, "print every sample's full record (messages, LLM calls, token ids)")
	fs.DurationVar(&timeout, "timeout", 2*time.Minute, "give up after this long")
	lf.register(fs)
	lf.level = "warn"
	if err := parse(fs, args); err != nil {
		return err
	}
	if n < 1 || n > 10000 {
		return usagef("-n: want 1..10000, got %d", n)
	}
	log, err := lf.logger(e.stderr)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	mock, err := mockllm.New(mockllm.Options{Logger: log})
	if err != nil {
		return err
	}
	policy, err := server.NewHTTP("127.0.0.1:0", mock)
	if err != nil {
		return err
	}
	const key = "demo-controller-key"
	ctl, err := controller.New("127.0.0.1:0", controller.Options{PolicyURL: policy.URL() + "/v1", APIKey: key, Logger: log})
	if err != nil {
		return err
	}
	sc, err := localStackConfig(e, "calculator")
	if err != nil {
		return err
	}
	st, err := newStack(ctx, e, log, sc)
	if err != nil {
		return err
	}

	// The stack calls the policy and the controller, so it stops first:
	// as it returns it closes its connections to them, and their own
	// shutdowns then have no client's connection to wait for.
	srvCtx, stopServers := context.WithCancel(ctx)
	defer stopServers()
	stackCtx, stopStack := context.WithCancel(srvCtx)
	defer stopStack()
	var servers, stack errgroup.Group
	servers.Go(func() error { return policy.Serve(srvCtx) })
	servers.Go(func() error { return ctl.Serve(srvCtx) })
	stack.Go(func() error { return st.run(stackCtx) })
	defer func() {
		stopStack()
		_ = stack.Wait()
		stopServers()
		_ = servers.Wait()
	}()

	fmt.Fprintf(e.stdout, "osmo demo: %d calculator rollouts via POST %s/v1/rollout/init (mock policy at %s)\n\n", n, st.http.URL(), policy.URL())
	tasks := mockllm.CalculatorTasks(n, seed)
	ids := make([]string, n)
	for i, task := range tasks {
		ids[i] = fmt.Sprintf("demo-%d-%03d", seed, i)
		code, body, err := ctl.Init(ctx, st.http.URL(), "", controller.InitRequest{
			RolloutID: ids[i],
			Messages: []map[string]any{
				{"role": "system", "content": "You are a calculator. Use the tools, then answer with '#### <number>'."},
				{"role": "user", "content": task.Prompt},
			},
			CompletionParams: map[string]any{"temperature": 1.0, "max_tokens": 512, "logprobs": true, "return_token_ids": true},
			Metadata:         map[string]any{"ground_truth": task.Answer},
		})
		if err != nil {
			return fmt.Errorf("init %s: %w", ids[i], err)
		}
		if code != http.StatusAccepted {
			return fmt.Errorf("init %s: HTTP %d: %s", ids[i], code, body)
		}
	}

	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ROLLOUT\tSTATUS\tREWARD\tLLM CALLS\tTOOL CALLS\tTOKENS (prompt/completion)\tTASK\tFINAL ANSWER")
	rewarded := 0
	for i, id := range ids {
		comp, err := ctl.Wait(ctx, id)
		if err != nil {
			return err
		}
		reward := "-"
		if comp.Reward != nil {
			reward = fmt.Sprintf("%.1f", *comp.Reward)
			if *comp.Reward == 1 {
				rewarded++
			}
		}
		answer := lastContent(comp.FinalMessages)
		if comp.Status != "COMPLETED" {
			answer = "error: " + comp.ErrorMessage
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%v\t%v/%v\t%s\t%s\n", id, comp.Status, reward,
			comp.Metrics["num_llm_calls"], comp.Metrics["num_tool_calls"], comp.Metrics["prompt_tokens"], comp.Metrics["response_tokens"],
			tasks[i].Prompt, strings.ReplaceAll(answer, "\n", " "))
	}
	_ = tw.Flush()
	fmt.Fprintf(e.stdout, "\n%d/%d rollouts rewarded 1.0; every sample is at GET %s/v1/rollouts/{rollout_id}\n", rewarded, n, st.http.URL())

	// Show one sample: the record GET /v1/rollouts/{id} returns.
	rec, err := st.rolloutSvc.GetRollout(ctx, &rolloutv1.GetRolloutRequest{RolloutId: ids[0]})
	if err != nil {
		return err
	}
	if verbose {
		out, _ := protojson.MarshalOptions{Multiline: true, UseProtoNames: true}.Marshal(rec)
		fmt.Fprintf(e.stdout, "\nGET /v1/rollouts/%s:\n%s\n", ids[0], out)
	} else {
		printSample(e.stdout, rec)
	}
	if rewarded != n {
		return fmt.Errorf("demo: %d of %d rollouts were not rewarded 1.0", n-rewarded, n)
	}
	return nil
}

// printSample prints a rollout's sample as a transcript and its recorded LLM
// calls one per line.
func printSample(w io.Writer, rec *rolloutv1.Rollout) {
	for _, s := range rec.GetSamples() {
		fmt.Fprintf(w, "\nSample %q of %s (reward %v; full record: osmo demo -v, or GET /v1/rollouts/%s):\n", s.GetId(), rec.GetRolloutId(), s.GetReward(), rec.GetRolloutId())
		for _, m := range s.GetMessages() {
			msg := m.AsMap()
			fmt.Fprintf(w, "  %-9s %s\n", msg["role"], messageLine(msg))
		}
		fmt.Fprintln(w, "  recorded LLM calls:")
		for i, c := range s.GetLlmCalls() {
			fmt.Fprintf(w, "  %d. %s finish=%s tokens=%d/%d prompt_token_ids=%d completion_token_ids=%d logprobs=%d latency=%.2fms\n",
				i+1, c.GetModel(), c.GetFinishReason(), c.GetUsage().GetPromptTokens(), c.GetUsage().GetCompletionTokens(),
				len(c.GetPromptTokenIds()), len(c.GetCompletionTokenIds()), len(c.GetLogprobs()), c.GetLatencyMs())
		}
	}
}

func lastContent(msgs []map[string]any) string {
	for i := len(msgs) - 1; i >= 0; i-- {
		if s, ok := msgs[i]["content"].(string); ok && msgs[i]["role"] == "assistant" {
			return s
		}
	}
	return ""
}
