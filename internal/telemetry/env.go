package telemetry

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/osmo-rl/osmo/internal/telemetry/otlpdirect"
)

// Protocols of the OTLP exporter.
const (
	ProtocolGRPC = "grpc"
	ProtocolHTTP = "http/protobuf"
)

// EnvError is an environment variable whose value cannot be used.
type EnvError struct {
	Var   string
	Value string
	Want  string
}

func (e *EnvError) Error() string {
	return fmt.Sprintf("telemetry: %s=%q: want %s", e.Var, e.Value, e.Want)
}

// config is what Setup reads from the environment.
type config struct {
	enabled        bool
	protocol       string
	endpoint       *url.URL // scheme, host and (for HTTP) path
	headers        map[string]string
	timeout        time.Duration // 0: the exporter's default (10s)
	serviceName    string
	resource       []attribute.KeyValue // OTEL_RESOURCE_ATTRIBUTES, service.name excluded
	sampler        sdktrace.Sampler
	batch          otlpdirect.BatchConfig // OTEL_BSP_*, defaults included
	captureContent bool
	// gzip, tls: OTEL_EXPORTER_OTLP_COMPRESSION and the certificate
	// variables, for the direct span pipeline (the SDK's exporters read
	// them from the process environment themselves).
	gzip bool
	tls  *tls.Config
	// pipeline is OSMO_TRACE_PIPELINE: PipelineDirect or PipelineSDK.
	pipeline string
}

// Span pipelines of the hot paths (OSMO_TRACE_PIPELINE).
const (
	// PipelineDirect encodes spans as they end (package otlpdirect).
	PipelineDirect = "direct"
	// PipelineSDK runs them through the OpenTelemetry SDK, as every other
	// span.
	PipelineSDK = "sdk"
)

// readConfig interprets the standard OpenTelemetry variables (and osmo's
// OSMO_TRACE_CONTENT). Tracing is on when an OTLP endpoint is set or
// OTEL_TRACES_EXPORTER asks for otlp, and off when OTEL_SDK_DISABLED is true
// or OTEL_TRACES_EXPORTER is none.
func readConfig(defaultServiceName string, getenv func(string) string) (*config, error) {
	c := &config{serviceName: defaultServiceName}
	var err error
	if c.captureContent, err = envBool(getenv, "OSMO_TRACE_CONTENT"); err != nil {
		return nil, err
	}
	if !c.captureContent {
		if c.captureContent, err = envBool(getenv, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"); err != nil {
			return nil, err
		}
	}
	if err := c.readResource(getenv); err != nil {
		return nil, err
	}

	disabled, err := envBool(getenv, "OTEL_SDK_DISABLED")
	if err != nil {
		return nil, err
	}
	exporter, err := tracesExporter(getenv)
	if err != nil {
		return nil, err
	}
	endpointVar, endpoint := "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
	signalSpecific := endpoint != ""
	if !signalSpecific {
		endpointVar, endpoint = "OTEL_EXPORTER_OTLP_ENDPOINT", strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_ENDPOINT"))
	}
	switch {
	case disabled || exporter == "none":
		return c, nil
	case exporter == "" && endpoint == "":
		return c, nil // nothing asks for tracing
	}
	c.enabled = true

	c.protocol, err = protocol(getenv)
	if err != nil {
		return nil, err
	}
	if endpoint == "" {
		// The specification's defaults.
		endpointVar, endpoint = "", "http://localhost:4318"
		if c.protocol == ProtocolGRPC {
			endpoint = "http://localhost:4317"
		}
	}
	u, err := url.Parse(endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, &EnvError{Var: endpointVar, Value: endpoint, Want: "an http or https URL such as http://jaeger:4318 (http/protobuf) or http://jaeger:4317 (grpc)"}
	}
	if c.protocol == ProtocolHTTP && !signalSpecific {
		// The base endpoint gets the signal's path; a traces endpoint is
		// used as it is.
		u.Path = strings.TrimSuffix(u.Path, "/") + "/v1/traces"
	}
	if u.Path == "" {
		u.Path = "/"
	}
	c.endpoint = u

	c.headers = map[string]string{}
	for _, name := range [...]string{"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"} {
		kvs, err := keyValues(getenv, name)
		if err != nil {
			return nil, err
		}
		for _, kv := range kvs {
			c.headers[kv[0]] = kv[1]
		}
	}
	for _, name := range [...]string{"OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"} {
		v := strings.TrimSpace(getenv(name))
		if v == "" {
			continue
		}
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ms <= 0 {
			return nil, &EnvError{Var: name, Value: v, Want: "a positive number of milliseconds"}
		}
		c.timeout = time.Duration(ms) * time.Millisecond
	}
	if c.sampler, err = sampler(getenv); err != nil {
		return nil, err
	}
	if c.batch, err = readBatchConfig(getenv); err != nil {
		return nil, err
	}
	for _, name := range [...]string{"OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"} {
		switch v := strings.ToLower(strings.TrimSpace(getenv(name))); v {
		case "":
		case "gzip":
			c.gzip = true
		case "none":
			c.gzip = false
		default:
			return nil, &EnvError{Var: name, Value: v, Want: "gzip or none"}
		}
	}
	if c.tls, err = readTLS(getenv); err != nil {
		return nil, err
	}
	switch v := strings.ToLower(strings.TrimSpace(getenv("OSMO_TRACE_PIPELINE"))); v {
	case "", PipelineDirect:
		c.pipeline = PipelineDirect
	case PipelineSDK:
		c.pipeline = PipelineSDK
	default:
		return nil, &EnvError{Var: "OSMO_TRACE_PIPELINE", Value: v, Want: "direct or sdk"}
	}
	return c, nil
}

