package eval

import (
	"cmp"
	_ "embed"
	"encoding/json"
	"fmt"
	"html/template"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

//go:embed report.html.tmpl
var reportTemplate string

var reportPage = template.Must(template.New("report").Funcs(template.FuncMap{
	"pct": func(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) },
	"reward": func(r *float64) string {
		if r == nil {
			return "–"
		}
		return fmt.Sprintf("%.4g", *r)
	},
	"ms": func(f float64) string { return (time.Duration(f) * time.Millisecond).Round(time.Millisecond).String() },
	"json": func(v any) string {
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return fmt.Sprint(v)
		}
		return string(b)
	},
	"content": messageText,
}).Parse(reportTemplate))

// reportData is what the page shows.
type reportData struct {
	Title     string
	Generated string
	Summary   Summary
	PassAtK   []kv
	Rewards   []kv
	Errors    []kv
	Histogram histogram
	Rows      []reportRow
	JaegerURL string
	// TrainingRows is the rows' merge quality; AttemptRows what each
	// attempt's rows are, by rollout id. Both empty with rows off.
	TrainingRows []kv
	AttemptRows  map[string]string
}

type kv struct {
	K string
	V any
}

// reportRow is a dataset row with its runs; Source is its position in the
// dataset file.
type reportRow struct {
	Index, Source int
	Prompt, Label string
	Runs          []Result
	Passed        int
}

// histogram is the rewards in bins, drawn as SVG bars.
type histogram struct {
	Bars          []bar
	Width, Height int
	Empty         bool
}

type bar struct {
	X, Y, W, H, Count, LabelX, CountY int
	Label, Description                string
}

func renderReport(w io.Writer, p Plan, rep *Report) error {
	d := reportData{
		Title:     p.Title,
		Generated: time.Now().UTC().Format(time.RFC3339),
		Summary:   rep.Summary,
		JaegerURL: strings.TrimRight(p.JaegerURL, "/"),
	}
	for _, pt := range rep.Summary.PassAtK {
		d.PassAtK = append(d.PassAtK, kv{fmt.Sprintf("pass@%d", pt.K), fmt.Sprintf("%.3f", pt.Value)})
	}
	if st := rep.Summary.RewardStats; st != nil {
		for _, s := range []kv{{"reward median", st.Median}, {"reward std", st.Std}, {"reward min", st.Min}, {"reward max", st.Max}} {
			d.Rewards = append(d.Rewards, kv{s.K, fmt.Sprintf("%.4g", s.V)})
		}
	}
	for _, k := range sortedKeys(rep.Summary.ErrorsByCategory) {
		d.Errors = append(d.Errors, kv{k, rep.Summary.ErrorsByCategory[k]})
	}
	if rs := rep.Summary.Rows; rs != nil {
		d.AttemptRows = rep.rowNotes
		d.TrainingRows = []kv{
			{"merge mode", rs.Merge},
			{"rows", rs.Rows},
			{"rows per sample", fmt.Sprintf("%.2f", rs.RowsPerSample)},
			{"samples with rows", fmt.Sprintf("%d of %d", rs.SamplesWithRows, rs.Samples)},
		}
		for _, k := range sortedKeys(rs.ByMerge) {
			d.TrainingRows = append(d.TrainingRows, kv{"rows " + k, rs.ByMerge[k]})
		}
		for _, k := range sortedKeys(rs.Drift) {
			d.TrainingRows = append(d.TrainingRows, kv{"drift: " + k, rs.Drift[k]})
		}
		d.TrainingRows = append(d.TrainingRows, kv{"samples without tokens", rs.SamplesWithoutTokens})
		for _, k := range sortedKeys(rs.WithoutTokens) {
			d.TrainingRows = append(d.TrainingRows, kv{"· " + k, rs.WithoutTokens[k]})
		}
		if rs.ProblemCalls > 0 {
			d.TrainingRows = append(d.TrainingRows, kv{"calls left out", rs.ProblemCalls})
		}
	}
	byRow := map[int][]Result{}
	var rewards []float64
	for _, r := range rep.Results {
		byRow[r.RowIndex] = append(byRow[r.RowIndex], r)
		if r.Reward != nil {
			rewards = append(rewards, *r.Reward)
		}
	}
	for _, row := range p.Rows {
		runs := byRow[row.Index]
		if len(runs) == 0 {
			continue
		}
		rr := reportRow{Index: row.Index, Source: row.SourceIndex, Runs: runs}
		for _, m := range row.Messages {
			if m["role"] == "user" {
				rr.Prompt = messageText(m)
			}
		}
		if row.Label != nil {
			rr.Label = *row.Label
		}
		for _, r := range runs {
			if r.Reward != nil && *r.Reward >= p.PassThreshold && r.Status == StatusSuccess {
				rr.Passed++
			}
		}
		d.Rows = append(d.Rows, rr)
	}
	d.Histogram = newHistogram(rewards)
	return reportPage.Execute(w, d)
}

