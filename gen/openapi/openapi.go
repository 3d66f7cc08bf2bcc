// Package openapi exposes the OpenAPI (Swagger 2.0) document generated from
// api/ for the REST surface of the rollout and grader services.
package openapi

import (
	_ "embed"
	"slices"
)

//go:embed osmo.swagger.json
var document []byte

// JSON returns the OpenAPI document. Each call returns a fresh copy, so
// callers may modify it without affecting anyone else.
func JSON() []byte { return slices.Clone(document) }
