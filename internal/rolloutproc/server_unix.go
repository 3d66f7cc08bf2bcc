//go:build unix

package rolloutproc

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/osmo-rl/osmo/internal/procgroup"
)

// Server is a started rollout server.
type Server struct {
	url      string
	instance string
	pid      int
	group    *procgroup.Group
	grace    time.Duration
	log      *slog.Logger
	tempRoot string
	out      *lineWriter
	done     chan struct{}
	stopOnce sync.Once

	err error // set before done closes
}

// Start starts the server and returns once GET /health answers 200; when
// it exits first, does not answer within ReadyTimeout, or ctx ends, the
// group is killed and a *StartError returned. The server runs until Stop
// or ctx ends.
func Start(ctx context.Context, s Spec) (*Server, error) {
	s.Entrypoint = cmp.Or(s.Entrypoint, DefaultEntrypoint)
	if s.ReadyTimeout <= 0 {
		s.ReadyTimeout = DefaultReadyTimeout
	}
	if s.StopGrace <= 0 {
		s.StopGrace = DefaultStopGrace
	}
	log := cmp.Or(s.Logger, slog.Default())
	dir, err := filepath.Abs(s.Dir)
	if err != nil {
		return nil, &StartError{Reason: "rollout directory", Err: err}
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return nil, &StartError{Reason: "rollout directory " + s.Dir, Err: cmp.Or(err, errors.New("not a directory"))}
	}
	if fi, err := os.Stat(filepath.Join(dir, s.Entrypoint)); err != nil || fi.IsDir() {
		return nil, &StartError{Reason: "entrypoint " + filepath.Join(s.Dir, s.Entrypoint), Err: cmp.Or(err, errors.New("is a directory"))}
	}
	for k := range s.Env {
		if strings.HasPrefix(k, "_OSMOSIS_") || k == "PYTHONUNBUFFERED" {
			return nil, &StartError{Reason: "environment", Err: fmt.Errorf("%s is set by the supervisor and may not come from the config", k)}
		}
	}
	out := newLineWriter(s.Output, s.Secrets)

	argv, err := command(ctx, dir, s.Entrypoint, out, log)
	if err != nil {
		return nil, &StartError{Reason: "uv sync failed", Err: err, Tail: out.tail()}
	}
	port, err := freePort()
	if err != nil {
		return nil, &StartError{Reason: "pick a port", Err: err}
	}
	srv := &Server{
		url:      "http://127.0.0.1:" + strconv.Itoa(port),
		instance: rand.Text(),
		grace:    s.StopGrace,
		out:      out,
		done:     make(chan struct{}),
	}
	root := s.ArtifactRoot
	if root == "" {
		if root, err = os.MkdirTemp("", "osmo-rollout-artifacts-"); err != nil {
			return nil, &StartError{Reason: "artifact root", Err: err}
		}
		srv.tempRoot = root
	}
	env := childEnv(os.Environ(), s.Withhold, s.Env,
		"_OSMOSIS_ROLLOUT_PORT="+strconv.Itoa(port),
		"_OSMOSIS_ROLLOUT_ARTIFACT_ROOT="+root,
		"_OSMOSIS_ROLLOUT_INSTANCE_ID="+srv.instance,
		"PYTHONUNBUFFERED=1",
	)
	pr, pw, err := os.Pipe()
	if err != nil {
		srv.removeRoot()
		return nil, &StartError{Reason: "output pipe", Err: err}
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir, cmd.Env = dir, env
	cmd.Stdout, cmd.Stderr = pw, pw
	cmd.SysProcAttr = procgroup.SysProcAttr()
	err = cmd.Start()
	pw.Close()
	if err != nil {
		pr.Close()
		srv.removeRoot()
		return nil, &StartError{Reason: "start " + strings.Join(argv, " "), Err: err}
	}
	srv.pid = cmd.Process.Pid
	srv.group = procgroup.New(srv.pid)
	srv.log = log.With("rollout_server_pid", srv.pid, "url", srv.url)
	srv.log.Info("rollout server started", "argv", argv, "dir", dir)

	copied := make(chan struct{})
	go func() {
		defer close(copied)
		_, _ = io.Copy(out, pr)
	}()
	go srv.wait(cmd, pr, copied)
	go func() {
		select {
		case <-ctx.Done():
			_ = srv.Stop(context.WithoutCancel(ctx))
		case <-srv.done:
		}
	}()

	if err := srv.waitReady(ctx, s.ReadyTimeout); err != nil {
		_ = srv.Stop(context.WithoutCancel(ctx))
		err.Tail = out.tail()
		return nil, err
	}
	srv.log.Info("rollout server ready")
	return srv, nil
}

// command is the argv that runs the entrypoint, after `uv sync` when uv is
// on PATH.
func command(ctx context.Context, dir, entrypoint string, out *lineWriter, log *slog.Logger) ([]string, error) {
	uv, err := exec.LookPath("uv")
	if err != nil {
		python, perr := exec.LookPath("python3")
		if perr != nil {
			return nil, fmt.Errorf("neither uv nor python3 is on PATH: %w", perr)
		}
		return []string{python, entrypoint}, nil
	}
	sync := exec.CommandContext(ctx, uv, "sync", "--project", dir)
	sync.Dir = dir
	sync.Env = childEnv(os.Environ(), nil, nil)
	var buf bytes.Buffer
	sync.Stdout, sync.Stderr = &buf, &buf
	sync.SysProcAttr = procgroup.SysProcAttr()
	log.Info("rollout server: uv sync", "dir", dir)
	err = sync.Run()
	_, _ = out.Write(buf.Bytes())
	out.flush()
	if err != nil {
		return nil, err
	}
	return []string{uv, "run", "--no-sync", "--project", dir, entrypoint}, nil
}

// childEnv is parent without VIRTUAL_ENV and the withheld variables, then
// extra (in key order), then fixed; os/exec keeps the last duplicate.
func childEnv(parent, withhold []string, extra map[string]string, fixed ...string) []string {
	env := make([]string, 0, len(parent)+len(extra)+len(fixed))
	for _, kv := range parent {
		if k, _, _ := strings.Cut(kv, "="); k != "VIRTUAL_ENV" && !slices.Contains(withhold, k) {
			env = append(env, kv)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(extra)) {
		env = append(env, k+"="+extra[k])
	}
	return append(env, fixed...)
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// wait reaps the process, killing what is left of its group first, and
// records how it ended.
func (s *Server) wait(cmd *exec.Cmd, pr *os.File, copied <-chan struct{}) {
	waitErr := procgroup.WaitLeader(cmd, s.group.Reap)
	// Only a process that left the group can still hold the pipe: it has
	// the grace period.
	select {
	case <-copied:
	case <-time.After(s.grace):
		s.log.Warn("rollout server: output still open after its process group was killed; closing it")
		pr.Close()
		<-copied
	}
	pr.Close()
	s.out.flush()
	terminated, _ := s.group.Signalled()
	st := cmd.ProcessState
	switch {
	case st == nil:
		s.err = fmt.Errorf("rollout server: wait: %w", waitErr)
	case st.Success():
	default:
		e := &ExitError{Code: st.ExitCode(), Stopped: terminated, Tail: s.out.tail()}
		if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			e.Code, e.Signal = -1, unix.SignalName(ws.Signal())
		}
		s.err = e
	}
	s.removeRoot()
	s.log.Info("rollout server exited", "error", s.err, "stopped", terminated)
	close(s.done)
}

func (s *Server) removeRoot() {
	if s.tempRoot != "" {
		_ = os.RemoveAll(s.tempRoot)
	}
}

// waitReady polls /health.
func (s *Server) waitReady(ctx context.Context, timeout time.Duration) *StartError {
	client := &http.Client{Timeout: 5 * time.Second}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(HealthInterval)
	defer tick.Stop()
	for {
		ok, err := s.probe(ctx, client)
		if ok {
			return nil
		}
		if err != nil {
			return &StartError{Reason: "another process answers at " + s.url, Err: err}
		}
		select {
		case <-s.done:
			return &StartError{Reason: "exited before answering /health", Err: s.err}
		case <-ctx.Done():
			return &StartError{Reason: "not ready when the start was abandoned", Err: ctx.Err()}
		case <-deadline.C:
			return &StartError{Reason: fmt.Sprintf("GET /health did not answer 200 within %s", timeout)}
		case <-tick.C:
		}
	}
}

// probe reports whether /health answered 200 for this instance; an error
// means another answered.
func (s *Server) probe(ctx context.Context, client *http.Client) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url+"/health", nil)
	if err != nil {
		return false, nil
	}
	resp, err := client.Do(req)
	if err != nil {
		return false, nil
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return false, nil
	}
	reported := resp.Header.Get(InstanceHeader)
	if reported == "" {
		var h struct {
			InstanceID string `json:"instance_id"`
		}
		_ = json.Unmarshal(body, &h)
		reported = h.InstanceID
	}
	// A server without the SDK's bootstrap names no instance: it is taken
	// as ours (the process is alive and holds the port).
	if reported != "" && reported != s.instance {
		return false, fmt.Errorf("its /health names instance %q, not this one's", reported)
	}
	return true, nil
}

