package mockllm

import (
	"fmt"
	"math/rand/v2"
)

// Task is one calculator prompt and the answer the mock reaches for it.
type Task struct {
	Prompt string
	Answer string
}

// taskTemplates use only whole numbers, + and * (and one subtraction the
// mock does inline), so every answer is an integer whatever tools run it.
var taskTemplates = []struct {
	format string
	args   int
}{
	{"What is %d * %d + %d?", 3},
	{"Compute (%d + %d) * %d.", 3},
	{"What is %d times %d?", 2},
	{"What is %d plus %d?", 2},
	{"Calculate %d * (%d + %d).", 3},
	{"What is %d + %d * %d?", 3},
	{"What is %d multiplied by %d?", 2},
	{"Compute (%d + %d) * (%d + %d).", 4},
	{"What is %d * %d - %d?", 3},
}

// CalculatorTasks returns n varied arithmetic tasks, the same ones for the
// same seed. Each Answer is what the mock answers after "####" when the task
// runs through it with add and multiply tools (or none), so a demo scores
// 1.0 on every row.
func CalculatorTasks(n int, seed int64) []Task {
	if n <= 0 {
		return nil
	}
	rng := rand.New(rand.NewPCG(uint64(seed), 0x6f736d6f))
	tasks := make([]Task, 0, n)
	for range n {
		t := taskTemplates[rng.IntN(len(taskTemplates))]
		args := make([]any, t.args)
		for i := range args {
			args[i] = 2 + rng.IntN(48)
		}
		prompt := fmt.Sprintf(t.format, args...)
		tasks = append(tasks, Task{Prompt: prompt, Answer: decide(prompt, nil, toolset{}).answer})
	}
	return tasks
}
