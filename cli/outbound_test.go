package cli

import (
	"flag"
	"io"
	"net/netip"
	"strings"
	"testing"
)

func TestOutboundFlags(t *testing.T) {
	parse := func(args ...string) (*outboundFlags, error) {
		var f outboundFlags
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		f.register(fs)
		return &f, fs.Parse(args)
	}
	f, err := parse("--deny-outbound", "10.0.0.0/8,192.168.0.0/16", "--deny-outbound", "fd00::/8",
		"--allow-outbound", "10.1.0.0/16", "--allow-outbound", "169.254.169.254")
	if err != nil {
		t.Fatal(err)
	}
	p := f.policy()
	for addr, allowed := range map[string]bool{
		"10.2.3.4":        false,
		"10.1.2.3":        true,
		"192.168.1.1":     false,
		"fd00::1":         false,
		"169.254.169.254": true,
		"169.254.169.253": false,
		"127.0.0.1":       true,
	} {
		if got := p.Check(netip.MustParseAddr(addr)) == nil; got != allowed {
			t.Errorf("%s allowed=%v, want %v", addr, got, allowed)
		}
	}
	for _, bad := range []string{"10.0.0.0/33", "metadata.google.internal", "169.254.0.0/16,x"} {
		if _, err := parse("--allow-outbound", bad); err == nil || !strings.Contains(err.Error(), "allow-outbound") {
			t.Errorf("--allow-outbound %q: %v, want an error naming the flag", bad, err)
		}
	}
	// No flags: the defaults.
	f, _ = parse()
	if f.policy().Check(netip.MustParseAddr("169.254.169.254")) == nil {
		t.Error("the metadata address is allowed without flags")
	}
}
