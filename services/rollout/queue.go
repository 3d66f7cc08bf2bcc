package rollout

import "context"

// acquire takes the workflow's concurrency slot (if it has a limit of its
// own) and the server's, in that order, or fails when ctx ends. release
// gives both back.
func (s *Service) acquire(ctx context.Context) (release func(), err error) {
	if s.wfSem != nil {
		select {
		case s.wfSem <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	select {
	case s.sem <- struct{}{}:
	case <-ctx.Done():
		if s.wfSem != nil {
			<-s.wfSem
		}
		return nil, ctx.Err()
	}
	return func() {
		<-s.sem
		if s.wfSem != nil {
			<-s.wfSem
		}
	}, nil
}
