package telemetry

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// config is what osmo itself reads from the environment; every other
// OTEL_* setting is read by the OpenTelemetry library that uses it.
type config struct {
	enabled        bool
	captureContent bool
}

// readEnv decides whether tracing is on: when an OTLP endpoint or
// OTEL_TRACES_EXPORTER is set (so that a command run without any settings
// does not export to localhost), unless OTEL_SDK_DISABLED is true.
func readEnv() (config, error) {
	var c config
	for _, name := range [...]string{"OSMO_TRACE_CONTENT", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"} {
		on, err := envBool(name)
		if err != nil {
			return c, err
		}
		c.captureContent = c.captureContent || on
	}
	disabled, err := envBool("OTEL_SDK_DISABLED")
	if err != nil {
		return c, err
	}
	c.enabled = !disabled && (env("OTEL_TRACES_EXPORTER") != "" ||
		env("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "")
	return c, nil
}

// exporterVars names the variables autoexport chose the exporter by, with
// their values, for its errors (which name none).
func exporterVars() string {
	var set []string
	for _, name := range [...]string{"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"} {
		if v := os.Getenv(name); v != "" {
			set = append(set, fmt.Sprintf("%s=%q", name, v))
		}
	}
	return strings.Join(set, " ")
}

func env(name string) string { return strings.TrimSpace(os.Getenv(name)) }

func envBool(name string) (bool, error) {
	v := env(name)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("telemetry: %s=%q: want true or false", name, v)
	}
	return b, nil
}
