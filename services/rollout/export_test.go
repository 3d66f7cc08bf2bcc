package rollout

// SamplesOf lets the black-box tests read a grade request's samples as the
// in-package tests do.
var SamplesOf = samplesOf
