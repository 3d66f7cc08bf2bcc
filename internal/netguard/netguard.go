// Package netguard decides which remote addresses osmo may connect to on a
// trainer's behalf. Trainers name the URLs osmo calls (the policy, the
// callbacks), so without a check any client of the API could make osmo
// reach the cloud metadata service at 169.254.169.254 and read the node's
// credentials.
//
// Policy.Dialer checks the address each connection actually goes to, after
// name resolution, so DNS rebinding after admission is caught. CheckURL
// refuses at admission the URLs whose host is a denied IP literal (a name
// cannot be judged without a lookup whose answer may not hold), and
// CheckRedirect keeps an HTTP client on the host it was sent to.
package netguard

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"syscall"
)

// Source is where a rule of a Policy comes from. Between prefixes of the
// same length, the higher Source wins.
type Source int

const (
	// Builtin rules are the defaults (DefaultDenied).
	Builtin Source = iota
	// Allowed rules are the operator's --allow-outbound prefixes.
	Allowed
	// Denied rules are the operator's --deny-outbound prefixes.
	Denied
)

// Rule denies or allows the addresses of one prefix.
type Rule struct {
	Prefix netip.Prefix
	Allow  bool
	Source Source
	// Why says what the prefix holds, for the error that names it.
	Why string
}

// DefaultDenied are the addresses denied unless the operator allows them:
// cloud metadata services and addresses no trainer can be at. Loopback and
// private ranges stay allowed: trainers often run in the same cluster.
func DefaultDenied() []Rule {
	deny := func(prefix, why string) Rule {
		return Rule{Prefix: netip.MustParsePrefix(prefix), Source: Builtin, Why: why}
	}
	return []Rule{
		deny("169.254.0.0/16", "link-local, cloud metadata"),
		deny("fe80::/10", "link-local, cloud metadata"),
		deny("0.0.0.0/8", "unspecified or this network"),
		deny("::/128", "unspecified"),
		deny("224.0.0.0/4", "multicast"),
		deny("ff00::/8", "multicast"),
		deny("255.255.255.255/32", "broadcast"),
		// Metadata services outside link-local: Alibaba Cloud's (in the
		// shared address space 100.64.0.0/10, which stays allowed) and
		// AWS's IPv6 one (in the private fc00::/7, which stays allowed).
		deny("100.100.100.200/32", "Alibaba Cloud metadata"),
		deny("fd00:ec2::254/128", "AWS IPv6 metadata"),
	}
}

// Policy decides which addresses may be connected to: the most specific
// prefix that holds an address decides, by Source between prefixes of the
// same length; an address no rule holds is allowed. IPv4-mapped and NAT64
// (64:ff9b::/96) addresses are judged as the IPv4 address they reach.
//
// A nil *Policy is the default one. A Policy is immutable and safe for
// concurrent use.
type Policy struct {
	rules    []Rule // most specific first, then by Source, highest first
	resolver *net.Resolver
}

// Default is the policy of DefaultDenied alone.
func Default() *Policy { return New(nil, nil) }

// New is the policy of DefaultDenied adjusted by the operator's deny and
// allow prefixes.
func New(deny, allow []netip.Prefix) *Policy {
	rules := DefaultDenied()
	for _, p := range deny {
		rules = append(rules, Rule{Prefix: p, Source: Denied, Why: "--deny-outbound"})
	}
	for _, p := range allow {
		rules = append(rules, Rule{Prefix: p, Allow: true, Source: Allowed, Why: "--allow-outbound"})
	}
	for i := range rules {
		rules[i].Prefix = canonicalPrefix(rules[i].Prefix)
	}
	p := &Policy{rules: rules}
	slices.SortStableFunc(p.rules, func(a, b Rule) int {
		if c := cmp.Compare(b.Prefix.Bits(), a.Prefix.Bits()); c != 0 {
			return c
		}
		return cmp.Compare(b.Source, a.Source)
	})
	return p
}

// WithResolver is a copy of p whose Dialer resolves names with r (nil: the
// system's) unless its base dialer names a resolver of its own. What r
// answers is checked like any other answer.
func (p *Policy) WithResolver(r *net.Resolver) *Policy {
	c := *p.orDefault()
	c.resolver = r
	return &c
}

func (p *Policy) orDefault() *Policy {
	if p == nil {
		return Default()
	}
	return p
}

// Check is nil when addr may be connected to, else a *DeniedError.
func (p *Policy) Check(addr netip.Addr) error {
	a := canonicalAddr(addr)
	for _, r := range p.orDefault().rules {
		if r.Prefix.Contains(a) {
			if r.Allow {
				return nil
			}
			return &DeniedError{Addr: addr.WithZone(""), Rule: r}
		}
	}
	return nil
}

