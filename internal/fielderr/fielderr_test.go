package fielderr_test

import (
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/osmo-rl/osmo/internal/fielderr"
)

func TestStatusNamesTheField(t *testing.T) {
	err := fielderr.New("samples[1].id", "duplicate of samples[0].id %q", "a")
	st := status.Convert(err)
	if st.Code() != codes.InvalidArgument || st.Message() != `samples[1].id: duplicate of samples[0].id "a"` {
		t.Fatalf("status = %v", st)
	}
	var found bool
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok && br.GetFieldViolations()[0].GetField() == "samples[1].id" {
			found = true
		}
	}
	if !found {
		t.Fatalf("no BadRequest detail naming the field: %v", st.Details())
	}
}
