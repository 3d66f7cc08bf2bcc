//go:build unix && !linux

package procgroup

import "syscall"

// dieWithParent does nothing where the kernel has no parent-death signal:
// there a process outlives a SIGKILLed osmo.
func dieWithParent(*syscall.SysProcAttr) {}
