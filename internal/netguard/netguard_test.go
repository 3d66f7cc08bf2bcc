package netguard

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/osmo-rl/osmo/internal/netguard/netguardtest"
)

func prefixes(t *testing.T, list string) []netip.Prefix {
	t.Helper()
	ps, err := ParsePrefixes(list)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		name        string
		deny, allow string
		addr        string
		denied      string // the prefix that denies it, "" when allowed
	}{
		{name: "metadata", addr: "169.254.169.254", denied: "169.254.0.0/16"},
		{name: "ECS task metadata", addr: "169.254.170.2", denied: "169.254.0.0/16"},
		{name: "mapped metadata", addr: "::ffff:169.254.169.254", denied: "169.254.0.0/16"},
		{name: "NAT64 metadata", addr: "64:ff9b::a9fe:a9fe", denied: "169.254.0.0/16"},
		{name: "v6 link-local", addr: "fe80::1", denied: "fe80::/10"},
		{name: "v6 link-local with zone", addr: "fe80::1%eth0", denied: "fe80::/10"},
		{name: "AWS v6 metadata", addr: "fd00:ec2::254", denied: "fd00:ec2::254/128"},
		{name: "Alibaba metadata", addr: "100.100.100.200", denied: "100.100.100.200/32"},
		{name: "unspecified v4", addr: "0.0.0.0", denied: "0.0.0.0/8"},
		{name: "this network", addr: "0.1.2.3", denied: "0.0.0.0/8"},
		{name: "unspecified v6", addr: "::", denied: "::/128"},
		{name: "mapped unspecified", addr: "::ffff:0.0.0.0", denied: "0.0.0.0/8"},
		{name: "multicast v4", addr: "239.1.2.3", denied: "224.0.0.0/4"},
		{name: "multicast v6", addr: "ff02::1", denied: "ff00::/8"},
		{name: "broadcast", addr: "255.255.255.255", denied: "255.255.255.255/32"},

		{name: "loopback v4", addr: "127.0.0.1"},
		{name: "loopback v6", addr: "::1"},
		{name: "mapped loopback", addr: "::ffff:127.0.0.1"},
		{name: "private 10", addr: "10.1.2.3"},
		{name: "private 192.168", addr: "192.168.0.10"},
		{name: "shared address space", addr: "100.64.0.1"},
		{name: "v6 unique local", addr: "fd00::1"},
		{name: "public", addr: "8.8.8.8"},

		{name: "allow one metadata address", allow: "169.254.169.254/32", addr: "169.254.169.254"},
		{name: "allowing one leaves the rest", allow: "169.254.169.254/32", addr: "169.254.169.253", denied: "169.254.0.0/16"},
		{name: "allow the whole built-in prefix", allow: "169.254.0.0/16", addr: "169.254.1.1"},
		{name: "allow an exact built-in address", allow: "100.100.100.200", addr: "100.100.100.200"},
		{name: "a wider allow does not lift a narrower deny", allow: "0.0.0.0/0", addr: "169.254.169.254", denied: "169.254.0.0/16"},
		{name: "deny private", deny: "10.0.0.0/8", addr: "10.9.9.9", denied: "10.0.0.0/8"},
		{name: "deny private but a subnet", deny: "10.0.0.0/8", allow: "10.1.0.0/16", addr: "10.1.2.3"},
		{name: "deny a host in an allowed subnet", deny: "10.1.2.3/32", allow: "10.1.0.0/16", addr: "10.1.2.3", denied: "10.1.2.3/32"},
		{name: "same prefix in both: deny wins", deny: "10.0.0.0/8", allow: "10.0.0.0/8", addr: "10.0.0.1", denied: "10.0.0.0/8"},
		{name: "deny loopback", deny: "127.0.0.0/8", addr: "::ffff:127.0.0.1", denied: "127.0.0.0/8"},
		{name: "mapped deny prefix", deny: "::ffff:10.0.0.0/104", addr: "10.2.3.4", denied: "10.0.0.0/8"},
		{name: "v6 allow leaves v4 alone", allow: "::/0", addr: "0.0.0.0", denied: "0.0.0.0/8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := New(prefixes(t, tc.deny), prefixes(t, tc.allow))
			err := p.Check(netip.MustParseAddr(tc.addr))
			if tc.denied == "" {
				if err != nil {
					t.Fatalf("Check(%s) = %v, want allowed", tc.addr, err)
				}
				return
			}
			de, ok := errors.AsType[*DeniedError](err)
			if !ok {
				t.Fatalf("Check(%s) = %v, want denied by %s", tc.addr, err, tc.denied)
			}
			if got := de.Rule.Prefix.String(); got != tc.denied {
				t.Errorf("Check(%s) denied by %s, want %s", tc.addr, got, tc.denied)
			}
			if !strings.Contains(err.Error(), "--allow-outbound") || !strings.Contains(err.Error(), tc.denied) {
				t.Errorf("error %q does not say which prefix denied it and how to permit it", err)
			}
		})
	}
}

