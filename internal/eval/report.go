package eval

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"html/template"
	"io"
	"math"
	"strings"
	"time"
)

//go:embed report.html.tmpl
var reportTemplate string

var reportPage = template.Must(template.New("report").Funcs(template.FuncMap{
	"pct":    func(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) },
	"reward": formatReward,
	"ms":     func(f float64) string { return (time.Duration(f) * time.Millisecond).Round(time.Millisecond).String() },
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

func formatReward(r *float64) string {
	if r == nil {
		return "–"
	}
	return fmt.Sprintf("%.4g", *r)
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
