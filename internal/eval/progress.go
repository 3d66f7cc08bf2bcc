package eval

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// progress shows how a run is going: on a terminal a bar redrawn in place
// (done/total, rate, ETA, running pass rate and mean reward, errors),
// elsewhere a plain line every few seconds.
type progress struct {
	w         io.Writer
	live      bool
	total     int
	threshold float64
	start     time.Time

	mu                                   sync.Mutex
	done, passed, scored, graded, failed int
	rewardSum                            float64
	lastLine                             time.Time
	stop, stopped                        chan struct{}
}

// plainEvery is how often a non-terminal gets a progress line.
const plainEvery = 5 * time.Second

func newProgress(w io.Writer, live bool, total int, threshold float64) *progress {
	p := &progress{w: w, live: live, total: total, threshold: threshold, start: time.Now(), stop: make(chan struct{}), stopped: make(chan struct{})}
	if w == nil {
		close(p.stopped)
		return p
	}
	go p.tick()
	return p
}

// tick redraws the bar (or prints a line) while the run lasts, so the
// rate and ETA move even when no result arrives.
func (p *progress) tick() {
	defer close(p.stopped)
	every := plainEvery
	if p.live {
		every = 200 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			p.mu.Lock()
			p.draw(false)
			p.mu.Unlock()
		}
	}
}

func (p *progress) add(r Result) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	if r.Status == StatusFailed {
		p.failed++
	}
	if r.Status != StatusSkipped {
		p.scored++
	}
	if r.Reward != nil {
		p.graded++
		p.rewardSum += *r.Reward
		if *r.Reward >= p.threshold {
			p.passed++
		}
	}
	if p.live {
		p.draw(false)
	}
}

// finish stops the display and leaves its last state on screen.
func (p *progress) finish() {
	if p.w == nil {
		return
	}
	close(p.stop)
	<-p.stopped
	p.mu.Lock()
	defer p.mu.Unlock()
	p.draw(true)
}

// draw writes the current state. Caller holds mu.
func (p *progress) draw(final bool) {
	if p.w == nil || (!p.live && !final && time.Since(p.lastLine) < plainEvery) {
		return
	}
	p.lastLine = time.Now()
	elapsed := time.Since(p.start)
	rate := float64(p.done) / max(elapsed.Seconds(), 1e-9)
	eta := "-"
	if p.done > 0 && p.done < p.total {
		eta = time.Duration(float64(p.total-p.done) / rate * float64(time.Second)).Round(time.Second).String()
	}
	stats := fmt.Sprintf("%d/%d  %.1f/s  ETA %s  pass %s  mean %s  errors %d",
		p.done, p.total, rate, eta, ratio(p.passed, p.scored), mean(p.rewardSum, p.graded), p.failed)
	if !p.live {
		fmt.Fprintln(p.w, "eval:", stats)
		return
	}
	const width = 24
	filled := 0
	if p.total > 0 {
		filled = width * p.done / p.total
	}
	bar := strings.Repeat("█", filled) + strings.Repeat("░", width-filled)
	end := ""
	if final {
		end = "\n"
	}
	// \r and the erase-line sequence redraw the bar in place.
	fmt.Fprintf(p.w, "\r\x1b[2K%s %s%s", bar, stats, end)
}

func ratio(a, b int) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(a)/float64(b))
}

func mean(sum float64, n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprintf("%.3g", sum/float64(n))
}