// readTLS builds the exporter's TLS settings from the OTLP certificate
// variables (the signal's own winning): a CA bundle to trust, and a client
// certificate and key for mutual TLS. Nil when none is set.
func readTLS(getenv func(string) string) (*tls.Config, error) {
	get := func(traces, base string) (string, string) {
		if v := strings.TrimSpace(getenv(traces)); v != "" {
			return traces, v
		}
		return base, strings.TrimSpace(getenv(base))
	}
	caVar, ca := get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")
	certVar, cert := get("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE")
	keyVar, key := get("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY")
	if ca == "" && cert == "" && key == "" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if ca != "" {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return nil, &EnvError{Var: caVar, Value: ca, Want: "a readable PEM file (" + err.Error() + ")"}
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, &EnvError{Var: caVar, Value: ca, Want: "a PEM file of certificates"}
		}
	}
	if (cert == "") != (key == "") {
		return nil, &EnvError{Var: certVar, Value: cert, Want: "a client certificate together with " + keyVar}
	}
	if cert != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return nil, &EnvError{Var: certVar, Value: cert, Want: "a PEM certificate matching " + keyVar + " (" + err.Error() + ")"}
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	return tc, nil
}

func readBatchConfig(getenv func(string) string) (otlpdirect.BatchConfig, error) {
	var bc otlpdirect.BatchConfig
	for _, v := range []struct {
		name string
		ms   *time.Duration
		n    *int
	}{
		{name: "OTEL_BSP_SCHEDULE_DELAY", ms: &bc.Delay},
		{name: "OTEL_BSP_EXPORT_TIMEOUT", ms: &bc.ExportTimeout},
		{name: "OTEL_BSP_MAX_QUEUE_SIZE", n: &bc.MaxQueue},
		{name: "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", n: &bc.MaxBatch},
	} {
		s := strings.TrimSpace(getenv(v.name))
		if s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			return bc, &EnvError{Var: v.name, Value: s, Want: "a positive integer"}
		}
		if v.ms != nil {
			*v.ms = time.Duration(n) * time.Millisecond
		} else {
			*v.n = n
		}
	}
	return bc.WithDefaults(), nil
}

