package execagent

// AllowedEnv exposes the allowlist to the external tests.
var AllowedEnv = allowedEnv
