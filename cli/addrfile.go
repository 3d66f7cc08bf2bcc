package cli

import (
	"encoding/json"
	"flag"
	"fmt"

	"github.com/osmo-rl/osmo/internal/eval"
)

// addrFile is --addr-file: a server started on port 0 tells whoever
// started it where it listens by writing its addresses there once every
// listener is open, whatever the log level.
type addrFile string

func (a *addrFile) register(fs *flag.FlagSet) {
	fs.StringVar((*string)(a), "addr-file", "", "once listening, write the bound addresses to `FILE` as a JSON object (the keys of the \"serving\" log line); with port 0, how a caller learns the ports")
}

// write writes the addresses, given as key, value pairs, to the file (if
// named), whole by a rename, so a reader never sees half of it.
func (a addrFile) write(kv ...string) error {
	if a == "" {
		return nil
	}
	m := make(map[string]string, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := eval.WriteFileAtomic(string(a), append(b, '\n')); err != nil {
		return fmt.Errorf("--addr-file: %w", err)
	}
	return nil
}
