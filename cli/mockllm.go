package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/osmo-rl/osmo/internal/mockllm"
	"github.com/osmo-rl/osmo/internal/server"
)

func runMockLLM(ctx context.Context, e *env, args []string) error {
	fs := flagSet(e, "mockllm")
	var (
		addr    string
		o       mockllm.Options
		lf      logFlags
		af      addrFile
		downFor time.Duration
	)
	fs.StringVar(&addr, "addr", ":9003", "HTTP listen address")
	af.register(fs)
	fs.StringVar(&o.Model, "model", "mock-policy", "model name reported by /v1/models")
	fs.DurationVar(&o.Latency, "latency", 0, "delay before each response (a slow engine)")
	fs.DurationVar(&o.ChunkDelay, "chunk-delay", 0, "delay between SSE chunks")
	fs.StringVar(&o.FailMode, "fail-mode", "", "injected failure: 500, 503, 429, 400 (context length exceeded), hang or malformed")
	fs.IntVar(&o.FailEvery, "fail-every", 0, "fail every Nth request with --fail-mode")
	fs.IntVar(&o.FailFirst, "fail-first", 0, "fail the first N requests with --fail-mode")
	fs.Float64Var(&o.FailFraction, "fail-fraction", 0, "fail this fraction (0 to 1) of requests, drawn at random, with --fail-mode")
	fs.Uint64Var(&o.FailSeed, "fail-seed", 0, "seed of the --fail-fraction draws (the same seed fails the same requests)")
	fs.StringVar(&o.EngineID, "engine-id", "", "name of this engine, sent in the X-Engine-Id header of every answer and in system_fingerprint")
	fs.IntVar(&o.DieAfter, "die-after", 0, "die at the Nth chat request: cut its connection and every open one, close the listener, and exit with status 1 (or come back after --down-for)")
	fs.DurationVar(&downFor, "down-for", 0, "with --die-after: stay down this long, then listen again on the same address as a fresh engine that does not die")
	fs.StringVar(&o.PauseAPI, "pause-api", mockllm.PauseAPIVLLM, "whose pause endpoints to serve: vllm (POST /pause?mode=, POST /resume, GET /is_paused), sglang (POST /pause_generation, POST /continue_generation) or none (404, like a vLLM outside its development mode)")
	lf.register(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	switch {
	case downFor < 0:
		return usagef("--down-for must not be negative, got %v", downFor)
	case downFor > 0 && o.DieAfter == 0:
		return usagef("--down-for needs --die-after: an engine that never dies never comes back")
	}
	log, err := lf.logger(e.stderr)
	if err != nil {
		return err
	}
	o.Logger = log
	if _, err := mockllm.New(o); err != nil {
		return usageError{err.Error()}
	}
	return serveMockEngine(ctx, log, addr, o, downFor, af)
}

// serveMockEngine serves the mock on addr until ctx ends. When the mock
// dies (Options.DieAfter) its listener and every connection are closed at
// once, as when an engine's process is killed; with downFor the engine
// comes back on the same address after that long.
func serveMockEngine(ctx context.Context, log *slog.Logger, addr string, o mockllm.Options, downFor time.Duration, af addrFile) error {
	reg := newMetricsRegistry()
	for first := true; ; first = false {
		h, err := mockllm.New(o)
		if err != nil {
			return err
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("mockllm: %w", err)
		}
		url := "http://" + ln.Addr().String()
		if first {
			log.Info("mock policy serving", "http", url, "base_url", url+"/v1", "engine", o.EngineID)
			if err := af.write("http", url, "base_url", url+"/v1"); err != nil {
				_ = ln.Close()
				return err
			}
		} else {
			log.Info("mock policy back", "http", url, "engine", o.EngineID)
		}
		srv := &http.Server{Handler: withMetrics(h, reg, ""), ReadHeaderTimeout: 10 * time.Second}
		errc := make(chan error, 1)
		go func() { errc <- srv.Serve(ln) }()
		select {
		case <-ctx.Done():
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), server.ShutdownTimeout)
			err := srv.Shutdown(sctx)
			cancel()
			if err != nil {
				_ = srv.Close()
			}
			<-errc
			return nil
		case err := <-errc:
			if errors.Is(err, http.ErrServerClosed) {
				return nil
			}
			return fmt.Errorf("mockllm: %w", err)
		case <-h.Dead():
			_ = srv.Close()
			<-errc
		}
		if downFor == 0 {
			return fmt.Errorf("mockllm: engine %q died at request %d (--die-after)", o.EngineID, o.DieAfter)
		}
		log.Warn("mock policy down", "engine", o.EngineID, "down_for", downFor)
		t := time.NewTimer(downFor)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil
		}
		// Back on the same port, fresh and healthy.
		addr, o.DieAfter = ln.Addr().String(), 0
	}
}
