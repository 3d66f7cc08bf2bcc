package execagent

// AllowedEnv exposes the allowlist to the external tests.
var AllowedEnv = allowedEnv

// SweepScratch exposes the removal of scratch directories left by stopped
// servers.
var SweepScratch = sweepScratch
