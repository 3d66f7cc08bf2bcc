package grader

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
)

// fingerprints returns, by sample id, the fingerprint of what the grader
// name (resolved) would see of each sample of r: the row's label and
// metadata as graderContext resolves them, and the sample as sent. A stored
// grading answers a sample only when its fingerprint is the request's, so a
// new rollout that reuses an old id (or a request naming an id it does not
// own) is graded on its own content.
//
// It is SHA-256 over the JSON encoding of those (the rollout id is the
// other half of the key, and trace context and timeout do not change a
// reward): messages are the bytes the agent sent, so the same sample sent
// again has the same fingerprint. A sample whose JSON says the same in
// other bytes is graded once more, which costs a grading, never a wrong
// reward.
func fingerprints(name string, r *request) (map[string]string, error) {
	out := make(map[string]string, len(r.samples))
	for _, s := range r.samples {
		// The rollout id is the key's other half, and may be left out.
		cp := *s
		cp.RolloutID = ""
		b, err := json.Marshal(struct {
			Grader   string          `json:"g"`
			Label    *string         `json:"l"`
			Metadata json.RawMessage `json:"m"`
			Sample   any             `json:"s"`
		}{name, rowLabel(r), r.metadata, &cp})
		if err != nil {
			return nil, err
		}
		sum := sha256.Sum256(b)
		out[s.ID] = hex.EncodeToString(sum[:])
	}
	return out, nil
}
