package mockllm_test

import (
	"fmt"
	"math"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/workflows/calculator"
)

func TestCalculatorTasks(t *testing.T) {
	tasks := mockllm.CalculatorTasks(40, 7)
	if len(tasks) != 40 {
		t.Fatalf("got %d tasks, want 40", len(tasks))
	}
	if !reflect.DeepEqual(tasks, mockllm.CalculatorTasks(40, 7)) {
		t.Fatal("same seed, different tasks")
	}
	if reflect.DeepEqual(tasks, mockllm.CalculatorTasks(40, 8)) {
		t.Fatal("different seeds, same tasks")
	}
	if mockllm.CalculatorTasks(0, 1) != nil || mockllm.CalculatorTasks(-3, 1) != nil {
		t.Fatal("n <= 0 must give no tasks")
	}
	prompts := map[string]bool{}
	for _, task := range tasks {
		prompts[task.Prompt] = true
	}
	if len(prompts) < 30 {
		t.Fatalf("only %d distinct prompts in 40", len(prompts))
	}

	// Every answer is what the mock reaches through the calculator
	// workflow's own tools, and with no tools at all.
	_, base := start(t, mockllm.Options{})
	toolDefs := make([]any, 0, 2)
	for _, tool := range calculator.Tools() {
		toolDefs = append(toolDefs, map[string]any(tool))
	}
	// The workflow rounds products to 4 decimals; answers must survive it.
	workflowExec := func(t *testing.T, c call) string {
		v := arithmetic(t, c)
		if c.name == "multiply" && strings.Contains(v, ".") {
			var f float64
			fmt.Sscan(v, &f)
			v = fmt.Sprint(math.Round(f*1e4) / 1e4)
		}
		return v
	}
	for _, task := range tasks {
		if task.Answer == "" || strings.Contains(task.Answer, ".") {
			t.Fatalf("task %q has answer %q, want an integer", task.Prompt, task.Answer)
		}
		for _, defs := range [][]any{toolDefs, nil} {
			final, calls := agentLoop(t, base, task.Prompt, defs, workflowExec)
			if !strings.HasSuffix(final, "#### "+task.Answer) {
				t.Fatalf("task %q: final %q, want answer %s", task.Prompt, final, task.Answer)
			}
			if defs != nil && len(calls) == 0 {
				t.Fatalf("task %q used no tools", task.Prompt)
			}
		}
	}
}

func ExampleCalculatorTasks() {
	for _, task := range mockllm.CalculatorTasks(3, 42) {
		fmt.Printf("%s -> %s\n", task.Prompt, task.Answer)
	}
	// Output:
	// What is 10 times 49? -> 490
	// Calculate 19 * (33 + 43). -> 1444
	// What is 46 times 37? -> 1702
}

func ExampleNew() {
	mock, err := mockllm.New(mockllm.Options{Model: "mock-policy"})
	if err != nil {
		panic(err)
	}
	srv := httptest.NewServer(mock)
	defer srv.Close()
	// Point any OpenAI client at srv.URL + "/v1".
	fmt.Println(mock.Requests())
	// Output: 0
}
