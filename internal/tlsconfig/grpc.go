package tlsconfig

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"

	"google.golang.org/grpc/credentials"
)

// ServerCredentials are a gRPC server's, from ServerConfig; a refused
// handshake is logged as a warning naming the peer.
func (s *Source) ServerCredentials() credentials.TransportCredentials {
	return serverCreds{TransportCredentials: credentials.NewTLS(s.ServerConfig()), log: s}
}

type serverCreds struct {
	credentials.TransportCredentials
	log *Source
}

func (c serverCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	// A connection closed before it said anything is a port check (a
	// TCP probe), not a refused client.
	if err != nil && !errors.Is(err, io.EOF) {
		c.log.log.Warn("TLS handshake refused", "peer", raw.RemoteAddr().String(), "err", err)
	}
	return conn, info, err
}

func (c serverCreds) Clone() credentials.TransportCredentials {
	return serverCreds{TransportCredentials: c.TransportCredentials.Clone(), log: c.log}
}

// ClientCredentials are a gRPC client's: each connection gets a fresh
// ClientConfig, so a rotated CA or certificate is used from the next one
// on. The server's name is the target's host.
func (s *Source) ClientCredentials() credentials.TransportCredentials {
	return clientCreds{config: s.ClientConfig}
}

// SelfCredentials are ClientCredentials made with SelfClientConfig.
func (s *Source) SelfCredentials() credentials.TransportCredentials {
	return clientCreds{config: s.SelfClientConfig}
}

type clientCreds struct {
	config func() *tls.Config
}

func (c clientCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return credentials.NewTLS(c.config()).ClientHandshake(ctx, authority, raw)
}

func (c clientCreds) ServerHandshake(net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("tlsconfig: client credentials cannot serve")
}

func (c clientCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls"}
}

func (c clientCreds) Clone() credentials.TransportCredentials { return c }

// OverrideServerName implements the deprecated method of the interface;
// grpc.WithAuthority is the way to name another server.
func (clientCreds) OverrideServerName(string) error {
	return errors.New("tlsconfig: use grpc.WithAuthority to override the server name")
}
