package gateway_test

import (
	"errors"
	"io"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health/grpc_health_v1"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/grpc/status"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	"github.com/osmo-rl/osmo/gen/osmo/grader/v1/graderv1connect"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/gen/osmo/rollout/v1/rolloutv1connect"
)

// protocol is one way a Connect client can reach the gateway.
type protocol struct {
	name string
	// client and url pick the server: gRPC needs HTTP/2, the others run on
	// HTTP/1.1.
	client func(h *harness) *http.Client
	url    func(h *harness) string
	opts   []connect.ClientOption
}

func protocols() []protocol {
	h1 := func(h *harness) *http.Client { return h.client }
	h1URL := func(h *harness) string { return h.restURL }
	h2 := func(h *harness) *http.Client { return h.h2c }
	h2URL := func(h *harness) string { return h.h2cURL }
	return []protocol{
		{name: "connect", client: h1, url: h1URL},
		{name: "connect+json", client: h1, url: h1URL, opts: []connect.ClientOption{connect.WithProtoJSON()}},
		{name: "grpc", client: h2, url: h2URL, opts: []connect.ClientOption{connect.WithGRPC()}},
		{name: "grpc-web", client: h1, url: h1URL, opts: []connect.ClientOption{connect.WithGRPCWeb()}},
	}
}

func (p protocol) rollout(h *harness) rolloutv1connect.RolloutServiceClient {
	return rolloutv1connect.NewRolloutServiceClient(p.client(h), p.url(h), p.opts...)
}

func (p protocol) grader(h *harness) graderv1connect.GraderServiceClient {
	return graderv1connect.NewGraderServiceClient(p.client(h), p.url(h), p.opts...)
}

func TestConnectJSONOverPlainHTTP(t *testing.T) {
	h := newHarness(t, &fakeRollout{requireKey: true})

	t.Run("success", func(t *testing.T) {
		resp := h.do(t, http.MethodPost, "/osmo.rollout.v1.RolloutService/Health", `{}`, nil)
		if resp.status != http.StatusOK {
			t.Fatalf("status = %d; body %s", resp.status, resp.body)
		}
		// Connect uses the canonical proto3 JSON names.
		want := map[string]any{"status": "healthy", "agentLoop": "echo", "activeRollouts": float64(3), "completedRollouts": float64(7)}
		if got := resp.json(t); !reflect.DeepEqual(got, want) {
			t.Errorf("body = %v, want %v", got, want)
		}
	})

	t.Run("error keeps code and message", func(t *testing.T) {
		resp := h.do(t, http.MethodPost, "/osmo.rollout.v1.RolloutService/InitRollout", `{"rollout_id": "r"}`, nil)
		if resp.status != http.StatusUnauthorized {
			t.Fatalf("status = %d, want 401; body %s", resp.status, resp.body)
		}
		got := resp.json(t)
		if got["code"] != "unauthenticated" || got["message"] != "Invalid or missing API key" {
			t.Errorf("body = %v", got)
		}
	})

	t.Run("unknown method under a service", func(t *testing.T) {
		resp := h.do(t, http.MethodPost, "/osmo.rollout.v1.RolloutService/Nope", `{}`, nil)
		if resp.status != http.StatusNotFound {
			t.Errorf("status = %d, want 404", resp.status)
		}
	})
}

func TestConnectProtocolsUnary(t *testing.T) {
	h := newHarness(t, nil)
	for _, p := range protocols() {
		t.Run(p.name, func(t *testing.T) {
			ctx := testContext(t)
			health, err := p.rollout(h).Health(ctx, &rolloutv1.HealthRequest{})
			if err != nil {
				t.Fatalf("Health: %v", err)
			}
			if health.GetAgentLoop() != "echo" || health.GetCompletedRollouts() != 7 {
				t.Errorf("Health = %v", health)
			}
			init, err := p.rollout(h).InitRollout(ctx, &rolloutv1.InitRolloutRequest{RolloutId: "r-" + p.name})
			if err != nil {
				t.Fatalf("InitRollout: %v", err)
			}
			if init.GetRolloutId() != "r-"+p.name || len(init.GetTools()) != 1 {
				t.Errorf("InitRollout = %v", init)
			}
			graded, err := p.grader(h).Grade(ctx, &graderv1.GradeRequest{
				RolloutId: "g", Samples: []*rolloutv1.RolloutSample{{Id: "s"}},
			})
			if err != nil {
				t.Fatalf("Grade: %v", err)
			}
			if len(graded.GetGrades()) != 1 || graded.GetGrades()[0].GetReward() != 1 {
				t.Errorf("Grade = %v", graded)
			}
		})
	}
}

