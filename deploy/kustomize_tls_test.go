package deploy_test

import (
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// certificateSpec is the part of a cert-manager Certificate the checks read.
type certificateSpec struct {
	SecretName string   `json:"secretName"`
	DNSNames   []string `json:"dnsNames"`
	Usages     []string `json:"usages"`
	IssuerRef  struct {
		Name  string `json:"name"`
		Kind  string `json:"kind"`
		Group string `json:"group"`
	} `json:"issuerRef"`
	PrivateKey struct {
		RotationPolicy string `json:"rotationPolicy"`
	} `json:"privateKey"`
}

// checkHealthProbe checks an exec probe: osmo health of one of the
// container's own ports, over loopback.
func checkHealthProbe(c container, cmd []string) error {
	if len(cmd) < 3 || cmd[0] != "/osmo" || cmd[1] != "health" {
		return fmt.Errorf("exec probe %q, want /osmo health ADDR", cmd)
	}
	target := cmd[len(cmd)-1]
	if u, err := url.Parse(target); err == nil && (u.Scheme == "http" || u.Scheme == "https") {
		target = u.Host
	}
	host, port, err := net.SplitHostPort(target)
	if err != nil {
		return fmt.Errorf("exec probe %q: %v", cmd, err)
	}
	if host != "localhost" {
		return fmt.Errorf("exec probe %q checks %s, want localhost", cmd, host)
	}
	_, err = portOf(c, json.RawMessage(port))
	return err
}

// renderWithTLS renders the prod overlay with the TLS component, as an
// overlay of the user's on top of it would opt in (the prod overlay's own
// kustomization.yaml shows the same lines, commented out).
func renderWithTLS(t *testing.T) *rendered {
	t.Helper()
	root, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	// kustomize takes no absolute paths to other kustomizations.
	rel := func(p string) string {
		r, err := filepath.Rel(dir, filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	k := fmt.Sprintf("namespace: osmo\nresources:\n  - %s\ncomponents:\n  - %s\n", rel("overlays/prod"), rel("components/tls"))
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o600); err != nil {
		t.Fatal(err)
	}
	return render(t, dir, "osmo-api-key")
}

// TestKustomizeTLSComponent renders the prod overlay with
// components/tls: a cert-manager Certificate per service, each mounted
// whole (so renewals reach the running process) and given to osmo by its
// OSMO_TLS_* variables, probes that speak TLS, and the overlay otherwise
// unchanged.
func TestKustomizeTLSComponent(t *testing.T) {
	b, err := os.ReadFile("overlays/prod/kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "#   - ../../components/tls") {
		t.Error("overlays/prod/kustomization.yaml does not show how to opt in to components/tls")
	}
	r := renderWithTLS(t)
	checkObjects(t, r, "osmo")
	checkServices(t, r)
	checkContainers(t, r)
	checkSharedState(t, r)

	certs := map[string]certificateSpec{}
	for _, o := range r.objects {
		if o.Kind != "Certificate" {
			continue
		}
		if o.APIVersion != "cert-manager.io/v1" {
			t.Errorf("Certificate %s: apiVersion %s", o.Metadata.Name, o.APIVersion)
		}
		var c certificateSpec
		if err := json.Unmarshal(o.Spec, &c); err != nil {
			t.Fatal(err)
		}
		certs[o.Metadata.Name] = c
	}
	prod := render(t, "overlays/prod", "osmo-api-key")
	for _, svc := range []string{"rollout", "grader", "gateway"} {
		t.Run(svc, func(t *testing.T) {
			cert, ok := certs[svc+"-tls"]
			if !ok {
				t.Fatalf("no Certificate %s-tls (have %v)", svc, certs)
			}
			if cert.SecretName != svc+"-tls" || cert.IssuerRef.Name != "osmo-tls" || cert.IssuerRef.Kind != "Issuer" {
				t.Errorf("Certificate %s-tls: secret %q, issuer %s %q", svc, cert.SecretName, cert.IssuerRef.Kind, cert.IssuerRef.Name)
			}
			for _, u := range []string{"server auth", "client auth"} {
				if !slices.Contains(cert.Usages, u) {
					t.Errorf("Certificate %s-tls: usages %v lack %q: each service is a server and a client", svc, cert.Usages, u)
				}
			}
			if cert.PrivateKey.RotationPolicy != "Always" {
				t.Errorf("Certificate %s-tls: the key is not rotated with the certificate", svc)
			}
			// The names its clients dial (the headless Service in the
			// overlay's namespace) and the probes' localhost.
			for _, n := range []string{svc + ".osmo.svc.cluster.local", "localhost"} {
				if !slices.Contains(cert.DNSNames, n) {
					t.Errorf("Certificate %s-tls: dnsNames %v lack %s", svc, cert.DNSNames, n)
				}
			}

			d := r.deployments[svc]
			c := d.Template.Spec.Containers[0]
			mounts := map[string]string{}
			for _, m := range c.VolumeMounts {
				mounts[m.Name] = m.MountPath
			}
			var dir string
			for _, v := range d.Template.Spec.Volumes {
				if v.Secret == nil || v.Secret.SecretName != cert.SecretName {
					continue
				}
				dir = mounts[v.Name]
				if m := v.Secret.DefaultMode; m == nil || *m&0o077&^0o040 != 0 {
					t.Errorf("the Secret %s is mounted with mode %v: the key must not be readable by others", cert.SecretName, m)
				}
			}
			if dir == "" {
				t.Fatalf("the Secret %s is not mounted", cert.SecretName)
			}
			for name, file := range map[string]string{"OSMO_TLS_CERT": "tls.crt", "OSMO_TLS_KEY": "tls.key", "OSMO_TLS_CA": "ca.crt"} {
				if v, _ := c.env(name); v != dir+"/"+file {
					t.Errorf("%s=%q, want %s/%s", name, v, dir, file)
				}
			}
			h := helpOf(t, c.Args[0])
			for _, f := range []string{"tls-cert", "tls-key", "tls-ca"} {
				if _, ok := h.flags[f]; !ok {
					t.Errorf("osmo %s has no --%s", c.Args[0], f)
				}
			}
			for kind, p := range map[string]*probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
				if p.GRPC != nil || p.HTTPGet != nil {
					t.Errorf("%s probe speaks plaintext to a TLS port", kind)
				}
			}
			if cmd := c.ReadinessProbe.Exec; cmd == nil || (svc == "gateway") != strings.HasPrefix(cmd.Command[len(cmd.Command)-1], "https://") {
				t.Errorf("readiness probe %+v, want osmo health (https:// for the gateway)", cmd)
			}
			// The component adds to the overlay; it replaces none of its args.
			if want := prod.deployments[svc].Template.Spec.Containers[0].Args; !slices.Equal(c.Args, want) {
				t.Errorf("args %q, want the overlay's %q", c.Args, want)
			}
			if want := strconv.Itoa(len(prod.deployments[svc].Template.Spec.Volumes) + 1); strconv.Itoa(len(d.Template.Spec.Volumes)) != want {
				t.Errorf("%d volumes, want the overlay's and one more", len(d.Template.Spec.Volumes))
			}
		})
	}
}
