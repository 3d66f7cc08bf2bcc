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
		s.answered("r", "r/s", e)
		if load() != 1 {
			t.Fatalf("load %d after an answered call, want its held slot", load())
		}
		time.Sleep(500 * time.Millisecond)
		again, first := s.acquire("r/s", nil)
		if again != e || first != e.url || load() != 1 {
			t.Fatalf("the next call went to %v (first %q), load %d", again.url, first, load())
		}
		s.answered("r", "r/s", again)
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
		s.answered("r", "r/t", e)
		s.samples.Purge()
		if load() != 0 {
			t.Fatalf("load %d after the samples were forgotten", load())
		}
		if len(s.rollouts) != 0 {
			t.Fatalf("rollouts %v left after the samples were forgotten", s.rollouts)
		}
	})
}

// TestHeldSlotIsTakenOverWhateverTheBound: a sample back from between two
// calls keeps its engine even when the engine is at the bound, since its
// slot was counted there all along; on an engine that went down it gives
// the slot up and goes elsewhere.
func TestHeldSlotIsTakenOverWhateverTheBound(t *testing.T) {
	s, err := NewEngines(EnginesConfig{URLs: []string{"http://a:1/v1", "http://b:1/v1"}, LoadFactor: 1, Linger: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	home, _ := s.acquire("r/s", nil)
	s.answered("r", "r/s", home)
	// Two more calls on home: with c = 1 it is far over the mean.
	for range 2 {
		home.inFlight.Add(1)
	}
	again, _ := s.acquire("r/s", nil)
	if again != home || s.Load(home.url) != 3 {
		t.Fatalf("the sample's next call went to %s (home %s), home's load %d, want home at 3", again.url, home.url, s.Load(home.url))
	}
	s.answered("r", "r/s", again)
	s.markDown(home, "test")
	moved, _ := s.acquire("r/s", nil)
	if moved == home || s.Load(home.url) != 2 || s.Load(moved.url) != 1 {
		t.Fatalf("with home down the call went to %s, loads home %d, other %d", moved.url, s.Load(home.url), s.Load(moved.url))
	}
}

// TestForgetGivesTheEndedRolloutsSlotsBack: an ended rollout's samples
// stop counting at once; other rollouts' held slots stay, and samples
// pushed out of the bounded memory leave the index too.
func TestForgetGivesTheEndedRolloutsSlotsBack(t *testing.T) {
	s, err := NewEngines(EnginesConfig{URLs: []string{"http://a:1/v1", "http://b:1/v1"}, Linger: time.Hour, MaxSamples: 3})
	if err != nil {
		t.Fatal(err)
	}
	load := func() (n int64) {
		for _, e := range s.engines {
			n += e.inFlight.Load()
		}
		return n
	}
	for _, k := range []string{"r/s0", "r/s1", "q/s0"} {
		e, _ := s.acquire(k, nil)
		s.answered(k[:1], k, e)
	}
	if load() != 3 {
		t.Fatalf("load %d with three samples between calls, want 3", load())
	}
	s.Forget("r")
	if load() != 1 {
		t.Fatalf("load %d after rollout r ended, want q's slot only", load())
	}
	s.Forget("r")
	s.Forget("unknown")
	if load() != 1 || len(s.rollouts) != 1 || len(s.rollouts["q"]) != 1 {
		t.Fatalf("load %d, index %v after forgetting twice and an unknown rollout", load(), s.rollouts)
	}
	// Four more samples of p: the memory holds three, so q's goes first.
	for i := range 4 {
		k := fmt.Sprintf("p/s%d", i)
		e, _ := s.acquire(k, nil)
		s.answered("p", k, e)
	}
	if load() != 3 || s.rollouts["q"] != nil || len(s.rollouts["p"]) != 3 {
		t.Fatalf("load %d, index %v after the memory overflowed", load(), s.rollouts)
	}
	s.Forget("p")
	if load() != 0 || len(s.rollouts) != 0 || s.samples.Len() != 0 {
		t.Fatalf("load %d, index %v, %d samples remembered after every rollout ended", load(), s.rollouts, s.samples.Len())
	}
}