// URL is the server's base URL, http://127.0.0.1:PORT.
func (s *Server) URL() string { return s.url }

// PID is the process's id (its group's id too).
func (s *Server) PID() int { return s.pid }

// InstanceID is the random _OSMOSIS_ROLLOUT_INSTANCE_ID it was given.
func (s *Server) InstanceID() string { return s.instance }

// Done is closed once the process exited and was reaped.
func (s *Server) Done() <-chan struct{} { return s.done }

// Err is how the process exited (nil for status 0, else an *ExitError);
// nil while it runs.
func (s *Server) Err() error {
	select {
	case <-s.done:
		return s.err
	default:
		return nil
	}
}

// Stop sends SIGTERM to the process group and SIGKILL StopGrace later (or
// when ctx ends), and returns once the process was reaped.
func (s *Server) Stop(ctx context.Context) error {
	s.stopOnce.Do(func() {
		go func() {
			if !s.group.Signal(syscall.SIGTERM) {
				return
			}
			t := time.NewTimer(s.grace)
			defer t.Stop()
			select {
			case <-s.done:
				return
			case <-t.C:
			case <-ctx.Done():
			}
			if s.group.Signal(syscall.SIGKILL) {
				s.log.Warn("rollout server did not stop after SIGTERM: sent SIGKILL", "grace", s.grace)
			}
		}()
	})
	select {
	case <-s.done:
		return nil
	case <-ctx.Done():
		// The kill goroutine above sends SIGKILL now; reaping follows.
		s.group.Signal(syscall.SIGKILL)
		<-s.done
		return nil
	}
}