func TestNilPolicyIsDefault(t *testing.T) {
	var p *Policy
	if p.Check(netip.MustParseAddr("169.254.169.254")) == nil {
		t.Fatal("a nil Policy allowed the metadata address")
	}
	if err := p.Check(netip.MustParseAddr("127.0.0.1")); err != nil {
		t.Fatalf("a nil Policy denied loopback: %v", err)
	}
}

func TestCheckURL(t *testing.T) {
	p := Default()
	for raw, denied := range map[string]bool{
		"http://169.254.169.254/latest/meta-data/": true,
		"http://[fe80::1]:8080/v1":                 true,
		"http://[fe80::1%25eth0]:8080/v1":          true,
		"https://[::ffff:169.254.169.254]/":        true,
		"http://0.0.0.0:9000/cb":                   true,
		"http://[::]:9000/cb":                      true,
		"http://metadata.google.internal/":         false, // a name: judged at dial time
		"http://127.0.0.1:8000/v1":                 false,
		"http://[::1]:8000/v1":                     false,
		"http://trainer.default.svc:8000/v1":       false,
		"::not a url":                              false,
	} {
		err := p.CheckURL(raw)
		if got := err != nil; got != denied {
			t.Errorf("CheckURL(%q) = %v, want denied=%v", raw, err, denied)
		}
	}
}

func TestParsePrefixes(t *testing.T) {
	got, err := ParsePrefixes(" 10.0.0.0/8, fd00::/8 ,,169.254.169.254,10.1.2.3/8")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.0/8", "fd00::/8", "169.254.169.254/32", "10.0.0.0/8"}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range want {
		if got[i].String() != want[i] {
			t.Errorf("item %d: got %s, want %s", i, got[i], want[i])
		}
	}
	for _, bad := range []string{"10.0.0.0/33", "example.com", "10.0.0", "fe80::1%eth0", "10.0.0.0/8,nope"} {
		if _, err := ParsePrefixes(bad); err == nil {
			t.Errorf("ParsePrefixes(%q) accepted it", bad)
		}
	}
}

// TestDialerChecksTheResolvedAddress: a name admission could not judge
// fails when it resolves to a denied address, before any connection; one
// that resolves to loopback is reached.
func TestDialerChecksTheResolvedAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	d := Default().Dialer(&net.Dialer{
		Timeout: 5 * time.Second,
		Resolver: netguardtest.Resolver(map[string]netip.Addr{
			"metadata.test.":  netip.MustParseAddr("169.254.169.254"),
			"metadata6.test.": netip.MustParseAddr("fe80::a9fe:a9fe"),
			"mapped.test.":    netip.MustParseAddr("::ffff:169.254.169.254"),
			"trainer.test.":   netip.MustParseAddr("127.0.0.1"),
		}),
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for name, want := range map[string]string{
		"metadata.test":  "169.254.169.254",
		"metadata6.test": "fe80::a9fe:a9fe",
		"mapped.test":    "169.254.169.254", // the resolver unmaps it
	} {
		c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(name, "80"))
		if err == nil {
			c.Close()
			t.Errorf("dial %s: connected, want denied", name)
			continue
		}
		de, ok := errors.AsType[*DeniedError](err)
		if !ok || !Refused(err) {
			t.Errorf("dial %s: %v, want a *DeniedError", name, err)
			continue
		}
		if de.Addr.String() != want {
			t.Errorf("dial %s: denied %s, want %s", name, de.Addr, want)
		}
	}
	c, err := d.DialContext(ctx, "tcp", net.JoinHostPort("trainer.test", port))
	if err != nil {
		t.Fatalf("dial a loopback trainer: %v", err)
	}
	c.Close()
}

