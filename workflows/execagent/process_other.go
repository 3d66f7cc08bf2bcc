//go:build !unix

package execagent

import (
	"context"
	"errors"
)

// runProcess needs process groups, which only Unix systems have here.
func runProcess(context.Context, procSpec) (*procResult, error) {
	return nil, errors.New("exec workflows need a Unix system (process groups)")
}

// reachable has nothing to check where programs do not run.
func reachable(string, *RunAs) error { return nil }

// processGone cannot tell here: nothing is taken for gone.
func processGone(int) bool { return false }
