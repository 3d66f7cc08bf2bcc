// Package benchproc runs the processes `osmo bench` measures: each started
// with the tail of its output kept, polled until it is ready, and stopped
// with SIGTERM, then SIGKILL after a grace.
package benchproc

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// Proc is a started process.
type Proc struct {
	Name string
	cmd  *exec.Cmd
	out  tailBuffer
	done chan struct{} // closed once it has exited and was waited for
}

// Start starts cmd through start (cmd.Start, or one that pins it to a CPU
// first) with its output kept for Output. Its caller stops it.
func Start(name string, cmd *exec.Cmd, start func(*exec.Cmd) error) (*Proc, error) {
	p := &Proc{Name: name, cmd: cmd, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &p.out, &p.out
	if err := start(cmd); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { _ = cmd.Wait(); close(p.done) }()
	return p, nil
}

// PID is the process's id.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Output is the end of what the process wrote to stdout and stderr.
func (p *Proc) Output() string { return p.out.String() }

func (p *Proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop asks the process to end (SIGTERM), kills it after grace, and waits
// for it; it reports whether SIGTERM was enough (or it had ended before).
func (p *Proc) Stop(grace time.Duration) bool {
	if p.exited() {
		return true
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		_ = p.cmd.Process.Kill()
		<-p.done
		return false
	}
}

// StopAll stops procs at once (nil ones are skipped): each waits for
// nothing the others hold.
func StopAll(procs []*Proc, grace time.Duration) {
	var wg sync.WaitGroup
	for _, p := range procs {
		if p != nil {
			wg.Go(func() { p.Stop(grace) })
		}
	}
	wg.Wait()
}

// Wait polls ready until it holds, the process ends or ctx does; notReady
// says what did not happen.
func (p *Proc) Wait(ctx context.Context, notReady string, ready func(context.Context) bool) error {
	for !ready(ctx) {
		if p.exited() {
			return p.failed(nil)
		}
		select {
		case <-ctx.Done():
			return p.failed(fmt.Errorf("%s: %w", notReady, context.Cause(ctx)))
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

// WaitHTTP polls GET url until it answers status (any status when 0), the
// process ends or ctx does.
func (p *Proc) WaitHTTP(ctx context.Context, url string, status int) error {
	client := &http.Client{Timeout: time.Second}
	defer client.CloseIdleConnections()
	return p.Wait(ctx, url+" did not answer", func(ctx context.Context) bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false
		}
		resp, err := client.Do(req)
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return status == 0 || resp.StatusCode == status
	})
}

// failed describes a process that did not become ready.
func (p *Proc) failed(err error) error {
	if p.exited() {
		err = fmt.Errorf("exited (%s)", p.cmd.ProcessState)
	}
	return fmt.Errorf("%s: %w; its output ends:\n%s", p.Name, err, p.Output())
}

// FreeAddrs are n distinct addresses on ip nothing listens on now: each
// is held until all are chosen, so none is handed out twice.
func FreeAddrs(ip string, n int) ([]string, error) {
	var addrs []string
	for range n {
		ln, err := net.Listen("tcp", ip+":0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		addrs = append(addrs, ln.Addr().String())
	}
	return addrs, nil
}

// FreeAddr is a loopback address nothing listens on now.
func FreeAddr() (string, error) {
	addrs, err := FreeAddrs("127.0.0.1", 1)
	if err != nil {
		return "", err
	}
	return addrs[0], nil
}

// tailBuffer keeps the last 4 KiB written to it: enough to say why a
// process failed, bounded however long it logs.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

const tailKeep = 4 << 10

func (t *tailBuffer) Write(b []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, b...)
	if len(t.buf) > 2*tailKeep {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-tailKeep:]...)
	}
	return len(b), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(bytes.TrimSpace(t.buf[max(len(t.buf)-tailKeep, 0):]))
}
