// Package fielderr is the bad-input error every service returns: it names
// the offending field, becomes gRPC InvalidArgument with a
// google.rpc.BadRequest detail, and HTTP 422 at the gateway.
package fielderr

import (
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error is a bad-input error about one field.
type Error struct {
	Field  string
	Reason string
}

// New returns an *Error for field with a formatted reason.
func New(field, format string, args ...any) error {
	return &Error{Field: field, Reason: fmt.Sprintf(format, args...)}
}

func (e *Error) Error() string { return e.Field + ": " + e.Reason }

// GRPCStatus lets status.FromError turn the error into InvalidArgument.
func (e *Error) GRPCStatus() *status.Status {
	st := status.New(codes.InvalidArgument, e.Error())
	if d, err := st.WithDetails(&errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: e.Field, Description: e.Reason}},
	}); err == nil {
		return d
	}
	return st
}
