package cli

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/docker/go-units"

	"github.com/osmo-rl/osmo/internal/netguard"
	"github.com/osmo-rl/osmo/services/rollout"
	"github.com/osmo-rl/osmo/workflows/execagent"
)

// osmosisEnv are the OSMOSIS_ROLLOUT_* settings of the Osmosis SDK, read with
// the same names and defaults. Flags given on the command line win.
type osmosisEnv struct {
	client           rollout.ClientSettings
	maxConcurrent    int
	recordTTL        time.Duration
	requestTimeout   time.Duration
	maxMetadataBytes int
}

func readOsmosisEnv(getenv func(string) string) (osmosisEnv, error) {
	e := osmosisEnv{
		client:           rollout.DefaultClientSettings(),
		maxConcurrent:    100,
		recordTTL:        time.Hour,
		requestTimeout:   600 * time.Second,
		maxMetadataBytes: 1 << 20,
	}
	seconds := []struct {
		name string
		dst  *time.Duration
	}{
		{"OSMOSIS_ROLLOUT_CLIENT_TIMEOUT_SECONDS", &e.client.Timeout},
		{"OSMOSIS_ROLLOUT_CLIENT_RETRY_BASE_DELAY", &e.client.RetryBaseDelay},
		{"OSMOSIS_ROLLOUT_CLIENT_RETRY_MAX_DELAY", &e.client.RetryMaxDelay},
		{"OSMOSIS_ROLLOUT_SERVER_RECORD_TTL_SECONDS", &e.recordTTL},
		// Checked but of no effect: finished records expire by their
		// NATS TTL (RECORD_TTL); nothing prunes them.
		{"OSMOSIS_ROLLOUT_SERVER_CLEANUP_INTERVAL_SECONDS", new(time.Duration)},
		{"OSMOSIS_ROLLOUT_SERVER_REQUEST_TIMEOUT_SECONDS", &e.requestTimeout},
	}
	for _, s := range seconds {
		v := getenv(s.name)
		if v == "" {
			continue
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || f <= 0 || math.IsInf(f, 0) || math.IsNaN(f) {
			return e, fmt.Errorf("%s: want a positive number of seconds, got %q", s.name, v)
		}
		*s.dst = time.Duration(f * float64(time.Second))
	}
	// COMPLETE_ROLLOUT_RETRIES is checked but has no effect: callbacks are
	// retried until --delivery-deadline, not a number of times.
	var completeRolloutRetries int
	ints := []struct {
		name string
		dst  *int
		min  int
	}{
		{"OSMOSIS_ROLLOUT_CLIENT_MAX_RETRIES", &e.client.MaxRetries, 0},
		{"OSMOSIS_ROLLOUT_CLIENT_COMPLETE_ROLLOUT_RETRIES", &completeRolloutRetries, 0},
		{"OSMOSIS_ROLLOUT_CLIENT_MAX_CONNECTIONS", &e.client.MaxConnections, 1},
		{"OSMOSIS_ROLLOUT_CLIENT_MAX_KEEPALIVE_CONNECTIONS", &e.client.MaxKeepaliveConnections, 1},
		{"OSMOSIS_ROLLOUT_SERVER_MAX_CONCURRENT_ROLLOUTS", &e.maxConcurrent, 1},
		{"OSMOSIS_ROLLOUT_MAX_METADATA_SIZE_BYTES", &e.maxMetadataBytes, 1},
	}
	for _, s := range ints {
		v := getenv(s.name)
		if v == "" {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < s.min {
			return e, fmt.Errorf("%s: want an integer >= %d, got %q", s.name, s.min, v)
		}
		*s.dst = n
	}
	return e, nil
}

// byteSize is a flag holding a size in bytes, written as a number with an
// optional binary unit: 1048576, 512KiB, 256MiB, 2GiB.
type byteSize int64

func (b *byteSize) String() string { return units.BytesSize(float64(*b)) }

func (b *byteSize) Set(s string) error {
	n, err := units.RAMInBytes(s)
	if err != nil || n <= 0 {
		return errors.New("want a positive size such as 268435456, 512KiB, 256MiB or 2GiB")
	}
	*b = byteSize(n)
	return nil
}

// execLimitsFlag is --exec-limits: the exec agents' limits in
// execagent.ParseLimits' text form, laid key by key over the workflow
// config's "limits".
type execLimitsFlag struct {
	limits execagent.Limits
	set    bool
}

func (f *execLimitsFlag) String() string {
	if f == nil {
		return ""
	}
	return f.limits.String()
}

func (f *execLimitsFlag) Set(s string) error {
	l, err := execagent.ParseLimits(s)
	if err != nil {
		return err
	}
	f.limits, f.set = l, true
	return nil
}

// over lays the flag over the config's limits.
func (f *execLimitsFlag) over(cfg execagent.Limits) execagent.Limits {
	if !f.set {
		return cfg
	}
	return cfg.Over(f.limits)
}

// execLimitsUsage is --exec-limits' usage line.
const execLimitsUsage = "limits of each exec agent run: `LIMITS` is KEY=VALUE,... of memory=SIZE, processes=N, files=N, cpu=DURATION, file-size=SIZE, user=UID[:GID], none turning one off " +
	"(default memory=2GiB,processes=512,files=4096,file-size=1GiB; laid over the config's \"limits\"; see docs/workflows.md)"

// outboundFlags adjust which addresses the rollout service may connect to
// on a trainer's behalf (the policy and callback URLs it is handed): the
// defaults of netguard.DefaultDenied, with the operator's prefixes on top.
type outboundFlags struct {
	deny, allow prefixList
}

func (f *outboundFlags) register(fs *flag.FlagSet) {
	fs.Var(&f.deny, "deny-outbound", "also refuse trainer-named URLs (policy, callbacks) that reach these `CIDR`s, comma-separated (by default link-local, cloud metadata, unspecified and multicast addresses are refused)")
	fs.Var(&f.allow, "allow-outbound", "permit trainer-named URLs that reach these `CIDR`s, comma-separated, though the defaults or --deny-outbound refuse them; the most specific prefix decides")
}

// policy is the outbound address policy the flags make.
func (f *outboundFlags) policy() *netguard.Policy {
	return netguard.New(f.deny, f.allow)
}

// prefixList is a flag of comma-separated CIDR prefixes; given again, it
// adds to the list.
type prefixList []netip.Prefix

func (l *prefixList) String() string {
	if l == nil {
		return ""
	}
	s := make([]string, len(*l))
	for i, p := range *l {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

func (l *prefixList) Set(v string) error {
	ps, err := netguard.ParsePrefixes(v)
	if err != nil {
		return err
	}
	*l = append(*l, ps...)
	return nil
}