// readResource reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, which
// wins over a service.name among the attributes.
func (c *config) readResource(getenv func(string) string) error {
	kvs, err := keyValues(getenv, "OTEL_RESOURCE_ATTRIBUTES")
	if err != nil {
		return err
	}
	for _, kv := range kvs {
		if kv[0] == "service.name" {
			c.serviceName = kv[1]
			continue
		}
		c.resource = append(c.resource, attribute.String(kv[0], kv[1]))
	}
	if name := strings.TrimSpace(getenv("OTEL_SERVICE_NAME")); name != "" {
		c.serviceName = name
	}
	return nil
}

func tracesExporter(getenv func(string) string) (string, error) {
	const name = "OTEL_TRACES_EXPORTER"
	v := strings.TrimSpace(getenv(name))
	if v == "" {
		return "", nil
	}
	out := ""
	for part := range strings.SplitSeq(v, ",") {
		switch p := strings.ToLower(strings.TrimSpace(part)); p {
		case "otlp":
			out = "otlp"
		case "none":
			if out == "" {
				out = "none"
			}
		default:
			return "", &EnvError{Var: name, Value: v, Want: "otlp or none (osmo exports traces over OTLP only)"}
		}
	}
	return out, nil
}

func protocol(getenv func(string) string) (string, error) {
	for _, name := range [...]string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		v := strings.TrimSpace(getenv(name))
		switch strings.ToLower(v) {
		case "":
			continue
		case ProtocolGRPC, ProtocolHTTP:
			return strings.ToLower(v), nil
		default:
			return "", &EnvError{Var: name, Value: v, Want: "grpc or http/protobuf"}
		}
	}
	return ProtocolHTTP, nil // the specification's default
}

// sampler reads OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG; the default
// is parentbased_always_on, as in the specification.
func sampler(getenv func(string) string) (sdktrace.Sampler, error) {
	name := strings.ToLower(strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER")))
	arg := strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER_ARG"))
	ratio := func() (float64, error) {
		if arg == "" {
			return 1, nil
		}
		f, err := strconv.ParseFloat(arg, 64)
		if err != nil || f < 0 || f > 1 {
			return 0, &EnvError{Var: "OTEL_TRACES_SAMPLER_ARG", Value: arg, Want: "a sampling ratio between 0 and 1"}
		}
		return f, nil
	}
	switch name {
	case "", "parentbased_always_on":
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case "always_on":
		return sdktrace.AlwaysSample(), nil
	case "always_off":
		return sdktrace.NeverSample(), nil
	case "parentbased_always_off":
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case "traceidratio":
		r, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.TraceIDRatioBased(r), nil
	case "parentbased_traceidratio":
		r, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(r)), nil
	}
	return nil, &EnvError{Var: "OTEL_TRACES_SAMPLER", Value: getenv("OTEL_TRACES_SAMPLER"),
		Want: "always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio"}
}

// keyValues parses a comma-separated list of key=value pairs with
// percent-encoded values (OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS).
func keyValues(getenv func(string) string, name string) ([][2]string, error) {
	v := getenv(name)
	if strings.TrimSpace(v) == "" {
		return nil, nil
	}
	var out [][2]string
	for item := range strings.SplitSeq(v, ",") {
		if strings.TrimSpace(item) == "" {
			continue
		}
		key, value, ok := strings.Cut(item, "=")
		key = strings.TrimSpace(key)
		if !ok || key == "" {
			return nil, &EnvError{Var: name, Value: v, Want: "comma-separated key=value pairs"}
		}
		decoded, err := url.PathUnescape(strings.TrimSpace(value))
		if err != nil {
			return nil, &EnvError{Var: name, Value: v, Want: "percent-encoded values (" + err.Error() + ")"}
		}
		out = append(out, [2]string{key, decoded})
	}
	return out, nil
}

func envBool(getenv func(string) string, name string) (bool, error) {
	v := strings.TrimSpace(getenv(name))
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, &EnvError{Var: name, Value: v, Want: "true or false"}
	}
	return b, nil
}
