package cli

import (
	"flag"
	"net/netip"
	"strings"

	"github.com/osmo-rl/osmo/internal/netguard"
)

// outboundFlags adjust which addresses the rollout service may connect to
// on a trainer's behalf (the policy and callback URLs it is handed): the
// defaults of netguard.DefaultDenied, with the operator's prefixes on top.
type outboundFlags struct {
	deny, allow prefixList
}

func (f *outboundFlags) register(fs *flag.FlagSet) {
	fs.Var(&f.deny, "deny-outbound", "also refuse trainer-named URLs (policy, callbacks) that reach these `CIDR`s, comma-separated (by default link-local, cloud metadata, unspecified and multicast addresses are refused)")
	fs.Var(&f.allow, "allow-outbound", "permit trainer-named URLs that reach these `CIDR`s, comma-separated, though the defaults or --deny-outbound refuse them; the most specific prefix decides")
}

// policy is the outbound address policy the flags make.
func (f *outboundFlags) policy() *netguard.Policy {
	return netguard.New(f.deny, f.allow)
}

// prefixList is a flag of comma-separated CIDR prefixes; given again, it
// adds to the list.
type prefixList []netip.Prefix

func (l *prefixList) String() string {
	if l == nil {
		return ""
	}
	s := make([]string, len(*l))
	for i, p := range *l {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

func (l *prefixList) Set(v string) error {
	ps, err := netguard.ParsePrefixes(v)
	if err != nil {
		return err
	}
	*l = append(*l, ps...)
	return nil
}
