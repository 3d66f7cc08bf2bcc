package llmproxy

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"testing/synctest"
	"time"
)

func testEngines(t *testing.T, n int, c float64) *Engines {
	t.Helper()
	urls := make([]string, n)
	for i := range urls {
		urls[i] = fmt.Sprintf("http://engine-%d:8000/v1", i)
	}
	s, err := NewEngines(EnginesConfig{URLs: urls, LoadFactor: c})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// homes is where each key's first call goes on an idle set.
func homes(s *Engines, keys int) []string {
	out := make([]string, keys)
	for i := range out {
		e, _ := s.acquire(fmt.Sprintf("r%d/s0", i), nil)
		s.release(e, "", false)
		out[i] = e.url
	}
	return out
}

func TestRingSpreadAndStability(t *testing.T) {
	const keys = 20000
	eight := homes(testEngines(t, 8, 0), keys)
	count := map[string]int{}
	for _, u := range eight {
		count[u]++
	}
	if len(count) != 8 {
		t.Fatalf("keys reached %d engines, want 8", len(count))
	}
	for u, n := range count {
		if share := float64(n) / (keys / 8); share < 0.75 || share > 1.25 {
			t.Errorf("%s holds %.2f of its fair share", u, share)
		}
	}

	// A ninth engine takes keys only for itself; the others keep theirs.
	nine := homes(testEngines(t, 9, 0), keys)
	moved := 0
	for i := range nine {
		if nine[i] != eight[i] {
			moved++
			if nine[i] != "http://engine-8:8000/v1" {
				t.Fatalf("key %d moved from %s to %s, not to the new engine", i, eight[i], nine[i])
			}
		}
	}
	if share := float64(moved) / keys; share < 0.07 || share > 0.16 {
		t.Errorf("adding a ninth engine moved %.3f of the keys, want about 1/9", share)
	}

	// Without engine-8 again, only its keys move, each to its next engine,
	// which is where the eight-engine ring had it.
	for i := range nine {
		if nine[i] != "http://engine-8:8000/v1" && nine[i] != eight[i] {
			t.Fatalf("key %d is on %s with nine engines and %s with eight", i, nine[i], eight[i])
		}
	}
}

// TestBoundedLoadUnderSkew holds a steady 200 calls in flight over 8
// engines, drawn from a few hot samples (Zipf) with long and short calls:
// plain hashing would overload the hot samples' engines.
func TestBoundedLoadUnderSkew(t *testing.T) {
	const (
		engines  = 8
		inFlight = 200
		ticks    = 2000
	)
	s := testEngines(t, engines, 1.25)
	rng := rand.New(rand.NewPCG(1, 2))
	zipf := rand.NewZipf(rng, 1.3, 1, 999)
	type call struct {
		e    *engine
		left int
	}
	var calls []call
	unbounded := map[string]int{}
	worst := 0.0
	for tick := range ticks {
		kept := calls[:0]
		for _, c := range calls {
			if c.left--; c.left > 0 {
				kept = append(kept, c)
			} else {
				s.release(c.e, "", false)
			}
		}
		calls = kept
		for len(calls) < inFlight {
			key := fmt.Sprintf("rollout-%d/0", zipf.Uint64())
			e, _ := s.acquire(key, nil)
			if e == nil {
				t.Fatal("no engine")
			}
			long := 1 + rng.IntN(3)
			if rng.IntN(10) == 0 {
				long = 20 + rng.IntN(20)
			}
			calls = append(calls, call{e, long})
		}
		var total, most int64
		for _, e := range s.engines {
			n := e.inFlight.Load()
			total += n
			most = max(most, n)
		}
		if total != inFlight {
			t.Fatalf("tick %d: %d in flight, want %d", tick, total, inFlight)
		}
		ratio := float64(most) / (float64(total) / engines)
		worst = max(worst, ratio)
		if ratio > 1.3 {
			t.Fatalf("tick %d: max/mean load %.3f > 1.3", tick, ratio)
		}
	}
	// The same draws by hash alone, to show the load is skewed.
	for range 20000 {
		key := fmt.Sprintf("rollout-%d/0", zipf.Uint64())
		h := s.ring[searchRing(s.ring, key)].e.url
		unbounded[h]++
	}
	most := 0
	for _, n := range unbounded {
		most = max(most, n)
	}
	if skew := float64(most) / (20000.0 / engines); skew < 1.5 {
		t.Fatalf("the load is not skewed: plain hashing gives max/mean %.2f", skew)
	}
	t.Logf("max/mean load at worst %.3f", worst)
}

func TestAcquireAvoidsTriedAndDownEngines(t *testing.T) {
	s := testEngines(t, 3, 0)
	key := "r/s"
	first, _ := s.acquire(key, nil)
	s.release(first, attemptHTTP5xx, false)
	second, _ := s.acquire(key, []*engine{first})
	if second == first {
		t.Fatal("the retry went to the engine that failed")
	}
	s.release(second, "", false)
	// A refused connection takes the engine out at once.
	s.release(func() *engine { e, _ := s.acquire(key, nil); return e }(), attemptTransport, true)
	down := 0
	for _, e := range s.engines {
		if !e.up.Load() {
			down++
		}
	}
	if down != 1 {
		t.Fatalf("%d engines down after a refused connection, want 1", down)
	}
	for range 100 {
		e, _ := s.acquire(fmt.Sprint(rand.Int()), nil)
		if !e.up.Load() {
			t.Fatal("a call went to an engine that is down")
		}
		s.release(e, "", false)
	}
	// Every engine tried: the call still goes somewhere up.
	all := []*engine{}
	for _, e := range s.engines {
		all = append(all, e)
	}
	e, _ := s.acquire(key, all)
	if e == nil || !e.up.Load() {
		t.Fatalf("with every engine tried, got %v", e)
	}
}

// TestLingerHoldsTheSampleSlot: an answered call's slot stays counted for
// Linger, the sample's next call takes it back, and then it is given back.
func TestLingerHoldsTheSampleSlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := NewEngines(EnginesConfig{URLs: []string{"http://a:1/v1", "http://b:1/v1"}, Linger: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		load := func() (n int64) {
			for _, e := range s.engines {
				n += e.inFlight.Load()
			}
			return n
		}
		e, first := s.acquire("r/s", nil)
		if first != "" {
			t.Fatalf("a first call has a first engine %q", first)
		}
		s.answered("r/s", e)
		if load() != 1 {
			t.Fatalf("load %d after an answered call, want its held slot", load())
		}
		time.Sleep(500 * time.Millisecond)
		again, first := s.acquire("r/s", nil)
		if again != e || first != e.url || load() != 1 {
			t.Fatalf("the next call went to %v (first %q), load %d", again.url, first, load())
		}
		s.answered("r/s", again)
		time.Sleep(999 * time.Millisecond)
		if load() != 1 {
			t.Fatalf("load %d before the linger ends", load())
		}
		time.Sleep(2 * time.Millisecond)
		synctest.Wait()
		if load() != 0 {
			t.Fatalf("load %d after the linger, want 0", load())
		}
		// A forgotten sample gives its slot back too.
		e, _ = s.acquire("r/t", nil)
		s.answered("r/t", e)
		s.samples.Purge()
		if load() != 0 {
			t.Fatalf("load %d after the samples were forgotten", load())
		}
	})
}
