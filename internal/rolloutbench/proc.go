package rolloutbench

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/osmo-rl/osmo/internal/benchproc"
)

// waitGRPC checks the gRPC health of p's server at addr until it is
// SERVING, the process ends or ctx does.
func waitGRPC(ctx context.Context, p *benchproc.Proc, addr string) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	return p.Wait(ctx, addr+" not serving", func(ctx context.Context) bool {
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
}

// sharedPort is a TCP port free on every one of ips now, so that replicas
// listen on ip:port each, as the pods of one Service listen on one port.
func sharedPort(ips ...string) (string, error) {
	for range 50 {
		first, err := net.Listen("tcp", ips[0]+":0")
		if err != nil {
			return "", fmt.Errorf("listen on %s: %w (loopback addresses beyond 127.0.0.1 are needed)", ips[0], err)
		}
		port := portOf(first.Addr().String())
		lns := []net.Listener{first}
		free := true
		for _, ip := range ips[1:] {
			ln, err := net.Listen("tcp", ip+":"+port)
			if err != nil {
				free = false
				break
			}
			lns = append(lns, ln)
		}
		for _, ln := range lns {
			_ = ln.Close()
		}
		if free {
			return port, nil
		}
	}
	return "", fmt.Errorf("no port free on all of %s", strings.Join(ips, ", "))
}

// portOf is the port of a host:port.
func portOf(addr string) string { return addr[strings.LastIndexByte(addr, ':')+1:] }
