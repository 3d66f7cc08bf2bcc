package rolloutbench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// proc is a child process of the cluster, its output kept for errors.
type proc struct {
	name string
	cmd  *exec.Cmd
	out  *tailBuffer
	done chan struct{}
}

// startProc starts cmd; its caller stops it.
func startProc(name string, cmd *exec.Cmd) (*proc, error) {
	p := &proc{name: name, cmd: cmd, out: &tailBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { _ = cmd.Wait(); close(p.done) }()
	return p, nil
}

// pid is the process's id.
func (p *proc) pid() int { return p.cmd.Process.Pid }

// exited says the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop asks the process to end (SIGTERM), kills it after grace, and
// waits for it.
func (p *proc) stop(grace time.Duration) {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// stopAll stops procs at once: each waits for nothing the others hold.
func stopAll(procs []*proc, grace time.Duration) {
	var wg sync.WaitGroup
	for _, p := range procs {
		if p != nil {
			wg.Go(func() { p.stop(grace) })
		}
	}
	wg.Wait()
}

// failed describes a process that did not become ready.
func (p *proc) failed(err error) error {
	if p.exited() {
		err = fmt.Errorf("exited (%s)", p.cmd.ProcessState)
	}
	return fmt.Errorf("%s: %w; its output ends:\n%s", p.name, err, p.out.String())
}

// waitHTTP polls url until it answers 200, the process ends or ctx does.
func (p *proc) waitHTTP(ctx context.Context, url string) error {
	return p.wait(ctx, url+" did not answer 200", func(ctx context.Context) bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// waitGRPC checks the gRPC health of the server at addr until it is
// SERVING, the process ends or ctx does.
func (p *proc) waitGRPC(ctx context.Context, addr string) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	return p.wait(ctx, addr+" not serving", func(ctx context.Context) bool {
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
}

// wait polls ready until it holds, the process ends or ctx does; notReady
// says what did not happen.
func (p *proc) wait(ctx context.Context, notReady string, ready func(context.Context) bool) error {
	for !ready(ctx) {
		if p.exited() {
			return p.failed(nil)
		}
		select {
		case <-ctx.Done():
			return p.failed(fmt.Errorf("%s: %w", notReady, ctx.Err()))
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

// tailBuffer keeps the last 16 KiB written to it: enough to say why a
// process failed, bounded however long it logs.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

const tailKeep = 16 << 10

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

// sharedPort is a TCP port free on every one of ips now, so that replicas
// listen on ip:port each, as the pods of one Service listen on one port.
func sharedPort(ips ...string) (string, error) {
	for range 50 {
		first, err := net.Listen("tcp", ips[0]+":0")
		if err != nil {
			return "", fmt.Errorf("listen on %s: %w (loopback addresses beyond 127.0.0.1 are needed)", ips[0], err)
		}
		port := portOf(first.Addr().String())
		lns := []net.Listener{first}
		free := true
		for _, ip := range ips[1:] {
			ln, err := net.Listen("tcp", ip+":"+port)
			if err != nil {
				free = false
				break
			}
			lns = append(lns, ln)
		}
		for _, ln := range lns {
			_ = ln.Close()
		}
		if free {
			return port, nil
		}
	}
	return "", fmt.Errorf("no port free on all of %s", strings.Join(ips, ", "))
}

// freeAddrs are n distinct addresses on ip nothing listens on now: each
// is held until all are chosen, so none is handed out twice.
func freeAddrs(ip string, n int) ([]string, error) {
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

// freeAddr is a loopback address nothing listens on now.
func freeAddr() (string, error) {
	addrs, err := freeAddrs("127.0.0.1", 1)
	if err != nil {
		return "", err
	}
	return addrs[0], nil
}

// portOf is the port of a host:port.
func portOf(addr string) string { return addr[strings.LastIndexByte(addr, ':')+1:] }