// CheckURL is nil unless raw's host is an IP literal Check denies (then a
// *DeniedError). Host names are left to the dial-time check.
func (p *Policy) CheckURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return nil // not a URL: its own check's business
	}
	addr, err := netip.ParseAddr(u.Hostname())
	if err != nil {
		return nil
	}
	return p.Check(addr)
}

// Dialer returns a copy of base (the zero Dialer when nil) that checks
// every connection's resolved address before it is attempted: a denied one
// fails with an error wrapping *DeniedError and no packet is sent.
//
// The check sees the address dialled: through a forward proxy
// (http.Transport.Proxy) that is the proxy's, so transports using the
// Dialer should not use one.
func (p *Policy) Dialer(base *net.Dialer) *net.Dialer {
	p = p.orDefault()
	d := &net.Dialer{}
	if base != nil {
		*d = *base
	}
	if d.Resolver == nil {
		d.Resolver = p.resolver
	}
	ctlCtx, ctl := d.ControlContext, d.Control
	d.ControlContext = func(ctx context.Context, network, address string, c syscall.RawConn) error {
		// Control is given the resolved "ip:port" about to be dialled.
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return fmt.Errorf("netguard: unexpected dial address %q: %w", address, err)
		}
		if err := p.Check(ap.Addr()); err != nil {
			return err
		}
		// As net.Dialer does, ControlContext takes precedence over Control.
		switch {
		case ctlCtx != nil:
			return ctlCtx(ctx, network, address, c)
		case ctl != nil:
			return ctl(network, address, c)
		}
		return nil
	}
	return d
}

// maxRedirects is how many redirects CheckRedirect follows, as many as
// net/http's default.
const maxRedirects = 10

// CheckRedirect is an http.Client CheckRedirect that follows at most 10
// redirects, only to the host first asked: an endpoint answering 307 to
// http://169.254.169.254/ must not get osmo to ask there. A refused
// redirect fails with a *RedirectError.
func CheckRedirect(req *http.Request, via []*http.Request) error {
	if len(via) == 0 {
		return nil
	}
	from := via[0].URL
	if !strings.EqualFold(req.URL.Hostname(), from.Hostname()) {
		return &RedirectError{From: from.Host, To: req.URL.Host}
	}
	if len(via) >= maxRedirects {
		return fmt.Errorf("stopped after %d redirects", maxRedirects)
	}
	return nil
}

// DeniedError is a connection refused by a Policy.
type DeniedError struct {
	Addr netip.Addr
	Rule Rule // the rule that denied it
}

func (e *DeniedError) Error() string {
	return fmt.Sprintf("outbound address %s denied (%s %s; --allow-outbound to permit)", e.Addr, e.Rule.Prefix, e.Rule.Why)
}

// Permanent reports that retrying cannot help: the policy will refuse the
// address again.
func (e *DeniedError) Permanent() bool { return true }

// RedirectError is a redirect to another host, not followed.
type RedirectError struct {
	From, To string // hosts, as the URLs name them
}

func (e *RedirectError) Error() string {
	return fmt.Sprintf("redirect from %s to another host, %s, not followed", e.From, e.To)
}

// Permanent reports that retrying cannot help: the endpoint will redirect
// again.
func (e *RedirectError) Permanent() bool { return true }

// Refused reports whether err wraps a *DeniedError or a *RedirectError.
func Refused(err error) bool {
	if _, ok := errors.AsType[*DeniedError](err); ok {
		return true
	}
	_, ok := errors.AsType[*RedirectError](err)
	return ok
}

// nat64 is the well-known NAT64 prefix (RFC 6052): its addresses reach
// the IPv4 address in their last 32 bits.
var nat64 = netip.MustParsePrefix("64:ff9b::/96")

// canonicalAddr is the address addr reaches, as the rules are written:
// IPv4 for a mapped or NAT64 one, without the zone Contains refuses.
func canonicalAddr(addr netip.Addr) netip.Addr {
	addr = addr.WithZone("").Unmap()
	if nat64.Contains(addr) {
		b := addr.As16()
		return netip.AddrFrom4([4]byte(b[12:]))
	}
	return addr
}

// canonicalPrefix writes an IPv4-mapped prefix (::ffff:0:0/96 and longer)
// as the IPv4 prefix it holds, since addresses are judged unmapped.
func canonicalPrefix(p netip.Prefix) netip.Prefix {
	p = p.Masked()
	if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p
}

// ParsePrefixes parses a comma-separated list of CIDR prefixes (an address
// alone is its /32 or /128). Blank items are skipped.
func ParsePrefixes(list string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for item := range strings.SplitSeq(list, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		p, err := netip.ParsePrefix(item)
		if a, aerr := netip.ParseAddr(item); aerr == nil && a.Zone() == "" {
			p, err = netip.PrefixFrom(a, a.BitLen()), nil
		}
		if err != nil {
			return nil, fmt.Errorf("%q is not a CIDR prefix (such as 10.0.0.0/8 or fd00::/8)", item)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}