func TestConnectErrorCodes(t *testing.T) {
	all := []codes.Code{
		codes.Canceled, codes.Unknown, codes.InvalidArgument, codes.DeadlineExceeded,
		codes.NotFound, codes.AlreadyExists, codes.PermissionDenied, codes.ResourceExhausted,
		codes.FailedPrecondition, codes.Aborted, codes.OutOfRange, codes.Unimplemented,
		codes.Internal, codes.Unavailable, codes.DataLoss, codes.Unauthenticated,
	}
	fake := &fakeRollout{errs: map[string]error{}}
	for _, c := range all {
		fake.errs[c.String()] = status.Errorf(c, "failed with %s", c)
	}
	h := newHarness(t, fake)

	for _, p := range protocols() {
		for _, c := range all {
			t.Run(p.name+"/"+c.String(), func(t *testing.T) {
				_, err := p.rollout(h).GetRollout(testContext(t), &rolloutv1.GetRolloutRequest{RolloutId: c.String()})
				if got := connect.CodeOf(err); got != connect.Code(c) {
					t.Errorf("code = %v, want %v (err %v)", got, c, err)
				}
				var cerr *connect.Error
				if !errors.As(err, &cerr) || cerr.Message() != "failed with "+c.String() {
					t.Errorf("err = %v, want message %q", err, "failed with "+c.String())
				}
			})
		}
	}
}

func TestConnectForwardsHeaderAllowlist(t *testing.T) {
	h := newHarness(t, nil)
	for _, p := range protocols() {
		t.Run(p.name, func(t *testing.T) {
			ctx, info := connect.NewClientContext(testContext(t))
			info.RequestHeader().Set("Authorization", "Bearer abc")
			info.RequestHeader().Set("X-Rollout-Id", "r-"+p.name)
			info.RequestHeader().Set("Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
			info.RequestHeader().Set("Idempotency-Key", "idem")
			info.RequestHeader().Set("X-Not-Allowed", "nope")
			if _, err := p.rollout(h).InitRollout(ctx, &rolloutv1.InitRolloutRequest{RolloutId: "r"}); err != nil {
				t.Fatalf("InitRollout: %v", err)
			}
			md := h.md.last(t, rolloutv1.RolloutService_InitRollout_FullMethodName)
			for key, want := range map[string]string{
				"authorization":   "Bearer abc",
				"x-rollout-id":    "r-" + p.name,
				"traceparent":     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
				"idempotency-key": "idem",
			} {
				if got := md.Get(key); !slices.Equal(got, []string{want}) {
					t.Errorf("metadata %s = %q, want exactly [%q]", key, got, want)
				}
			}
			if got := md.Get("x-not-allowed"); len(got) != 0 {
				t.Errorf("x-not-allowed was forwarded: %q", got)
			}
		})
	}
}

func TestWatchRolloutsConnect(t *testing.T) {
	fake := &fakeRollout{
		watch: []*rolloutv1.Rollout{{RolloutId: "a", Sequence: 1}, {RolloutId: "b", Sequence: 2}},
	}
	h := newHarness(t, fake)
	for _, p := range protocols() {
		t.Run(p.name, func(t *testing.T) {
			stream, err := p.rollout(h).WatchRollouts(testContext(t), &rolloutv1.WatchRolloutsRequest{AfterSequence: -1})
			if err != nil {
				t.Fatalf("WatchRollouts: %v", err)
			}
			defer stream.Close()
			var ids []string
			for stream.Receive() {
				ids = append(ids, stream.Msg().GetRolloutId())
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("stream: %v", err)
			}
			if !slices.Equal(ids, []string{"a", "b"}) {
				t.Errorf("ids = %v, want [a b]", ids)
			}
			if got := fake.watchRequest().GetAfterSequence(); got != -1 {
				t.Errorf("after_sequence = %d, want -1", got)
			}
		})
	}
}

func TestWatchRolloutsConnectErrorMidStream(t *testing.T) {
	fake := &fakeRollout{
		watch:    []*rolloutv1.Rollout{{RolloutId: "a"}},
		watchErr: status.Error(codes.DataLoss, "store lost"),
	}
	h := newHarness(t, fake)
	for _, p := range protocols() {
		t.Run(p.name, func(t *testing.T) {
			stream, err := p.rollout(h).WatchRollouts(testContext(t), &rolloutv1.WatchRolloutsRequest{})
			if err != nil {
				t.Fatalf("WatchRollouts: %v", err)
			}
			defer stream.Close()
			n := 0
			for stream.Receive() {
				n++
			}
			if n != 1 {
				t.Errorf("received %d, want 1", n)
			}
			if connect.CodeOf(stream.Err()) != connect.CodeDataLoss {
				t.Errorf("stream error = %v, want data_loss", stream.Err())
			}
		})
	}
}

func TestGradeStreamBidiOverGRPC(t *testing.T) {
	h := newHarness(t, nil)
	client := graderv1connect.NewGraderServiceClient(h.h2c, h.h2cURL, connect.WithGRPC())

	t.Run("all answered", func(t *testing.T) {
		ctx, info := connect.NewClientContext(testContext(t))
		info.RequestHeader().Set("X-Rollout-Id", "batch-1")
		stream, err := client.GradeStream(ctx)
		if err != nil {
			t.Fatalf("GradeStream: %v", err)
		}
		sent := []string{"r1", "r2", "r3"}
		for _, id := range sent {
			if err := stream.Send(&graderv1.GradeRequest{RolloutId: id, Samples: []*rolloutv1.RolloutSample{{Id: id + "-s"}}}); err != nil {
				t.Fatalf("Send %s: %v", id, err)
			}
		}
		if err := stream.CloseRequest(); err != nil {
			t.Fatalf("CloseRequest: %v", err)
		}
		var got []string
		for {
			resp, err := stream.Receive()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("Receive: %v", err)
			}
			if len(resp.GetGrades()) != 1 || resp.GetGrades()[0].GetSampleId() != resp.GetRolloutId()+"-s" {
				t.Errorf("response = %v", resp)
			}
			got = append(got, resp.GetRolloutId())
		}
		if err := stream.CloseResponse(); err != nil {
			t.Errorf("CloseResponse: %v", err)
		}
		if !slices.Equal(got, sent) {
			t.Errorf("answers = %v, want %v", got, sent)
		}
		md := h.md.last(t, graderv1.GraderService_GradeStream_FullMethodName)
		if got := md.Get("x-rollout-id"); !slices.Equal(got, []string{"batch-1"}) {
			t.Errorf("x-rollout-id = %q", got)
		}
	})

	t.Run("grader fails while the client still sends", func(t *testing.T) {
		stream, err := client.GradeStream(testContext(t))
		if err != nil {
			t.Fatalf("GradeStream: %v", err)
		}
		if err := stream.Send(&graderv1.GradeRequest{RolloutId: "poison"}); err != nil {
			t.Fatalf("Send: %v", err)
		}
		_, err = stream.Receive()
		if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "poisoned sample") {
			t.Errorf("Receive err = %v, want failed_precondition: poisoned sample", err)
		}
		_ = stream.CloseRequest()
		_ = stream.CloseResponse()
	})
}

