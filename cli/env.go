package cli

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/osmo-rl/osmo/services/rollout"
)

// osmosisEnv are the OSMOSIS_ROLLOUT_* settings of the Osmosis SDK, read with
// the same names and defaults. Flags given on the command line win.
type osmosisEnv struct {
	client           rollout.ClientSettings
	maxConcurrent    int
	recordTTL        time.Duration
	cleanupInterval  time.Duration
	requestTimeout   time.Duration
	maxMetadataBytes int
}

func readOsmosisEnv(getenv func(string) string) (osmosisEnv, error) {
	e := osmosisEnv{
		client:           rollout.DefaultClientSettings(),
		maxConcurrent:    100,
		recordTTL:        time.Hour,
		cleanupInterval:  time.Minute,
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
		{"OSMOSIS_ROLLOUT_SERVER_CLEANUP_INTERVAL_SECONDS", &e.cleanupInterval},
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
// optional unit: 1048576, 512KiB, 256MiB, 2GiB.
type byteSize int64

// byteUnits are byteSize's units, largest first.
var byteUnits = []struct {
	name string
	size int64
}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}}

func (b *byteSize) String() string {
	for _, u := range byteUnits[:3] {
		if int64(*b) >= u.size && int64(*b)%u.size == 0 {
			return strconv.FormatInt(int64(*b)/u.size, 10) + u.name
		}
	}
	return strconv.FormatInt(int64(*b), 10)
}

func (b *byteSize) Set(s string) error {
	mult := int64(1)
	for _, u := range byteUnits {
		if n, ok := strings.CutSuffix(s, u.name); ok {
			s, mult = n, u.size
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n <= 0 || n > math.MaxInt64/mult {
		return errors.New("want a positive size such as 268435456, 512KiB, 256MiB or 2GiB")
	}
	*b = byteSize(n * mult)
	return nil
}
