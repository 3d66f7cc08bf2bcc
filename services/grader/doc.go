// Package grader is the grader service and the rollout side's client of it.
//
// Service implements graderv1.GraderServiceServer: it turns each GradeRequest
// into an osmo.GraderContext, runs the named grader under a deadline and a
// concurrency limit, and answers a reward (or remove_sample) per sample. A
// grader that fails, panics, times out, produces a non-finite reward or
// leaves a sample without an outcome makes the whole answer an error: no
// sample is ever given a silent 0.
//
// Grading is idempotent by (rollout_id, sample_id) and the sample's
// fingerprint, a SHA-256 of what the grader sees of it (the grader name, the
// row's label and metadata, the sample's fields): a sample is graded once,
// and any later request for it with the same fingerprint is answered from
// that grading with cached set, including when it failed. A request with the
// same ids but another fingerprint (a new rollout reusing an id whose owner
// forgot it, another rollout service's rollout) is graded anew, and that
// grading replaces the stored one. Concurrent duplicates wait for the one
// grading in progress. Gradings are kept in a NATS JetStream key-value
// bucket (Config.State), written before they are answered, so every
// replica of the service, and a service killed and started again, answers
// resent samples without grading them again.
//
// Client is the rollout service's end: one GradeStream, kept open and
// reopened with backoff, over which any number of Grade calls are
// multiplexed. Every request stays pending until its answer arrives and is
// sent again on each new stream, so a grader restart loses nothing; the
// service's idempotency makes the resend harmless.
package grader
