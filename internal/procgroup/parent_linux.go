package procgroup

import "syscall"

// dieWithParent asks for SIGKILL when the thread that started the process
// exits. The Go runtime keeps its threads for the life of the process
// (none started a child while locked to a goroutine that ends), so in
// practice that is osmo's death.
func dieWithParent(a *syscall.SysProcAttr) { a.Pdeathsig = syscall.SIGKILL }