// TestDialerKeepsBaseControl: a base dialer's own Control still runs,
// after the check.
func TestDialerKeepsBaseControl(t *testing.T) {
	ran := 0
	d := Default().Dialer(&net.Dialer{Control: func(string, string, syscall.RawConn) error { ran++; return nil }})
	if _, err := d.Dial("tcp", "169.254.169.254:80"); !Refused(err) {
		t.Fatalf("dial metadata: %v, want refused", err)
	}
	if ran != 0 {
		t.Errorf("base Control ran for a denied address")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if ran != 1 {
		t.Errorf("base Control ran %d times, want 1", ran)
	}
}

// guardedClient is a client as the callback sender builds one.
func guardedClient(p *Policy, r *net.Resolver) *http.Client {
	return &http.Client{
		Transport:     &http.Transport{DialContext: p.Dialer(&net.Dialer{Resolver: r}).DialContext},
		CheckRedirect: CheckRedirect,
		Timeout:       10 * time.Second,
	}
}

func TestClientRefusesMetadataThroughTheTransport(t *testing.T) {
	c := guardedClient(Default(), netguardtest.Resolver(map[string]netip.Addr{"metadata.test.": netip.MustParseAddr("169.254.169.254")}))
	for _, u := range []string{"http://169.254.169.254/latest/meta-data/", "http://metadata.test/latest/meta-data/", "http://[::ffff:169.254.169.254]/"} {
		resp, err := c.Get(u)
		if err == nil {
			resp.Body.Close()
			t.Errorf("GET %s: answered %d, want refused", u, resp.StatusCode)
			continue
		}
		if _, ok := errors.AsType[*DeniedError](err); !ok {
			t.Errorf("GET %s: %v, want a *DeniedError in the chain", u, err)
		}
	}
}

func TestCheckRedirect(t *testing.T) {
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/to-metadata":
			http.Redirect(w, r, "http://169.254.169.254/latest/meta-data/iam/", http.StatusTemporaryRedirect)
		case "/to-other-name":
			// The same address under another name is another host.
			http.Redirect(w, r, strings.Replace(srv.URL, "127.0.0.1", "localhost", 1)+"/ok", http.StatusTemporaryRedirect)
		case "/to-same-host":
			http.Redirect(w, r, "/ok", http.StatusTemporaryRedirect)
		case "/loop":
			http.Redirect(w, r, "/loop", http.StatusFound)
		case "/ok":
			_, _ = io.WriteString(w, "ok")
		}
	}))
	defer srv.Close()
	c := guardedClient(Default(), nil)

	for _, path := range []string{"/to-metadata", "/to-other-name"} {
		resp, err := c.Post(srv.URL+path, "application/json", strings.NewReader("{}"))
		if err == nil {
			resp.Body.Close()
			t.Errorf("POST %s: answered %d, want the redirect refused", path, resp.StatusCode)
			continue
		}
		if _, ok := errors.AsType[*RedirectError](err); !ok || !Refused(err) {
			t.Errorf("POST %s: %v, want a *RedirectError", path, err)
		}
	}
	resp, err := c.Post(srv.URL+"/to-same-host", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatalf("redirect on the same host: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("redirect on the same host: %d", resp.StatusCode)
	}
	if resp, err := c.Get(srv.URL + "/loop"); err == nil || Refused(err) {
		if err == nil {
			resp.Body.Close()
		}
		t.Errorf("redirect loop: %v, want stopped (and not counted as refused)", err)
	}
}
