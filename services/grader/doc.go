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
// fingerprint, a SHA-256 of what the grader sees of it: a later request for
// a sample with the same fingerprint is answered from its grading with
// cached set, even a failed one; another fingerprint (a new rollout reusing
// an id) is graded anew and replaces it. Concurrent duplicates wait for the
// grading in progress. Gradings are stored in a NATS JetStream key-value
// bucket before they are answered, so every replica, and a restarted
// service, answers resent samples without grading them again.
//
// Client is the rollout service's end: Grade calls multiplexed over one
// GradeStream, each resent on every new stream until answered, so a grader
// restart loses nothing.
package grader
