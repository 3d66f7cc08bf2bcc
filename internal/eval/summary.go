package eval

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strconv"
	"text/tabwriter"
)

// Summary is summary.json: the Osmosis platform's summary of an eval
// (its counts, pass rate and tokens, computed as it computes them), and
// osmo's additions.
type Summary struct {
	TotalSamples     int     `json:"total_samples"`
	CompletedSamples int     `json:"completed_samples"`
	Graded           int     `json:"graded"`
	Passed           int     `json:"passed"`
	Failed           int     `json:"failed"`
	Skipped          int     `json:"skipped"`
	PassRate         float64 `json:"pass_rate"`
	PassThreshold    float64 `json:"pass_threshold"`
	TokensUsed       int     `json:"tokens_used"`

	// MeanReward is the mean over the graded samples; nil with none.
	MeanReward *float64 `json:"mean_reward"`
	// PassAtK is the unbiased pass@k estimator for k = 1..n, averaged over
	// the rows with at least k scored attempts.
	PassAtK map[string]float64 `json:"pass_at_k"`
	// ErrorsByCategory counts the failures by err_category.
	ErrorsByCategory map[string]int `json:"errors_by_category"`
	// WallS is how long this invocation ran.
	WallS float64 `json:"wall_s"`
}

// Summarize computes the summary of results, n runs per row. As the
// platform does: a skipped sample is out of every rate; a failed one is a
// non-pass (dropping it would report the pass rate of the rows that
// worked); graded counts the samples with a reward; tokens_used sums each
// sample's tokens.
func Summarize(results []Result, n int, threshold, wallS float64) Summary {
	s := Summary{
		TotalSamples:     len(results),
		PassThreshold:    threshold,
		PassAtK:          map[string]float64{},
		ErrorsByCategory: map[string]int{},
		WallS:            wallS,
	}
	attempts, passes := map[int]int{}, map[int]int{}
	var rewardSum float64
	for _, r := range results {
		s.TokensUsed += r.Tokens
		if r.Status == StatusSkipped {
			s.Skipped++
			continue
		}
		if r.Status == StatusFailure {
			s.Failed++
			s.ErrorsByCategory[cmp.Or(r.ErrCategory, "unknown")]++
		}
		pass := false
		if r.Reward != nil {
			s.Graded++
			rewardSum += *r.Reward
			pass = *r.Reward >= threshold
		}
		if pass {
			s.Passed++
			passes[r.RowIndex]++
		}
		attempts[r.RowIndex]++
	}
	s.CompletedSamples = s.TotalSamples - s.Skipped
	if s.CompletedSamples > 0 {
		s.PassRate = float64(s.Passed) / float64(s.CompletedSamples)
	}
	if s.Graded > 0 {
		mean := rewardSum / float64(s.Graded)
		s.MeanReward = &mean
	}
	for k := 1; k <= n; k++ {
		var sum float64
		rows := 0
		for row, a := range attempts {
			if a >= k {
				sum += PassAtK(a, passes[row], k)
				rows++
			}
		}
		if rows > 0 {
			s.PassAtK[strconv.Itoa(k)] = sum / float64(rows)
		}
	}
	return s
}

// PassAtK is the unbiased estimator of pass@k for a row with n attempts of
// which c passed (Chen et al., 2021): 1 - C(n-c, k) / C(n, k).
func PassAtK(n, c, k int) float64 {
	if n-c < k {
		return 1
	}
	miss := 1.0
	for i := range k {
		miss *= float64(n-c-i) / float64(n-i)
	}
	return 1 - miss
}

// WriteTable prints the summary as a table.
func (s Summary) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(k string, v any) { fmt.Fprintf(tw, "  %s\t%v\n", k, v) }
	row("samples", fmt.Sprintf("%d (%d completed, %d skipped)", s.TotalSamples, s.CompletedSamples, s.Skipped))
	row("passed", fmt.Sprintf("%d of %d (reward >= %g)", s.Passed, s.CompletedSamples, s.PassThreshold))
	row("pass rate", fmt.Sprintf("%.1f%%", 100*s.PassRate))
	mean := "-"
	if s.MeanReward != nil {
		mean = fmt.Sprintf("%.4g over %d graded", *s.MeanReward, s.Graded)
	}
	row("mean reward", mean)
	for _, k := range sortedKeys(s.PassAtK) {
		row("pass@"+k, fmt.Sprintf("%.3f", s.PassAtK[k]))
	}
	row("failed", s.Failed)
	for _, c := range sortedKeys(s.ErrorsByCategory) {
		row("  "+c, s.ErrorsByCategory[c])
	}
	row("tokens used", s.TokensUsed)
	row("wall time", fmt.Sprintf("%.1fs", s.WallS))
	return tw.Flush()
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		// pass@k keys sort as numbers.
		if x, errA := strconv.Atoi(a); errA == nil {
			if y, errB := strconv.Atoi(b); errB == nil {
				return cmp.Compare(x, y)
			}
		}
		return cmp.Compare(a, b)
	})
	return keys
}