// dialGateway connects a grpc-go client to the gateway's port.
func dialGateway(t *testing.T, h *harness) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(h.h2cAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func TestGRPCClientOnGatewayPort(t *testing.T) {
	fake := &fakeRollout{errs: map[string]error{"gone": status.Error(codes.NotFound, "no rollout gone")}}
	h := newHarness(t, fake)
	conn := dialGateway(t, h)
	ctx := testContext(t)

	t.Run("unary", func(t *testing.T) {
		health, err := rolloutv1.NewRolloutServiceClient(conn).Health(ctx, &rolloutv1.HealthRequest{})
		if err != nil {
			t.Fatalf("Health: %v", err)
		}
		if health.GetStatus() != "healthy" || health.GetActiveRollouts() != 3 {
			t.Errorf("Health = %v", health)
		}
		_, err = rolloutv1.NewRolloutServiceClient(conn).GetRollout(ctx, &rolloutv1.GetRolloutRequest{RolloutId: "gone"})
		if st := status.Convert(err); st.Code() != codes.NotFound || st.Message() != "no rollout gone" {
			t.Errorf("GetRollout err = %v, want NotFound: no rollout gone", err)
		}
	})

	t.Run("bidi", func(t *testing.T) {
		stream, err := graderv1.NewGraderServiceClient(conn).GradeStream(ctx)
		if err != nil {
			t.Fatalf("GradeStream: %v", err)
		}
		if err := stream.Send(&graderv1.GradeRequest{RolloutId: "x"}); err != nil {
			t.Fatalf("Send: %v", err)
		}
		resp, err := stream.Recv()
		if err != nil || resp.GetRolloutId() != "x" {
			t.Fatalf("Recv = %v, %v", resp, err)
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatalf("CloseSend: %v", err)
		}
		if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
			t.Errorf("final Recv err = %v, want EOF", err)
		}
	})

	t.Run("health", func(t *testing.T) {
		hc := grpc_health_v1.NewHealthClient(conn)
		cases := []struct {
			service string
			want    grpc_health_v1.HealthCheckResponse_ServingStatus
		}{
			{"", grpc_health_v1.HealthCheckResponse_SERVING},
			{"osmo.grader.v1.GraderService", grpc_health_v1.HealthCheckResponse_NOT_SERVING},
		}
		for _, c := range cases {
			resp, err := hc.Check(ctx, &grpc_health_v1.HealthCheckRequest{Service: c.service})
			if err != nil {
				t.Fatalf("Check(%q): %v", c.service, err)
			}
			if resp.GetStatus() != c.want {
				t.Errorf("Check(%q) = %v, want %v", c.service, resp.GetStatus(), c.want)
			}
		}
		_, err := hc.Check(ctx, &grpc_health_v1.HealthCheckRequest{Service: "no.such.Service"})
		if status.Code(err) != codes.NotFound {
			t.Errorf("Check(unknown) err = %v, want NotFound", err)
		}
	})

	wantServices := []string{"grpc.health.v1.Health", "osmo.grader.v1.GraderService", "osmo.rollout.v1.RolloutService"}

	t.Run("reflection v1", func(t *testing.T) {
		stream, err := reflectionv1.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
		if err != nil {
			t.Fatalf("ServerReflectionInfo: %v", err)
		}
		if err := stream.Send(&reflectionv1.ServerReflectionRequest{
			MessageRequest: &reflectionv1.ServerReflectionRequest_ListServices{},
		}); err != nil {
			t.Fatalf("Send: %v", err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		var names []string
		for _, s := range resp.GetListServicesResponse().GetService() {
			names = append(names, s.GetName())
		}
		slices.Sort(names)
		if !slices.Equal(names, wantServices) {
			t.Errorf("services = %v, want %v", names, wantServices)
		}

		// What grpcurl describe needs: the file defining a service.
		if err := stream.Send(&reflectionv1.ServerReflectionRequest{
			MessageRequest: &reflectionv1.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "osmo.rollout.v1.RolloutService"},
		}); err != nil {
			t.Fatalf("Send: %v", err)
		}
		resp, err = stream.Recv()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		if n := len(resp.GetFileDescriptorResponse().GetFileDescriptorProto()); n == 0 {
			t.Errorf("no file descriptors for RolloutService: %v", resp)
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatalf("CloseSend: %v", err)
		}
	})

	t.Run("reflection v1alpha", func(t *testing.T) {
		stream, err := reflectionv1alpha.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
		if err != nil {
			t.Fatalf("ServerReflectionInfo: %v", err)
		}
		//lint:ignore SA1019 v1alpha is deprecated, and still what older clients ask: the gateway answers it.
		if err := stream.Send(&reflectionv1alpha.ServerReflectionRequest{
			MessageRequest: &reflectionv1alpha.ServerReflectionRequest_ListServices{},
		}); err != nil {
			t.Fatalf("Send: %v", err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		//lint:ignore SA1019 as above: the answer to a v1alpha request.
		if n := len(resp.GetListServicesResponse().GetService()); n != len(wantServices) {
			t.Errorf("listed %d services, want %d", n, len(wantServices))
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatalf("CloseSend: %v", err)
		}
	})
}

func TestGraderNotConfiguredRPC(t *testing.T) {
	h := newHarness(t, nil, withoutGrader())
	for _, p := range protocols() {
		t.Run(p.name, func(t *testing.T) {
			_, err := p.grader(h).Grade(testContext(t), &graderv1.GradeRequest{RolloutId: "r"})
			if connect.CodeOf(err) != connect.CodeUnavailable {
				t.Errorf("Grade err = %v, want unavailable", err)
			}
		})
	}
	_, err := grpc_health_v1.NewHealthClient(dialGateway(t, h)).Check(testContext(t),
		&grpc_health_v1.HealthCheckRequest{Service: "osmo.grader.v1.GraderService"})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("grader health err = %v, want Unavailable", err)
	}
}

func TestRPCMessageLimit(t *testing.T) {
	h := newHarness(t, nil, withMaxBodyBytes(1024))
	for _, p := range protocols() {
		t.Run(p.name, func(t *testing.T) {
			_, err := p.rollout(h).InitRollout(testContext(t), &rolloutv1.InitRolloutRequest{
				RolloutId: strings.Repeat("x", 2048),
			})
			if connect.CodeOf(err) != connect.CodeResourceExhausted {
				t.Errorf("err = %v, want resource_exhausted", err)
			}
		})
	}
	if h.md.called(rolloutv1.RolloutService_InitRollout_FullMethodName) {
		t.Error("an oversized message reached the service")
	}
}
