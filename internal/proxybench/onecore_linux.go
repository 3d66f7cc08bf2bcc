package proxybench

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

func oneCoreUnsupported() string { return "" }

// pinBench reserves the last CPU this process may use for the proxies and
// moves every thread of this process to the others (when there are at
// least two; with one, everything shares it).
func pinBench() (benchPin, error) {
	var orig unix.CPUSet
	if err := unix.SchedGetaffinity(0, &orig); err != nil {
		return benchPin{}, err
	}
	var cpus []int
	for c := range 1024 { // the CPUs a CPUSet can hold
		if orig.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	if len(cpus) == 0 {
		return benchPin{}, errors.New("this process may run on no CPU")
	}
	proxyCPU := cpus[len(cpus)-1]
	var proxySet unix.CPUSet
	proxySet.Set(proxyCPU)
	bench := orig
	pin := benchPin{proxyCPU: proxyCPU, benchCPUs: cpus, restore: func() {}}
	if len(cpus) >= 2 {
		bench.Clear(proxyCPU)
		if err := setThreadsAffinity(os.Getpid(), &bench); err != nil {
			_ = setThreadsAffinity(os.Getpid(), &orig)
			return benchPin{}, err
		}
		pin.benchCPUs = cpus[:len(cpus)-1]
		pin.restore = func() { _ = setThreadsAffinity(os.Getpid(), &orig) }
	}
	pin.start = func(cmd *exec.Cmd) error { return startPinned(cmd, &proxySet, &bench) }
	return pin, nil
}

// setThreadsAffinity sets the affinity of every thread of process pid. A
// thread inherits its creator's, so once a listing of the threads shows no
// thread not yet set, threads created later get set too.
func setThreadsAffinity(pid int, set *unix.CPUSet) error {
	done := map[int]bool{}
	for range 100 {
		tids, err := threads(pid)
		if err != nil {
			return err
		}
		fresh := false
		for _, tid := range tids {
			if done[tid] {
				continue
			}
			fresh = true
			if err := unix.SchedSetaffinity(tid, set); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("sched_setaffinity thread %d: %w", tid, err)
			}
			done[tid] = true
		}
		if !fresh {
			return nil
		}
	}
	return fmt.Errorf("process %d kept starting threads", pid)
}

func threads(pid int) ([]int, error) {
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return nil, err
	}
	tids := make([]int, 0, len(ents))
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// startPinned starts cmd on the CPUs of proxySet from its first
// instruction: it forks from a thread whose affinity is proxySet for the
// moment, and the child inherits it. The forking thread then returns to
// benchSet. The child is killed if this process dies.
func startPinned(cmd *exec.Cmd, proxySet, benchSet *unix.CPUSet) error {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	errc := make(chan error, 1)
	// A goroutine of its own: if the thread cannot be given back its
	// affinity, the goroutine ends locked to it and the runtime retires
	// the thread (and Pdeathsig kills the child).
	go func() {
		runtime.LockOSThread()
		if err := unix.SchedSetaffinity(0, proxySet); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("sched_setaffinity: %w", err)
			return
		}
		startErr := cmd.Start()
		if err := unix.SchedSetaffinity(0, benchSet); err != nil {
			if startErr == nil {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
			}
			errc <- fmt.Errorf("sched_setaffinity: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- startErr
	}()
	if err := <-errc; err != nil {
		return err
	}
	// The child inherited the mask; setting it on its threads again costs
	// nothing and holds even if something moved them in between.
	if err := setThreadsAffinity(cmd.Process.Pid, proxySet); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return err
	}
	return nil
}

// checkPinned reports threads of process pid that may run elsewhere than
// on cpu.
func checkPinned(pid, cpu int) error {
	tids, err := threads(pid)
	if err != nil {
		return err
	}
	var stray []string
	for _, tid := range tids {
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(tid, &set); err != nil {
			continue // exited meanwhile
		}
		if set.Count() != 1 || !set.IsSet(cpu) {
			stray = append(stray, strconv.Itoa(tid))
		}
	}
	if len(stray) > 0 {
		return fmt.Errorf("threads %s of %d are not pinned to CPU %d", strings.Join(stray, ","), len(tids), cpu)
	}
	return nil
}
