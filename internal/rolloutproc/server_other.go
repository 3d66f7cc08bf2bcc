//go:build !unix

package rolloutproc

import (
	"context"
	"errors"
)

// Server is a started rollout server; only Unix systems start them here.
type Server struct{}

var errUnsupported = errors.New("rollout servers need a Unix system (process groups)")

// Start fails: hosting a rollout server needs process groups.
func Start(context.Context, Spec) (*Server, error) {
	return nil, &StartError{Reason: "start", Err: errUnsupported}
}

func (s *Server) URL() string                { return "" }
func (s *Server) PID() int                   { return 0 }
func (s *Server) InstanceID() string         { return "" }
func (s *Server) Done() <-chan struct{}      { return nil }
func (s *Server) Err() error                 { return errUnsupported }
func (s *Server) Stop(context.Context) error { return nil }
