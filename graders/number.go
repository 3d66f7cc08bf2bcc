package graders

import (
	"math"
	"regexp"
	"strconv"
	"strings"
	"unicode"
)

// numberPattern is a whole decimal number: optional sign, digits optionally
// grouped by thousands commas, optional fraction, optional exponent.
var numberPattern = regexp.MustCompile(`^[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$`)

// parseNumber parses s (trimmed) as a finite decimal number. Unlike
// strconv.ParseFloat it accepts thousands separators and rejects "inf",
// "nan", hex and underscores, none of which a dataset label means as a number.
func parseNumber(s string) (float64, bool) {
	s = strings.TrimSpace(s)
	if !numberPattern.MatchString(s) {
		return 0, false
	}
	f, err := strconv.ParseFloat(strings.ReplaceAll(s, ",", ""), 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, false
	}
	return f, true
}

// finalAnswer returns the line after the last "####" marker, trimmed, and
// whether there was a marker. Only that line counts, as in the GSM8K
// extraction `####\s*(.+)`: what follows on later lines is commentary.
func finalAnswer(text string) (string, bool) {
	i := strings.LastIndex(text, "####")
	if i < 0 {
		return "", false
	}
	rest := strings.TrimLeft(text[i+len("####"):], " \t\r\n")
	if j := strings.IndexByte(rest, '\n'); j >= 0 {
		rest = rest[:j]
	}
	return strings.TrimSpace(rest), true
}

// numbersIn lists the numbers written in free text, in order: "1,234.5",
// "-3", ".5" and "42." (a sentence's full stop) are numbers; a '-' or '+'
// is a sign only when it does not follow a letter or digit, so "5-3" is
// 5 and 3. A run of digits and commas that is not thousands-grouped
// ("1,2,3") is a list of numbers.
func numbersIn(text string) []float64 {
	var out []float64
	rs := []rune(text)
	for i := 0; i < len(rs); {
		startsNumber := isDigit(rs[i]) || (rs[i] == '.' && i+1 < len(rs) && isDigit(rs[i+1]))
		if !startsNumber {
			i++
			continue
		}
		start := i
		for i < len(rs) && (isDigit(rs[i]) || rs[i] == ',' || rs[i] == '.') {
			i++
		}
		token := strings.TrimRight(string(rs[start:i]), ",.")
		sign := ""
		if start > 0 && (rs[start-1] == '-' || rs[start-1] == '+') &&
			(start == 1 || !isAlnum(rs[start-2])) {
			sign = string(rs[start-1])
		}
		if f, ok := parseNumber(sign + token); ok {
			out = append(out, f)
			continue
		}
		for k, part := range strings.Split(token, ",") {
			if k == 0 {
				part = sign + part
			}
			if f, ok := parseNumber(part); ok {
				out = append(out, f)
			}
		}
	}
	return out
}

func isDigit(r rune) bool { return r >= '0' && r <= '9' }

func isAlnum(r rune) bool { return unicode.IsLetter(r) || unicode.IsDigit(r) }
