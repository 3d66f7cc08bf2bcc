package grpccodec_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	graderv1 "github.com/osmo-rl/osmo/gen/osmo/grader/v1"
	rolloutv1 "github.com/osmo-rl/osmo/gen/osmo/rollout/v1"
	"github.com/osmo-rl/osmo/internal/grpccodec"
)

// gradeRequest is a request of n samples, each with a two-message
// conversation and one recorded call, as the rollout service sends them.
func gradeRequest(t testing.TB, n int) *graderv1.GradeRequest {
	t.Helper()
	msg := func(v map[string]any) *structpb.Struct {
		s, err := structpb.NewStruct(v)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	req := &graderv1.GradeRequest{RolloutId: "r-1", Label: proto.String("42"), Metadata: msg(map[string]any{"split": "train"})}
	for i := range n {
		user := msg(map[string]any{"role": "user", "content": strings.Repeat("x", i)})
		asst := msg(map[string]any{"role": "assistant", "content": "42", "tool_calls": []any{map[string]any{"id": "c", "n": 1.5, "ok": true, "none": nil}}})
		req.Samples = append(req.Samples, &rolloutv1.RolloutSample{
			RolloutId: "r-1", Id: "s" + strings.Repeat("i", i), Messages: []*structpb.Struct{user, asst},
			Reward: proto.Float64(0.5), LlmCalls: []*rolloutv1.LLMCall{{Id: "call", RequestMessages: []*structpb.Struct{user}, ResponseMessage: asst, Logprobs: []float64{-1}}},
		})
	}
	return req
}

// A generated message, small (its own slice) or large (a buffer of gRPC's
// pool), is encoded as protobuf-go decodes it back; another message goes
// through gRPC's codec; a value that is not a message is refused.
func TestCodecEncodesTheWireFormat(t *testing.T) {
	c := grpccodec.New()
	if c.Name() != "proto" {
		t.Errorf("Name = %q, want proto", c.Name())
	}
	for _, n := range []int{0, 1, 40} {
		req := gradeRequest(t, n)
		data, err := c.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		b := data.Materialize()
		if len(b) != proto.Size(req) {
			t.Errorf("%d samples: %d bytes, protobuf-go's size %d", n, len(b), proto.Size(req))
		}
		var back graderv1.GradeRequest
		if err := proto.Unmarshal(b, &back); err != nil {
			t.Fatalf("%d samples: proto.Unmarshal: %v", n, err)
		}
		if !proto.Equal(&back, req) {
			t.Errorf("%d samples: decoded %v, want %v", n, &back, req)
		}
		var viaCodec graderv1.GradeRequest
		if err := c.Unmarshal(data, &viaCodec); err != nil || !proto.Equal(&viaCodec, req) {
			t.Errorf("%d samples: codec Unmarshal = %v, %v", n, &viaCodec, err)
		}
		data.Free()
	}

	hc := &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}
	data, err := c.Marshal(hc)
	if err != nil {
		t.Fatal(err)
	}
	var back healthpb.HealthCheckResponse
	if err := proto.Unmarshal(data.Materialize(), &back); err != nil || back.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health message through the fallback: %v, %v", &back, err)
	}
	if _, err := c.Marshal("not a message"); err == nil {
		t.Error("Marshal of a string: no error")
	}
	// A receiver checks strings as gRPC's codec does.
	bad := &graderv1.GradeRequest{RolloutId: "\xff"}
	raw, err := bad.MarshalVT()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(raw)}, &graderv1.GradeRequest{}); err == nil {
		t.Error("Unmarshal of a rollout id that is not UTF-8: no error")
	}
}

// echoGrader answers a grade request with a grade per sample.
type echoGrader struct {
	graderv1.UnimplementedGraderServiceServer
}

func (echoGrader) Grade(_ context.Context, req *graderv1.GradeRequest) (*graderv1.GradeResponse, error) {
	resp := &graderv1.GradeResponse{RolloutId: req.GetRolloutId()}
	for _, s := range req.GetSamples() {
		resp.Grades = append(resp.Grades, &graderv1.SampleGrade{SampleId: s.GetId(), Reward: proto.Float64(float64(len(s.GetMessages())))})
	}
	return resp, nil
}

// A server and a client with the codec talk gRPC over loopback, for a
// generated service and for one that is not (health); a client without it
// reaches the server too.
func TestCodecOverLoopback(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpccodec.ServerOption())
	graderv1.RegisterGraderServiceServer(srv, echoGrader{})
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, withCodec := range []bool{true, false} {
		opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
		if withCodec {
			opts = append(opts, grpccodec.DialOption())
		}
		conn, err := grpc.NewClient(ln.Addr().String(), opts...)
		if err != nil {
			t.Fatal(err)
		}
		req := gradeRequest(t, 30)
		resp, err := graderv1.NewGraderServiceClient(conn).Grade(ctx, req)
		if err != nil {
			t.Fatalf("codec %v: Grade: %v", withCodec, err)
		}
		if len(resp.GetGrades()) != 30 || resp.GetGrades()[29].GetReward() != 2 || resp.GetGrades()[29].GetSampleId() != req.GetSamples()[29].GetId() {
			t.Errorf("codec %v: Grade answered %v", withCodec, resp)
		}
		hr, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil || hr.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("codec %v: health = %v, %v", withCodec, hr, err)
		}
		conn.Close()
	}
}

// BenchmarkMarshal: a grade request of 8 samples through gRPC's codec and
// through this one.
func BenchmarkMarshal(b *testing.B) {
	req := gradeRequest(b, 8)
	for _, c := range []struct {
		name  string
		codec interface {
			Marshal(any) (mem.BufferSlice, error)
		}
	}{{"grpc", grpcProto{}}, {"generated", grpccodec.New()}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				data, err := c.codec.Marshal(req)
				if err != nil {
					b.Fatal(err)
				}
				data.Free()
			}
		})
	}
}

// grpcProto is gRPC's registered proto codec.
type grpcProto struct{}

func (grpcProto) Marshal(v any) (mem.BufferSlice, error) {
	return encoding.GetCodecV2("proto").Marshal(v)
}
