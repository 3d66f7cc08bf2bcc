package grader

import (
	"encoding/json"
	"fmt"
	"unicode/utf8"

	"github.com/osmo-rl/osmo"
	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/internal/fielderr"
	"github.com/osmo-rl/osmo/internal/sample"
)

// maxRolloutIDBytes bounds rollout ids: an id is a key of the gradings
// bucket, and so part of a NATS subject, which must fit the server's
// control line (4 KiB by default) once base64-encoded. The rollout service
// allows 256 characters, at most 1 KiB.
const maxRolloutIDBytes = 1024

// request is a GradeRequest with its samples and metadata read, from the
// JSON fields the rollout service sends or from the API's messages.
type request struct {
	*graderv1.GradeRequest
	samples  []*sample.Sample
	metadata json.RawMessage
}

func readRequest(req *graderv1.GradeRequest) (*request, error) {
	r := &request{GradeRequest: req, metadata: req.GetMetadataJson()}
	if b := req.GetSamplesJson(); len(b) > 0 {
		if len(req.GetSamples()) > 0 {
			return nil, fielderr.New("samples_json", "set together with samples: send one of them")
		}
		if err := json.Unmarshal(b, &r.samples); err != nil {
			return nil, fielderr.New("samples_json", "%v", err)
		}
	}
	if len(req.GetSamples()) > 0 {
		r.samples = make([]*sample.Sample, len(req.GetSamples()))
		for i, p := range req.GetSamples() {
			r.samples[i] = &sample.Sample{}
			if err := sample.FromProto(p, r.samples[i]); err != nil {
				return nil, fielderr.New(fmt.Sprintf("samples[%d]", i), "%v", err)
			}
		}
	}
	if req.GetMetadata() != nil {
		if len(r.metadata) > 0 {
			return nil, fielderr.New("metadata_json", "set together with metadata: send one of them")
		}
		var err error
		if r.metadata, err = sample.JSON(req.GetMetadata()); err != nil {
			return nil, fielderr.New("metadata", "%v", err)
		}
	}
	return r, validate(r)
}

// validateRolloutID checks the id a request is known by.
func validateRolloutID(req *graderv1.GradeRequest) error {
	if req.GetRolloutId() == "" {
		return fielderr.New("rollout_id", "required")
	}
	if !utf8.ValidString(req.GetRolloutId()) {
		return fielderr.New("rollout_id", "not valid UTF-8")
	}
	if n := len(req.GetRolloutId()); n > maxRolloutIDBytes {
		return fielderr.New("rollout_id", "must be at most %d bytes, got %d", maxRolloutIDBytes, n)
	}
	return nil
}

// validate checks what grading and idempotency rely on. Ids must be valid
// UTF-8, or the stored gradings (JSON) would hold another id than asked.
func validate(r *request) error {
	if err := validateRolloutID(r.GradeRequest); err != nil {
		return err
	}
	if len(r.samples) == 0 {
		return fielderr.New("samples", "required: at least one sample")
	}
	seen := make(map[string]int, len(r.samples))
	for i, s := range r.samples {
		field := fmt.Sprintf("samples[%d].id", i)
		id := s.ID
		if id == "" {
			return fielderr.New(field, "required")
		}
		if !utf8.ValidString(id) {
			return fielderr.New(field, "not valid UTF-8")
		}
		if j, dup := seen[id]; dup {
			return fielderr.New(field, "%q repeats samples[%d].id", id, j)
		}
		seen[id] = i
		if rid := s.RolloutID; rid != "" && rid != r.GetRolloutId() {
			return fielderr.New(fmt.Sprintf("samples[%d].rollout_id", i), "%q differs from rollout_id %q", rid, r.GetRolloutId())
		}
	}
	return nil
}

// graderContext builds what a grader sees for the samples ids of r. A sample
// without its own label and metadata takes the row's (see rowLabel), so
// graders can rely on gc.Label whichever way a caller filled the request in.
func graderContext(r *request, ids []string) (*osmo.GraderContext, error) {
	want := make(map[string]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	label := rowLabel(r)
	var metadata map[string]any
	if len(r.metadata) > 0 {
		if err := json.Unmarshal(r.metadata, &metadata); err != nil {
			return nil, fielderr.New("metadata", "%v", err)
		}
	}
	gc := &osmo.GraderContext{
		RolloutID: r.GetRolloutId(),
		Samples:   make(map[string]*osmo.Sample, len(ids)),
		Label:     copyString(label),
		Metadata:  metadata,
	}
	for _, rs := range r.samples {
		if want[rs.ID] {
			s, err := rs.Grader(copyString(label), metadata)
			if err != nil {
				return nil, fielderr.New("samples", "sample %q: %v", rs.ID, err)
			}
			gc.Samples[s.ID] = s
		}
	}
	return gc, nil
}

// rowLabel is the label of the request's row: its own, or the one all
// its samples share.
func rowLabel(r *request) *string {
	if r.Label != nil {
		return r.Label
	}
	var label *string
	for _, s := range r.samples {
		if s.Label == nil {
			return nil
		}
		if label != nil && *label != *s.Label {
			return nil
		}
		label = s.Label
	}
	return label
}

func copyString(p *string) *string {
	if p == nil {
		return nil
	}
	return new(*p)
}
