// Package netguardtest lets tests decide what host names resolve to.
package netguardtest

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/netip"

	"golang.org/x/net/dns/dnsmessage"
)

// Resolver answers A and AAAA queries for names (fully qualified, lower
// case: "metadata.test.") from the map, in memory, and NXDOMAIN for any
// other: the test decides what a name resolves to. Names in /etc/hosts are
// still answered from there.
func Resolver(names map[string]netip.Addr) *net.Resolver {
	return &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			client, server := net.Pipe()
			go serveDNS(server, names)
			return client, nil
		},
	}
}

// serveDNS answers length-prefixed DNS queries on c (the resolver speaks
// the TCP framing over a conn that is not a net.PacketConn).
func serveDNS(c net.Conn, names map[string]netip.Addr) {
	defer c.Close()
	for {
		var n uint16
		if binary.Read(c, binary.BigEndian, &n) != nil {
			return
		}
		query := make([]byte, n)
		if _, err := io.ReadFull(c, query); err != nil {
			return
		}
		var parser dnsmessage.Parser
		h, err := parser.Start(query)
		if err != nil {
			return
		}
		q, err := parser.Question()
		if err != nil {
			return
		}
		addr, known := names[q.Name.String()]
		hdr := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true}
		if !known {
			hdr.RCode = dnsmessage.RCodeNameError
		}
		b := dnsmessage.NewBuilder(nil, hdr)
		_ = b.StartQuestions()
		_ = b.Question(q)
		_ = b.StartAnswers()
		rh := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60}
		switch {
		case known && q.Type == dnsmessage.TypeA && addr.Is4():
			_ = b.AResource(rh, dnsmessage.AResource{A: addr.As4()})
		case known && q.Type == dnsmessage.TypeAAAA && addr.Is6():
			_ = b.AAAAResource(rh, dnsmessage.AAAAResource{AAAA: addr.As16()})
		}
		msg, err := b.Finish()
		if err != nil {
			return
		}
		if binary.Write(c, binary.BigEndian, uint16(len(msg))) != nil {
			return
		}
		if _, err := c.Write(msg); err != nil {
			return
		}
	}
}
