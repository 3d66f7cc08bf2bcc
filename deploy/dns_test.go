package deploy_test

import (
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer answers A queries over UDP on loopback as Docker's embedded DNS
// answers them in a compose network: a service name resolves to the address
// of every replica. The name's first label is the service, whatever search
// domain the resolver appended; anything else is NXDOMAIN, AAAA and TXT
// queries for a service get no records.
type dnsServer struct {
	Addr string

	mu    sync.Mutex
	hosts map[string][]netip.Addr
}

func startDNSServer(t *testing.T) *dnsServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &dnsServer{Addr: pc.LocalAddr().String(), hosts: map[string][]netip.Addr{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if answer, ok := d.answer(buf[:n]); ok {
				_, _ = pc.WriteTo(answer, from)
			}
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return d
}

// set makes host resolve to addrs.
func (d *dnsServer) set(host string, addrs ...netip.Addr) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hosts[host] = addrs
}

func (d *dnsServer) answer(query []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	service, _, _ := strings.Cut(q.Name.String(), ".")
	d.mu.Lock()
	addrs, known := d.hosts[service]
	d.mu.Unlock()
	rcode := dnsmessage.RCodeSuccess
	if !known {
		rcode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(make([]byte, 0, 512), dnsmessage.Header{
		ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired,
		RecursionAvailable: true, RCode: rcode,
	})
	b.EnableCompression()
	if b.StartQuestions() != nil || b.Question(q) != nil || b.StartAnswers() != nil {
		return nil, false
	}
	if q.Type == dnsmessage.TypeA && q.Class == dnsmessage.ClassINET {
		for _, a := range addrs {
			rh := dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 1}
			if b.AResource(rh, dnsmessage.AResource{A: a.As4()}) != nil {
				return nil, false
			}
		}
	}
	msg, err := b.Finish()
	return msg, err == nil
}
