//go:build unix

package e2e

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer is an authoritative DNS server for a few names, answering their
// A records over UDP and TCP on one loopback address, so a gRPC client
// given dns://ADDR/NAME:PORT balances over every address of NAME, as it
// would over a headless Service's pods. Any other name is NXDOMAIN; a held
// name has no records of other types.
type dnsServer struct {
	addr    string
	names   map[string][]netip.Addr // fully qualified, lower case
	udp     net.PacketConn
	tcp     net.Listener
	queries atomic.Int64

	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

// startDNS serves names (each to its IPv4 addresses) until the test ends.
func startDNS(t *testing.T, names map[string][]string) *dnsServer {
	t.Helper()
	d := &dnsServer{names: map[string][]netip.Addr{}, conns: map[net.Conn]struct{}{}}
	for name, ips := range names {
		fq := strings.ToLower(strings.TrimSuffix(name, ".")) + "."
		for _, ip := range ips {
			a, err := netip.ParseAddr(ip)
			if err != nil || !a.Is4() {
				t.Fatalf("startDNS: %q is not an IPv4 address", ip)
			}
			d.names[fq] = append(d.names[fq], a)
		}
	}
	// One port for both transports: UDP's, if TCP can have it too.
	for attempt := 0; d.tcp == nil; attempt++ {
		udp, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		tcp, err := net.Listen("tcp", udp.LocalAddr().String())
		if err != nil {
			_ = udp.Close()
			if attempt == 20 {
				t.Fatalf("startDNS: no port free for both UDP and TCP: %v", err)
			}
			continue
		}
		d.udp, d.tcp, d.addr = udp, tcp, udp.LocalAddr().String()
	}
	d.wg.Add(2)
	go d.serveUDP()
	go d.serveTCP()
	t.Cleanup(d.close)
	return d
}

// Queries is how many queries have been answered.
func (d *dnsServer) Queries() int64 { return d.queries.Load() }

func (d *dnsServer) close() {
	_ = d.udp.Close()
	_ = d.tcp.Close()
	d.mu.Lock()
	for c := range d.conns {
		_ = c.Close()
	}
	d.mu.Unlock()
	d.wg.Wait()
}

func (d *dnsServer) serveUDP() {
	defer d.wg.Done()
	buf := make([]byte, 65535)
	for {
		n, from, err := d.udp.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		if resp, ok := d.answer(buf[:n]); ok {
			_, _ = d.udp.WriteTo(resp, from)
		}
	}
}

func (d *dnsServer) serveTCP() {
	defer d.wg.Done()
	for {
		c, err := d.tcp.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		d.mu.Lock()
		d.conns[c] = struct{}{}
		d.mu.Unlock()
		d.wg.Add(1)
		go d.serveConn(c)
	}
}

// serveConn answers the length-prefixed messages of one TCP connection
// (RFC 1035 4.2.2) until the client closes it or is idle for 10s.
func (d *dnsServer) serveConn(c net.Conn) {
	defer d.wg.Done()
	defer func() {
		d.mu.Lock()
		delete(d.conns, c)
		d.mu.Unlock()
		_ = c.Close()
	}()
	for {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		var size [2]byte
		if _, err := io.ReadFull(c, size[:]); err != nil {
			return
		}
		req := make([]byte, binary.BigEndian.Uint16(size[:]))
		if _, err := io.ReadFull(c, req); err != nil {
			return
		}
		resp, ok := d.answer(req)
		if !ok {
			return
		}
		out := binary.BigEndian.AppendUint16(make([]byte, 0, 2+len(resp)), uint16(len(resp)))
		if _, err := c.Write(append(out, resp...)); err != nil {
			return
		}
	}
}

// answer builds the response to one query; false when req is not a DNS
// message worth answering.
func (d *dnsServer) answer(req []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(req)
	if err != nil || h.Response {
		return nil, false
	}
	d.queries.Add(1)
	resp := dnsmessage.Header{ID: h.ID, Response: true, OpCode: h.OpCode, Authoritative: true,
		RecursionDesired: h.RecursionDesired, RecursionAvailable: true}
	q, err := p.Question()
	if err != nil || h.OpCode != 0 {
		resp.RCode = dnsmessage.RCodeFormatError
		if h.OpCode != 0 {
			resp.RCode = dnsmessage.RCodeNotImplemented
		}
		b := dnsmessage.NewBuilder(nil, resp)
		out, err := b.Finish()
		return out, err == nil
	}
	addrs, known := d.names[strings.ToLower(q.Name.String())]
	if !known {
		resp.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(make([]byte, 0, 512), resp)
	b.EnableCompression()
	if b.StartQuestions() != nil || b.Question(q) != nil || b.StartAnswers() != nil {
		return nil, false
	}
	if known && q.Class == dnsmessage.ClassINET && (q.Type == dnsmessage.TypeA || q.Type == dnsmessage.TypeALL) {
		for _, a := range addrs {
			rh := dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 1}
			if b.AResource(rh, dnsmessage.AResource{A: a.As4()}) != nil {
				return nil, false
			}
		}
	}
	out, err := b.Finish()
	return out, err == nil
}

// sharedPort is a TCP port free on every one of ips now, so replicas can
// listen on ip:port each, as pods of one Service listen on one port.
func sharedPort(t *testing.T, ips ...string) string {
	t.Helper()
	for range 50 {
		first, err := net.Listen("tcp", ips[0]+":0")
		if err != nil {
			t.Fatalf("listen on %s: %v (loopback addresses beyond 127.0.0.1 are needed)", ips[0], err)
		}
		p := portOf(first.Addr().String())
		lns := []net.Listener{first}
		ok := true
		for _, ip := range ips[1:] {
			ln, err := net.Listen("tcp", ip+":"+p)
			if err != nil {
				ok = false
				break
			}
			lns = append(lns, ln)
		}
		for _, ln := range lns {
			_ = ln.Close()
		}
		if ok {
			return p
		}
	}
	t.Fatalf("no port free on all of %v", ips)
	return ""
}
