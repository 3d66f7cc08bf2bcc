package procgroup

import (
	"errors"
	"os/exec"

	"golang.org/x/sys/unix"
)

// waitLeader waits for cmd's process to exit without reaping it, calls
// beforeReap while the zombie still holds its pid, then reaps it.
func waitLeader(cmd *exec.Cmd, beforeReap func()) error {
	var info unix.Siginfo
	for {
		err := unix.Waitid(unix.P_PID, cmd.Process.Pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	beforeReap()
	return cmd.Wait()
}
