package execagent

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Limits bound each run of the program. A zero field takes its default
// (DefaultLimits); Unlimited turns a limit off. See docs/workflows.md
// ("Containment") for what enforces each one where.
//
// The text form, used by `osmo serve --exec-limits` and accepted by the
// config's "limits" as a string, is comma-separated KEY=VALUE pairs:
//
//	memory=512MiB,processes=64,files=1024,cpu=30s,file-size=100MiB,user=65534:65534
//
// The config also takes an object with the same keys.
type Limits struct {
	// Memory is the most memory in bytes the run's processes use together.
	Memory int64
	// Processes is the most processes (and threads) the run holds at once.
	Processes int64
	// Files is the most open files per process (RLIMIT_NOFILE).
	Files int64
	// CPU is the most CPU time per process (RLIMIT_CPU), whole seconds.
	CPU time.Duration
	// FileSize is the largest file a process may write (RLIMIT_FSIZE).
	FileSize int64
	// User, when set, is who the program runs as (osmo must be root).
	User *RunAs
}

// RunAs is a numeric user and group.
type RunAs struct{ UID, GID uint32 }

// Unlimited, as a Limits field, turns that limit off (none, or 0, in the
// text form).
const Unlimited = -1

// DefaultLimits are the limits of a field left zero: enough for Node and
// Python agents with their SDKs, far from what takes a server down. CPU
// time is unlimited by default: the rollout's deadline bounds a run.
func DefaultLimits() Limits {
	return Limits{
		Memory:    2 << 30,
		Processes: 512,
		Files:     4096,
		CPU:       Unlimited,
		FileSize:  1 << 30,
	}
}

// limitKeys are the text form's keys, in the order String writes them.
var limitKeys = []string{"memory", "processes", "files", "cpu", "file-size", "user"}

// ParseLimits reads the text form. Keys left out stay zero (the default).
func ParseLimits(s string) (Limits, error) {
	var l Limits
	if strings.TrimSpace(s) == "" {
		return l, nil
	}
	seen := map[string]bool{}
	for pair := range strings.SplitSeq(s, ",") {
		key, value, ok := strings.Cut(strings.TrimSpace(pair), "=")
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !ok || key == "" {
			return Limits{}, fmt.Errorf("%q is not KEY=VALUE (keys: %s)", pair, strings.Join(limitKeys, ", "))
		}
		if seen[key] {
			return Limits{}, fmt.Errorf("%s: given twice", key)
		}
		seen[key] = true
		if err := l.set(key, value); err != nil {
			return Limits{}, err
		}
	}
	return l, nil
}

// set parses one key's value into l. The error names the key.
func (l *Limits) set(key, value string) error {
	var err error
	switch key {
	case "memory":
		l.Memory, err = parseSize(value)
	case "file-size":
		l.FileSize, err = parseSize(value)
	case "processes":
		l.Processes, err = parseCount(value)
	case "files":
		l.Files, err = parseCount(value)
	case "cpu":
		l.CPU, err = parseCPU(value)
	case "user":
		l.User, err = parseRunAs(value)
	default:
		return fmt.Errorf("%s: unknown limit (keys: %s)", key, strings.Join(limitKeys, ", "))
	}
	if err != nil {
		return fmt.Errorf("%s: %w", key, err)
	}
	return nil
}

func off(v string) bool { return v == "none" || v == "unlimited" || v == "0" }

// sizeUnits are the size suffixes: binary ones, and K, M, G, T as their
// binary namesakes (as docker -m and ulimit read them).
var sizeUnits = []struct {
	suffix string
	mult   int64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
	{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40},
	{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"B", 1},
}

func parseSize(v string) (int64, error) {
	if off(v) {
		return Unlimited, nil
	}
	num, mult := v, int64(1)
	for _, u := range sizeUnits {
		if n, ok := strings.CutSuffix(v, u.suffix); ok {
			num, mult = n, u.mult
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(num), 10, 64)
	if err != nil || n <= 0 || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("%q is not a size such as 512MiB, 2GiB or 1048576 (none for no limit)", v)
	}
	return n * mult, nil
}

