//go:build !linux

package proxybench

import (
	"errors"
)

func oneCoreUnsupported() string {
	return "needs Linux, for CPU affinity and per-process CPU time from /proc"
}

var errOneCoreUnsupported = errors.New("not supported on this system")

func pinBench() (benchPin, error) { return benchPin{}, errOneCoreUnsupported }

func checkPinned(int, int) error { return errOneCoreUnsupported }