// newHistogram bins rewards: ten bins over [0, 1] when every reward is
// there, else over their range.
func newHistogram(rewards []float64) histogram {
	const width, height, bins = 560, 180, 10
	h := histogram{Width: width, Height: height + 40}
	if len(rewards) == 0 {
		h.Empty = true
		return h
	}
	lo, hi := 0.0, 1.0
	for _, r := range rewards {
		lo, hi = math.Min(lo, r), math.Max(hi, r)
	}
	counts := make([]int, bins)
	for _, r := range rewards {
		i := int((r - lo) / (hi - lo) * bins)
		counts[min(max(i, 0), bins-1)]++
	}
	top := 0
	for _, c := range counts {
		top = max(top, c)
	}
	bw := width / bins
	for i, c := range counts {
		bh := 0
		if top > 0 {
			bh = c * height / top
		}
		from := lo + (hi-lo)*float64(i)/bins
		to := lo + (hi-lo)*float64(i+1)/bins
		h.Bars = append(h.Bars, bar{
			X: i*bw + 2, Y: height - bh + 16, W: bw - 4, H: bh,
			Label: fmt.Sprintf("%.2g–%.2g", from, to), Count: c, LabelX: i*bw + bw/2, CountY: height - bh + 12,
			Description: fmt.Sprintf("%d samples with a reward in [%.3g, %.3g%s", c, from, to, map[bool]string{true: "]", false: ")"}[i == bins-1]),
		})
	}
	return h
}

// messageText is a message's content as text, whatever shape it has, or
// the tools it calls when it has none.
func messageText(m map[string]any) string {
	if calls, ok := m["tool_calls"]; ok && m["content"] == nil {
		b, _ := json.Marshal(calls)
		return "tool calls: " + string(b)
	}
	return TextOf(m["content"])
}

// PlatformSummary is the Osmosis platform's summary of an eval, computed
// as the SDK's aggregate_metrics does: metrics.json's summary, and the
// first fields of summary.json.
type PlatformSummary struct {
	TotalSamples int `json:"total_samples"`
	// CompletedSamples, the samples not skipped, is the pass rate's
	// denominator; Graded is the samples with a reward, failed ones
	// included; Passed those whose reward is at least PassThreshold.
	CompletedSamples int     `json:"completed_samples"`
	Graded           int     `json:"graded"`
	Passed           int     `json:"passed"`
	Failed           int     `json:"failed"`
	Skipped          int     `json:"skipped"`
	PassRate         float64 `json:"pass_rate"`
	PassThreshold    float64 `json:"pass_threshold"`
	TokensUsed       int     `json:"tokens_used"`
	// RewardStats is over every reward; absent without one.
	RewardStats *RewardStats `json:"reward_stats,omitempty"`
	// NRuns is the highest run_index + 1; absent below 2.
	NRuns int `json:"n_runs,omitempty"`
	// PassAtK has a point for k = 1, 2, 4, … up to NRuns: pass@k averaged
	// over the rows with at least k scored attempts; absent below two
	// points.
	PassAtK []PassAtKPoint `json:"pass_at_k,omitempty"`
}

