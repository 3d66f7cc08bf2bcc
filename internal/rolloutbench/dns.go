package rolloutbench

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer answers the A records of one name over UDP on loopback, so
// that a gRPC client given dns://ADDR/NAME:PORT balances over every
// address of NAME, as it would over a headless Service's pods. Any other
// name is NXDOMAIN; the name has no records of other types.
type dnsServer struct {
	addr  string
	name  string // fully qualified, lower case
	ips   []netip.Addr
	conn  net.PacketConn
	group sync.WaitGroup
}

// startDNS serves name's IPv4 addresses ips until close.
func startDNS(name string, ips []string) (*dnsServer, error) {
	d := &dnsServer{name: strings.ToLower(strings.TrimSuffix(name, ".")) + "."}
	for _, ip := range ips {
		a, err := netip.ParseAddr(ip)
		if err != nil || !a.Is4() {
			return nil, errors.New("rolloutbench: dns: " + ip + " is not an IPv4 address")
		}
		d.ips = append(d.ips, a)
	}
	conn, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	d.conn, d.addr = conn, conn.LocalAddr().String()
	d.group.Go(d.serve)
	return d, nil
}

func (d *dnsServer) close() {
	_ = d.conn.Close()
	d.group.Wait()
}

func (d *dnsServer) serve() {
	buf := make([]byte, 512)
	for {
		n, from, err := d.conn.ReadFrom(buf)
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			continue
		}
		if resp, ok := d.answer(buf[:n]); ok {
			_, _ = d.conn.WriteTo(resp, from)
		}
	}
}

// answer builds the response to one query; false when req is not a query
// worth answering. Three A records fit the 512 bytes of a UDP answer, so
// nothing is truncated and no client retries over TCP.
func (d *dnsServer) answer(req []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(req)
	if err != nil || h.Response || h.OpCode != 0 {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	resp := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired}
	known := strings.ToLower(q.Name.String()) == d.name
	if !known {
		resp.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(make([]byte, 0, 512), resp)
	if b.StartQuestions() != nil || b.Question(q) != nil || b.StartAnswers() != nil {
		return nil, false
	}
	if known && q.Class == dnsmessage.ClassINET && q.Type == dnsmessage.TypeA {
		for _, a := range d.ips {
			rh := dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 1}
			if b.AResource(rh, dnsmessage.AResource{A: a.As4()}) != nil {
				return nil, false
			}
		}
	}
	out, err := b.Finish()
	return out, err == nil
}
