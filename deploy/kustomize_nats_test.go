package deploy_test

import (
	"fmt"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	natsserver "github.com/nats-io/nats-server/v2/server"

	"github.com/osmo-rl/osmo/internal/natsstore"
)

// natsStatefulSet is the name of the NATS StatefulSet the manifests run.
const natsStatefulSet = "nats"

// quantityRE is a Kubernetes quantity with an optional suffix.
var quantityRE = regexp.MustCompile(`^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$`)

// parseQuantity returns a whole Kubernetes quantity (such as 10Gi or 512M)
// in units.
func parseQuantity(q string) (int64, error) {
	m := quantityRE.FindStringSubmatch(q)
	if m == nil {
		return 0, fmt.Errorf("quantity %q: want a whole number with Ki, Mi, Gi, Ti, k, M, G or T", q)
	}
	n, err := strconv.ParseInt(m[1], 10, 64)
	if err != nil {
		return 0, err
	}
	mult := map[string]int64{"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m[2]]
	return n * mult, nil
}

// goMemLimitRE is a GOMEMLIMIT value: bytes with Go's suffixes.
var goMemLimitRE = regexp.MustCompile(`^(\d+)(B|KiB|MiB|GiB|TiB)?$`)

// natsServerOptions parses the nats.conf of a NATS StatefulSet's ConfigMap
// with nats-server's own parser, as pod ordinal of the set would read it:
// POD_NAME from the downward API and the container's literal env values.
func natsServerOptions(t *testing.T, r *rendered, set deploymentSpec, c container, ordinal int) *natsserver.Options {
	t.Helper()
	var conf string
	for i, a := range c.Args {
		if (a == "--config" || a == "-c") && i+1 < len(c.Args) {
			conf = c.Args[i+1]
		} else if v, ok := strings.CutPrefix(a, "--config="); ok {
			conf = v
		}
	}
	if conf == "" {
		t.Fatalf("the NATS container runs without --config: %q", c.Args)
	}
	// The ConfigMap mounted at the file's directory.
	var data map[string]string
	for _, m := range c.VolumeMounts {
		if path.Clean(m.MountPath) != path.Dir(conf) {
			continue
		}
		for _, v := range set.Template.Spec.Volumes {
			if v.Name == m.Name && v.ConfigMap != nil {
				var ok bool
				if data, ok = r.configMaps[v.ConfigMap.Name]; !ok {
					t.Fatalf("the NATS pods mount ConfigMap %s, which does not exist", v.ConfigMap.Name)
				}
			}
		}
	}
	text, ok := data[path.Base(conf)]
	if !ok {
		t.Fatalf("--config %s: no ConfigMap mounted there holds %s", conf, path.Base(conf))
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name":
			t.Setenv(e.Name, fmt.Sprintf("%s-%d", natsStatefulSet, ordinal))
		case e.ValueFrom == nil:
			t.Setenv(e.Name, e.Value)
		}
	}
	f := filepath.Join(t.TempDir(), path.Base(conf))
	if err := os.WriteFile(f, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := natsserver.ProcessConfigFile(f)
	if err != nil {
		t.Fatalf("nats-server reading %s as %s-%d: %v", conf, natsStatefulSet, ordinal, err)
	}
	return opts
}

// containerPort is a container's port by name.
func containerPort(c container, name string) int {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	return 0
}

// checkNATS checks the NATS JetStream cluster holding the shared state: three
// nodes on claims of their own, one per machine in production, and a
// configuration that nats-server reads into a cluster of exactly those nodes.
func checkNATS(t *testing.T, r *rendered, dev bool) {
	t.Run("a three-node NATS JetStream cluster on persistent volumes", func(t *testing.T) {
		set, ok := r.statefulSets[natsStatefulSet]
		if !ok {
			t.Fatalf("no StatefulSet %s", natsStatefulSet)
		}
		if set.Replicas == nil || *set.Replicas != 3 {
			t.Fatalf("StatefulSet %s: replicas %v, want 3 (a quorum of two survives one node)", natsStatefulSet, set.Replicas)
		}
		replicas := *set.Replicas
		ps := set.Template.Spec
		if len(ps.Containers) != 1 {
			t.Fatalf("StatefulSet %s: %d containers, want the NATS server alone", natsStatefulSet, len(ps.Containers))
		}
		c := ps.Containers[0]
		if want := "nats:" + natsVersion(t) + "-alpine"; c.Image != want {
			t.Errorf("NATS image %q, want %s (go.mod's nats-server, with a shell for preStop)", c.Image, want)
		}

		// The headless Service names each node: nats-0.<serviceName>.
		headless, ok := r.services[set.ServiceName]
		if !ok || headless.ClusterIP != "None" || !selects(headless.Selector, set.Template.Metadata.Labels) {
			t.Errorf("StatefulSet %s: serviceName %q is no headless Service selecting its pods", natsStatefulSet, set.ServiceName)
		}
		if !headless.PublishNotReadyAddresses {
			t.Errorf("Service %s: publishNotReadyAddresses false; the nodes cannot find one another before they are ready", set.ServiceName)
		}

		// Every node keeps its files on a claim of its own.
		if len(set.VolumeClaimTemplates) != 1 {
			t.Fatalf("StatefulSet %s: %d volumeClaimTemplates, want one for JetStream", natsStatefulSet, len(set.VolumeClaimTemplates))
		}
		claim := set.VolumeClaimTemplates[0]
		size, err := parseQuantity(claim.Spec.Resources.Requests["storage"])
		if err != nil || size == 0 {
			t.Errorf("claim %s: storage %q: %v", claim.Metadata.Name, claim.Spec.Resources.Requests["storage"], err)
		}
		if !slices.Equal(claim.Spec.AccessModes, []string{"ReadWriteOnce"}) {
			t.Errorf("claim %s: access modes %v, want ReadWriteOnce", claim.Metadata.Name, claim.Spec.AccessModes)
		}
		claimPath := ""
		for _, m := range c.VolumeMounts {
			if m.Name == claim.Metadata.Name {
				claimPath = path.Clean(m.MountPath)
			}
		}

		// The configuration, as nats-server reads it on every node.
		seen := map[string]bool{}
		for ordinal := range replicas {
			opts := natsServerOptions(t, r, set, c, ordinal)
			self := fmt.Sprintf("%s-%d", natsStatefulSet, ordinal)
			if opts.ServerName != self {
				t.Errorf("%s: server_name %q, want its pod name (stable and unique)", self, opts.ServerName)
			}
			seen[opts.ServerName] = true
			if ordinal > 0 {
				continue
			}
			if !opts.JetStream {
				t.Error("nats.conf: JetStream is off")
			}
			if path.Clean(opts.StoreDir) != claimPath || claimPath == "" {
				t.Errorf("nats.conf: store_dir %q, want the claim's mount %q", opts.StoreDir, claimPath)
			}
			if opts.JetStreamMaxStore <= 0 || opts.JetStreamMaxStore >= size {
				t.Errorf("nats.conf: max_file_store %d, want it set and below the claim's %d bytes (indexes and Raft logs share the volume)", opts.JetStreamMaxStore, size)
			}
			if opts.MaxPayload < natsstore.DefaultMaxPayload {
				t.Errorf("nats.conf: max_payload %d, want at least %d (a finished rollout's record)", opts.MaxPayload, natsstore.DefaultMaxPayload)
			}
			for name, port := range map[string]int{"nats": opts.Port, "cluster": opts.Cluster.Port, "monitor": opts.HTTPPort} {
				if port == 0 || containerPort(c, name) != port {
					t.Errorf("nats.conf listens for %s on %d, the container's %q port is %d", name, port, name, containerPort(c, name))
				}
			}
			if opts.Cluster.Name == "" {
				t.Error("nats.conf: the cluster has no name")
			}
			var routes, want []string
			for _, u := range opts.Routes {
				routes = append(routes, u.String())
			}
			for i := range replicas {
				want = append(want, fmt.Sprintf("nats://%s-%d.%s:%d", natsStatefulSet, i, set.ServiceName, opts.Cluster.Port))
			}
			slices.Sort(routes)
			if !slices.Equal(routes, want) {
				t.Errorf("nats.conf: routes %v, want every node %v", routes, want)
			}
			// The probes read the monitoring port: ready when JetStream
			// is current, alive while it is on.
			for kind, p := range map[string]*probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
				if p == nil || p.HTTPGet == nil {
					t.Errorf("NATS %s probe: want an HTTP GET of /healthz", kind)
					continue
				}
				port, err := portOf(c, p.HTTPGet.Port)
				u, uerr := url.Parse(p.HTTPGet.Path)
				if err != nil || port != opts.HTTPPort || uerr != nil || u.Path != "/healthz" {
					t.Errorf("NATS %s probe: GET %s on %s, want /healthz on the monitoring port %d", kind, p.HTTPGet.Path, p.HTTPGet.Port, opts.HTTPPort)
				}
			}
			if c.Lifecycle == nil || c.Lifecycle.PreStop == nil || c.Lifecycle.PreStop.Exec == nil ||
				!slices.ContainsFunc(c.Lifecycle.PreStop.Exec.Command, func(a string) bool { return strings.Contains(a, "ldm="+opts.PidFile) }) {
				t.Errorf("NATS preStop %+v, want lame duck mode signalled through the pid file %q", c.Lifecycle, opts.PidFile)
			}
		}
		if len(seen) != replicas {
			t.Errorf("server names %v, want %d distinct", seen, replicas)
		}

		// Resources as NATS recommends: requests equal to limits, and the
		// Go collector's soft limit below the memory limit.
		for _, q := range []string{"cpu", "memory"} {
			if c.Resources.Requests[q] == "" || c.Resources.Requests[q] != c.Resources.Limits[q] {
				t.Errorf("NATS %s: request %q, limit %q; want them equal", q, c.Resources.Requests[q], c.Resources.Limits[q])
			}
		}
		limit, err := parseQuantity(c.Resources.Limits["memory"])
		gml, _ := c.env("GOMEMLIMIT")
		m := goMemLimitRE.FindStringSubmatch(gml)
		if err != nil || m == nil {
			t.Errorf("NATS GOMEMLIMIT %q with memory limit %q, want both set", gml, c.Resources.Limits["memory"])
		} else {
			n, _ := strconv.ParseFloat(m[1], 64)
			n *= map[string]float64{"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[m[2]]
			if frac := n / float64(limit); frac < 0.6 || frac > 0.9 {
				t.Errorf("NATS GOMEMLIMIT %s is %.0f%% of the memory limit %s, want 60..90%%", gml, 100*frac, c.Resources.Limits["memory"])
			}
		}

		// One node per machine in production; development may share one.
		var terms []podAffinityTerm
		if a := ps.Affinity; a != nil && a.PodAntiAffinity != nil {
			terms = a.PodAntiAffinity.Required
			if dev {
				for _, p := range a.PodAntiAffinity.Preferred {
					terms = append(terms, p.PodAffinityTerm)
				}
			}
		}
		if !slices.ContainsFunc(terms, func(term podAffinityTerm) bool {
			return term.TopologyKey == "kubernetes.io/hostname" && selects(term.LabelSelector.MatchLabels, set.Template.Metadata.Labels)
		}) {
			t.Errorf("StatefulSet %s: no pod anti-affinity keeping its nodes on different machines (required unless dev): %+v", natsStatefulSet, ps.Affinity)
		}
	})
}

// checkSharedState checks that the rollout and grader services keep their
// state in the NATS cluster, and nothing of it in their pods.
func checkSharedState(t *testing.T, r *rendered) {
	t.Run("rollout and grader share the NATS cluster and keep no state of their own", func(t *testing.T) {
		set := r.statefulSets[natsStatefulSet]
		for _, name := range []string{"rollout", "grader"} {
			d := r.deployments[name]
			c := d.Template.Spec.Containers[0]
			where := "Deployment " + name
			cl, err := parseCmdline(c.Args, helpOf(t, c.Args[0]))
			if err != nil {
				t.Errorf("%s: %v", where, err)
				continue
			}
			for _, flag := range []string{"state", "journal", "grader-journal"} {
				if v, ok := cl.last(flag); ok {
					t.Errorf("%s --%s=%q: the state is in NATS", where, flag, v)
				}
			}
			v, ok := cl.last("nats")
			if !ok {
				t.Errorf("%s has no --nats", where)
				continue
			}
			for _, u := range natsURLs(t, v) {
				// A Service in the pod's namespace, by its short name or
				// as NAME.$(POD_NAMESPACE).svc.cluster.local.
				host := strings.TrimSuffix(u.Hostname(), ".$(POD_NAMESPACE).svc.cluster.local")
				svc, ok := r.services[host]
				if !ok || !selects(svc.Selector, set.Template.Metadata.Labels) {
					t.Errorf("%s --nats %s: %q is no Service of the NATS StatefulSet", where, u, host)
					continue
				}
				port, _ := strconv.Atoi(u.Port())
				found := false
				for _, p := range svc.Ports {
					if p.Port == port {
						n, err := portOf(set.Template.Spec.Containers[0], p.TargetPort)
						found = err == nil && n == containerPort(set.Template.Spec.Containers[0], "nats")
					}
				}
				if !found {
					t.Errorf("%s --nats %s: Service %s has no port %d to the NATS client port", where, u, host, port)
				}
			}
			// Scratch space only: what must outlive the pod is in NATS.
			// Secrets (the TLS component's certificates) are read-only
			// inputs, not state.
			secrets := map[string]bool{}
			for _, v := range d.Template.Spec.Volumes {
				secrets[v.Name] = v.Secret != nil
			}
			for _, m := range c.VolumeMounts {
				if path.Clean(m.MountPath) != "/tmp" && !secrets[m.Name] {
					t.Errorf("%s mounts %s at %s; the pods keep no state", where, m.Name, m.MountPath)
				}
			}
		}
	})
}

// checkNATSNetworkPolicy checks who may reach the NATS pods: the rollout and
// grader pods the client port, the NATS pods one another's cluster port, no
// one else either.
func checkNATSNetworkPolicy(t *testing.T, r *rendered) {
	t.Run("only the rollout and grader pods reach NATS", func(t *testing.T) {
		set := r.statefulSets[natsStatefulSet]
		c := set.Template.Spec.Containers[0]
		client, cluster := containerPort(c, "nats"), containerPort(c, "cluster")
		// allowed[workload][port]; workload "*" is any source.
		allowed := map[string]map[int]bool{}
		allow := func(w string, port int) {
			if allowed[w] == nil {
				allowed[w] = map[int]bool{}
			}
			allowed[w][port] = true
		}
		isolated := false
		for name, p := range r.netpols {
			if !selects(p.PodSelector.MatchLabels, set.Template.Metadata.Labels) || !slices.Contains(p.PolicyTypes, "Ingress") {
				continue
			}
			isolated = true
			for _, rule := range p.Ingress {
				var ports []int
				for _, pp := range rule.Ports {
					n, err := portOf(c, pp.Port)
					if err != nil {
						t.Errorf("NetworkPolicy %s: %v", name, err)
					}
					ports = append(ports, n)
				}
				if len(rule.Ports) == 0 {
					ports = []int{client, cluster, containerPort(c, "monitor")}
				}
				var sources []string
				for _, f := range rule.From {
					if f.PodSelector == nil {
						sources = append(sources, "*")
						continue
					}
					sources = append(sources, r.selectedWorkloads(f.PodSelector.MatchLabels)...)
				}
				if len(rule.From) == 0 {
					sources = []string{"*"}
				}
				for _, w := range sources {
					for _, port := range ports {
						allow(w, port)
					}
				}
			}
		}
		if !isolated {
			t.Fatal("no NetworkPolicy selects the NATS pods: any pod in the cluster reaches the state")
		}
		for _, w := range []string{"Deployment/rollout", "Deployment/grader"} {
			if !allowed[w][client] {
				t.Errorf("%s may not reach the NATS client port %d", w, client)
			}
		}
		if !allowed["StatefulSet/"+natsStatefulSet][cluster] {
			t.Errorf("the NATS pods may not reach one another's cluster port %d", cluster)
		}
		for w, ports := range allowed {
			for port := range ports {
				ok := (port == client && (w == "Deployment/rollout" || w == "Deployment/grader")) ||
					(port == cluster && w == "StatefulSet/"+natsStatefulSet)
				if !ok {
					t.Errorf("%s may reach NATS port %d", w, port)
				}
			}
		}
	})
}