// RewardStats describes the rewards; Std is the population standard
// deviation.
type RewardStats struct {
	Mean   float64 `json:"mean"`
	Median float64 `json:"median"`
	Std    float64 `json:"std"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

// PassAtKPoint is pass@k at one k.
type PassAtKPoint struct {
	K     int     `json:"k"`
	Value float64 `json:"value"`
}

// Summary is summary.json: the platform's summary, and osmo's additions.
type Summary struct {
	PlatformSummary

	// MeanReward is the mean over the graded samples; nil with none.
	MeanReward       *float64       `json:"mean_reward"`
	ErrorsByCategory map[string]int `json:"errors_by_category"`
	// WallS sums the wall time, in seconds, of the invocations that ran any
	// of the run's attempts.
	WallS float64 `json:"wall_s"`
	// Rows is the merge quality of the run's training rows; nil when the
	// run has none (rows off).
	Rows *RowsSummary `json:"rows,omitempty"`
}

// Summarize computes the summary of results. As the platform does: a
// skipped sample is out of every rate; a failed one is a non-pass in the
// denominator (dropping it would report the pass rate of the rows that
// worked), and it counts as graded, and passes, if it carries a reward
// that does; tokens_used sums each sample's tokens.
func Summarize(results []Result, threshold, wallS float64) Summary {
	s := Summary{
		PlatformSummary:  PlatformSummary{TotalSamples: len(results), PassThreshold: threshold},
		ErrorsByCategory: map[string]int{},
		WallS:            wallS,
	}
	attempts, passes := map[int]int{}, map[int]int{}
	var rewards []float64
	maxRun := -1
	for _, r := range results {
		maxRun = max(maxRun, r.RunIndex)
		s.TokensUsed += r.Tokens
		if r.Status == StatusSkipped {
			s.Skipped++
			continue
		}
		if r.Status == StatusFailed {
			s.Failed++
			s.ErrorsByCategory[cmp.Or(r.ErrCategory, "unknown")]++
		}
		if r.Reward != nil {
			s.Graded++
			rewards = append(rewards, *r.Reward)
			if *r.Reward >= threshold {
				s.Passed++
				passes[r.RowIndex]++
			}
		}
		attempts[r.RowIndex]++
	}
	s.CompletedSamples = s.TotalSamples - s.Skipped
	if s.CompletedSamples > 0 {
		s.PassRate = float64(s.Passed) / float64(s.CompletedSamples)
	}
	if len(rewards) > 0 {
		s.RewardStats = rewardStats(rewards)
		mean := s.RewardStats.Mean
		s.MeanReward = &mean
	}
	if n := maxRun + 1; n >= 2 {
		s.NRuns = n
		rows := slices.Sorted(maps.Keys(attempts))
		var points []PassAtKPoint
		for k := 1; k <= n; k *= 2 {
			var sum float64
			eligible := 0
			for _, row := range rows {
				if attempts[row] >= k {
					sum += PassAtK(attempts[row], passes[row], k)
					eligible++
				}
			}
			if eligible > 0 {
				points = append(points, PassAtKPoint{K: k, Value: sum / float64(eligible)})
			}
		}
		if len(points) >= 2 {
			s.PassAtK = points
		}
	}
	return s
}

func rewardStats(rewards []float64) *RewardStats {
	sorted := slices.Sorted(slices.Values(rewards))
	var sum float64
	for _, r := range sorted {
		sum += r
	}
	n := len(sorted)
	st := &RewardStats{Mean: sum / float64(n), Min: sorted[0], Max: sorted[n-1]}
	if n%2 == 1 {
		st.Median = sorted[n/2]
	} else {
		st.Median = (sorted[n/2-1] + sorted[n/2]) / 2
	}
	if n > 1 {
		var sq float64
		for _, r := range sorted {
			sq += (r - st.Mean) * (r - st.Mean)
		}
		st.Std = math.Sqrt(sq / float64(n))
	}
	return st
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
	reward := "-"
	if st := s.RewardStats; st != nil {
		reward = fmt.Sprintf("mean %.4g · median %.4g · std %.4g · min %.4g · max %.4g over %d graded", st.Mean, st.Median, st.Std, st.Min, st.Max, s.Graded)
	}
	row("reward", reward)
	if len(s.PassAtK) > 0 {
		parts := make([]string, len(s.PassAtK))
		for i, p := range s.PassAtK {
			parts[i] = fmt.Sprintf("k=%d %.3f", p.K, p.Value)
		}
		row("pass@k", strings.Join(parts, " · "))
	}
	row("failed", s.Failed)
	for _, c := range sortedKeys(s.ErrorsByCategory) {
		row("  "+c, s.ErrorsByCategory[c])
	}
	row("tokens used", s.TokensUsed)
	if rs := s.Rows; rs != nil {
		row("training rows", rs.line())
		if len(rs.Drift) > 0 {
			row("  drift points", countsLine(rs.Drift))
		}
		if rs.SamplesWithoutTokens > 0 {
			row("  samples without tokens", fmt.Sprintf("%d: %s", rs.SamplesWithoutTokens, countsLine(rs.WithoutTokens)))
		}
		if rs.ProblemCalls > 0 {
			row("  calls left out", rs.ProblemCalls)
		}
	}
	row("wall time", fmt.Sprintf("%.1fs", s.WallS))
	return tw.Flush()
}

// line is the rows' count, merge and shape, as the summary prints it.
func (rs *RowsSummary) line() string {
	return fmt.Sprintf("%d (%s) from %d of %d samples, %.2f per sample; %s",
		rs.Rows, rs.Merge, rs.SamplesWithRows, rs.Samples, rs.RowsPerSample, countsLine(rs.ByMerge))
}

// countsLine is "k n · k n" in key order, or "none".
func countsLine(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	parts := make([]string, 0, len(m))
	for _, k := range sortedKeys(m) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, " · ")
}

func sortedKeys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}
