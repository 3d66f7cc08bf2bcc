//go:build unix && !linux

package procgroup

import "os/exec"

// waitLeader reaps cmd's process, then calls beforeReap. Without waitid's
// WNOWAIT the group's final SIGKILL comes just after the reap; the window in
// which the pid could be reused is a few instructions wide.
func waitLeader(cmd *exec.Cmd, beforeReap func()) error {
	err := cmd.Wait()
	beforeReap()
	return err
}
