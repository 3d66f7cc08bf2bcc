package grader

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
)

// fingerprints returns, by sample id, the SHA-256 of the JSON of what
// grader name would see of each sample of r: the row's label and metadata
// and the sample as sent. A stored grading answers only a sample with the
// same fingerprint, so a new rollout reusing an old id is graded on its
// own content. Messages are the bytes the agent sent, so a resend has the
// same fingerprint; JSON that says the same in other bytes costs a
// grading, never a wrong reward.
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
