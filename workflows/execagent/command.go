package execagent

import (
	"fmt"
	"strings"
)

// SyntaxError is a command line ParseCommand cannot split.
type SyntaxError struct {
	// Offset is the byte offset in the command line of the problem.
	Offset int
	Msg    string
}

func (e *SyntaxError) Error() string {
	return fmt.Sprintf("execagent: command line: %s (at byte %d)", e.Msg, e.Offset)
}

// shellOperators are characters a shell would never pass on as argument
// text when unquoted. No shell runs the command, so finding one means the
// line does not do what it says; it is refused rather than passed through.
const shellOperators = "|&;<>()`"

// ParseCommand splits a command line into words the way a POSIX shell
// splits them, without running a shell: blanks separate words; single quotes
// keep everything literally; double quotes keep everything but \" \\ \$ \`
// and backslash-newline; outside quotes a backslash keeps the next
// character (backslash-newline joins lines). Nothing is expanded: $HOME,
// ~ and * stay as written. Unquoted shell operators (| & ; < > ( ) `) and a
// word starting with # are errors, as are unterminated quotes, a trailing
// backslash and a line with no words. Errors are *SyntaxError.
func ParseCommand(s string) ([]string, error) {
	var (
		words  []string
		word   strings.Builder
		inWord bool
	)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n':
			if inWord {
				words = append(words, word.String())
				word.Reset()
				inWord = false
			}
		case c == '\\':
			if i+1 == len(s) {
				return nil, &SyntaxError{Offset: i, Msg: "trailing backslash escapes nothing"}
			}
			i++
			if s[i] == '\n' {
				continue
			}
			word.WriteByte(s[i])
			inWord = true
		case c == '\'':
			end := strings.IndexByte(s[i+1:], '\'')
			if end < 0 {
				return nil, &SyntaxError{Offset: i, Msg: "unterminated single quote"}
			}
			word.WriteString(s[i+1 : i+1+end])
			i += end + 1
			inWord = true
		case c == '"':
			end, err := doubleQuoted(s, i, &word)
			if err != nil {
				return nil, err
			}
			i = end
			inWord = true
		case strings.IndexByte(shellOperators, c) >= 0:
			return nil, &SyntaxError{Offset: i, Msg: fmt.Sprintf("unquoted %q: the command is not run by a shell; quote it, or run the line with sh -c '...'", c)}
		case c == '#' && !inWord:
			return nil, &SyntaxError{Offset: i, Msg: "unquoted # would start a comment in a shell; quote it"}
		default:
			word.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, word.String())
	}
	if len(words) == 0 {
		return nil, &SyntaxError{Offset: 0, Msg: "empty command"}
	}
	return words, nil
}

// doubleQuoted writes the text of the double-quoted string opening at
// s[open] to w and returns the offset of its closing quote.
func doubleQuoted(s string, open int, w *strings.Builder) (int, error) {
	for i := open + 1; i < len(s); i++ {
		switch c := s[i]; c {
		case '"':
			return i, nil
		case '\\':
			if i+1 < len(s) {
				switch next := s[i+1]; next {
				case '"', '\\', '$', '`':
					w.WriteByte(next)
					i++
					continue
				case '\n':
					i++
					continue
				}
			}
			w.WriteByte(c)
		default:
			w.WriteByte(c)
		}
	}
	return 0, &SyntaxError{Offset: open, Msg: "unterminated double quote"}
}