func parseCount(v string) (int64, error) {
	if off(v) {
		return Unlimited, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 || n > math.MaxInt32 {
		return 0, fmt.Errorf("%q is not a positive count (none for no limit)", v)
	}
	return n, nil
}

func parseCPU(v string) (time.Duration, error) {
	if off(v) {
		return Unlimited, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < time.Second || d%time.Second != 0 {
		return 0, fmt.Errorf("%q is not a duration of whole seconds such as 30s or 5m (none for no limit)", v)
	}
	return d, nil
}

// parseRunAs reads UID[:GID], numbers or names; the group defaults to the
// user's primary group.
func parseRunAs(v string) (*RunAs, error) {
	name, group, hasGroup := strings.Cut(v, ":")
	if name == "" {
		return nil, fmt.Errorf("%q is not UID[:GID]", v)
	}
	uid, err := strconv.ParseUint(name, 10, 32)
	var gid uint64
	if err != nil {
		u, lerr := user.Lookup(name)
		if lerr != nil {
			return nil, fmt.Errorf("%q: %w", name, lerr)
		}
		uid, _ = strconv.ParseUint(u.Uid, 10, 32)
		gid, _ = strconv.ParseUint(u.Gid, 10, 32)
	} else if !hasGroup {
		if u, lerr := user.LookupId(name); lerr == nil {
			gid, _ = strconv.ParseUint(u.Gid, 10, 32)
		} else {
			gid = uid
		}
	}
	if hasGroup {
		if gid, err = strconv.ParseUint(group, 10, 32); err != nil {
			g, lerr := user.LookupGroup(group)
			if lerr != nil {
				return nil, fmt.Errorf("%q: %w", group, lerr)
			}
			gid, _ = strconv.ParseUint(g.Gid, 10, 32)
		}
	}
	return &RunAs{UID: uint32(uid), GID: uint32(gid)}, nil
}

// Over is l with every field set in o replacing l's: a flag laid over the
// config's limits.
func (l Limits) Over(o Limits) Limits {
	return Limits{
		Memory:    cmp.Or(o.Memory, l.Memory),
		Processes: cmp.Or(o.Processes, l.Processes),
		Files:     cmp.Or(o.Files, l.Files),
		CPU:       cmp.Or(o.CPU, l.CPU),
		FileSize:  cmp.Or(o.FileSize, l.FileSize),
		User:      cmp.Or(o.User, l.User),
	}
}

// effective is l with defaults for the zero fields.
func (l Limits) effective() Limits { return DefaultLimits().Over(l) }

// String is the text form of the fields set.
func (l Limits) String() string {
	var parts []string
	for _, k := range limitKeys {
		if v := l.value(k); v != "" {
			parts = append(parts, k+"="+v)
		}
	}
	return strings.Join(parts, ",")
}

// value is key's value in the text form, "" when unset.
func (l Limits) value(key string) string {
	switch key {
	case "memory":
		return formatSize(l.Memory)
	case "file-size":
		return formatSize(l.FileSize)
	case "processes":
		return formatCount(l.Processes)
	case "files":
		return formatCount(l.Files)
	case "cpu":
		if l.CPU == Unlimited {
			return "none"
		} else if l.CPU != 0 {
			return l.CPU.String()
		}
	case "user":
		if l.User != nil {
			return fmt.Sprintf("%d:%d", l.User.UID, l.User.GID)
		}
	}
	return ""
}

func formatCount(n int64) string {
	switch n {
	case 0:
		return ""
	case Unlimited:
		return "none"
	}
	return strconv.FormatInt(n, 10)
}

func formatSize(n int64) string {
	if n <= 0 {
		return formatCount(n)
	}
	for _, u := range []struct {
		s string
		m int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n%u.m == 0 {
			return strconv.FormatInt(n/u.m, 10) + u.s
		}
	}
	return strconv.FormatInt(n, 10)
}

// MarshalJSON writes the text form.
func (l Limits) MarshalJSON() ([]byte, error) { return json.Marshal(l.String()) }

// UnmarshalJSON reads the text form or an object with the same keys, whose
// values are strings or numbers ({"memory": "512MiB", "processes": 64}).
func (l *Limits) UnmarshalJSON(data []byte) error {
	data = bytes.TrimSpace(data)
	if string(data) == "null" {
		return nil
	}
	if len(data) > 0 && data[0] == '"' {
		var s string
		if err := json.Unmarshal(data, &s); err != nil {
			return err
		}
		parsed, err := ParseLimits(s)
		if err != nil {
			return err
		}
		*l = parsed
		return nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil {
		return errors.New(`must be "KEY=VALUE,..." or an object such as {"memory": "512MiB", "processes": 64}`)
	}
	var next Limits
	for _, k := range slices.Sorted(maps.Keys(obj)) {
		raw := bytes.TrimSpace(obj[k])
		var v string
		if len(raw) > 0 && raw[0] == '"' {
			if err := json.Unmarshal(raw, &v); err != nil {
				return fmt.Errorf("%s: %w", k, err)
			}
		} else {
			v = string(raw)
		}
		if err := next.set(k, v); err != nil {
			return err
		}
	}
	*l = next
	return nil
}
